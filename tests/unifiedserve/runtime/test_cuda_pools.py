"""CUDA IPC pools: handle exchange and teardown order with a fake driver; a real cross-process share on a GPU."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from unifiedserve.runtime import cuda_pools
from unifiedserve.runtime.cuda_pools import IPC_HANDLE_BYTES, CudaPoolOwner, OpenedPool
from unifiedserve.runtime.shm import PoolSpec


class FakeDriver:
    """Records every call; allocations are numbered, handles encode the pointer."""

    def __init__(self):
        self.events: list[tuple] = []
        self.live: dict[int, int] = {}  # ptr -> bytes
        self.mapped: dict[int, int] = {}  # opened ptr -> owner ptr
        self._next = 0x1000

    def alloc(self, device, num_bytes):
        ptr, self._next = self._next, self._next + num_bytes
        self.live[ptr] = num_bytes
        self.events.append(("alloc", device, ptr, num_bytes))
        return ptr

    def free(self, device, ptr):
        assert ptr in self.live, "double free"
        assert ptr not in self.mapped.values(), "freed while another process maps it"
        del self.live[ptr]
        self.events.append(("free", device, ptr))

    def ipc_handle(self, device, ptr):
        return ptr.to_bytes(8, "little") + bytes(IPC_HANDLE_BYTES - 8)

    def ipc_open(self, device, handle):
        owner_ptr = int.from_bytes(handle[:8], "little")
        assert owner_ptr in self.live, "opened a freed allocation"
        mapped = 0x9000_0000 + owner_ptr
        self.mapped[mapped] = owner_ptr
        self.events.append(("open", device, owner_ptr))
        return mapped

    def ipc_close(self, device, ptr):
        del self.mapped[ptr]
        self.events.append(("close", device, ptr))


def test_create_describes_each_pool_with_its_handle():
    driver = FakeDriver()
    owner = CudaPoolOwner(driver)
    kv = owner.create("kv", (2, 2, 8, 16, 4, 128), torch.bfloat16, device=0)
    patch = owner.create("patch", (64, 256, 1176), torch.float32, device=0)
    assert kv.cuda_device == 0 and len(kv.cuda_handle) == IPC_HANDLE_BYTES and kv.path is None
    assert kv.num_bytes == 2 * 2 * 8 * 16 * 4 * 128 * 2 and owner.num_bytes == kv.num_bytes + patch.num_bytes
    assert [e[0] for e in driver.events] == ["alloc", "alloc"] and driver.events[0][3] == kv.num_bytes
    with pytest.raises(ValueError, match="exists already"):
        owner.create("kv", (1,), torch.float32, 0)
    with pytest.raises(ValueError, match="positive sizes"):
        owner.create("empty", (4, 0), torch.float32, 0)


def test_owner_frees_only_after_every_opener_is_gone():
    driver = FakeDriver()
    owner = CudaPoolOwner(driver)
    spec = owner.create("kv", (4, 16), torch.float16, device=1)
    opened = OpenedPool(spec, driver)  # a worker maps it
    with pytest.raises(RuntimeError, match="still mapped by core, decode"):
        owner.free_all(live_openers=["decode", "core"])
    assert driver.live  # nothing was freed
    opened.close()
    opened.close()  # idempotent
    owner.free_all(live_openers=[])
    owner.free_all()  # a second stop frees nothing twice
    assert [e[0] for e in driver.events] == ["alloc", "open", "close", "free"]
    assert not driver.live and not driver.mapped
    with pytest.raises(RuntimeError, match="was freed"):
        owner.tensor("kv")


def test_open_refuses_specs_that_are_not_cuda_pools():
    driver = FakeDriver()
    with pytest.raises(ValueError, match="not a CUDA IPC pool"):
        OpenedPool(PoolSpec("patch", (4,), "float32", path="/dev/shm/x"), driver)
    with pytest.raises(ValueError, match="3-byte handle"):
        OpenedPool(PoolSpec("kv", (4,), "float32", cuda_handle=b"abc", cuda_device=0), driver)


def _child_adds_one(spec: PoolSpec, queue) -> None:
    try:
        t = cuda_pools.open_cuda_pool(spec)
        t += 1
        torch.cuda.synchronize()
        queue.put(float(t.sum()))
    except BaseException as e:  # report, never hang the parent
        queue.put(repr(e))


@pytest.mark.cuda
def test_a_pool_written_in_one_process_is_read_in_another():
    owner = CudaPoolOwner()
    spec = owner.create("kv", (1024, 256), torch.bfloat16, device=0)
    mine = owner.tensor("kv")
    mine.fill_(2.0)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_adds_one, args=(spec, queue))
    child.start()
    result = queue.get(timeout=120)
    child.join(30)
    assert result == 3.0 * 1024 * 256, result
    assert torch.equal(mine, torch.full_like(mine, 3.0))  # the child's write, seen by the owner: no copy
    owner.free_all(live_openers=[] if child.exitcode is not None else ["child"])


class _FakeProcess:
    def __init__(self, alive):
        self.alive, self.name, self.exitcode = alive, "fake", None if alive else 0

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        pass

    terminate = kill = join


def test_runtime_owns_cuda_pools_and_frees_them_after_its_workers(monkeypatch, caplog):
    from unifiedserve.runtime.config import RuntimeConfig
    from unifiedserve.runtime.launcher import Runtime

    from unifiedserve.engine.config import EngineConfig

    driver = FakeDriver()
    monkeypatch.setattr(cuda_pools, "DriverApi", lambda: driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA engine config on a machine without one
    shapes = {"kv": (2, 2, 8, 16, 2, 64), "patch": (4, 256, 1176)}
    engine = EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=8)
    runtime = Runtime(RuntimeConfig(model="m", served_model_name="m", engine=engine, gpu=3, pool_shapes=shapes))
    runtime.create_pools()
    pools = runtime.config.pools
    assert set(pools) == {"kv", "patch"}
    assert all(p.cuda_device == 0 and p.path is None for p in pools.values())  # workers see their GPU as cuda:0
    assert [e[1] for e in driver.events] == [3, 3]  # allocated on the physical GPU
    runtime.processes = {"decode": _FakeProcess(alive=True)}
    runtime.stopping = True
    runtime.processes["decode"].is_alive = lambda: True  # a worker that will not die
    runtime.stop(timeout=0)
    assert driver.live and "not freeing the CUDA pools: decode still alive" in caplog.text
    runtime.processes = {"decode": _FakeProcess(alive=False)}
    runtime.stop(timeout=0)
    assert not driver.live and [e[0] for e in driver.events] == ["alloc", "alloc", "free", "free"]


def test_a_failed_free_after_a_fault_still_cleans_up(monkeypatch, caplog, tmp_path):
    """After a fatal fault under MPS the driver refuses every call, cuMemFree too: stop logs it and still
    removes the sockets' folder (the memory goes with the process)."""
    from unifiedserve.engine.config import EngineConfig
    from unifiedserve.runtime.config import RuntimeConfig
    from unifiedserve.runtime.launcher import Runtime

    driver = FakeDriver()
    monkeypatch.setattr(cuda_pools, "DriverApi", lambda: driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=8)
    runtime = Runtime(RuntimeConfig(model="m", served_model_name="m", engine=engine,
                                    pool_shapes={"kv": (2, 2, 8, 16, 2, 64)}))
    runtime.create_pools()

    def refuse(device, ptr):
        raise RuntimeError("cuMemFree failed: CUDA_ERROR_ILLEGAL_ADDRESS")

    driver.free = refuse
    runtime.processes = {"decode": _FakeProcess(alive=False)}
    runtime.stop(timeout=0)
    assert "could not free the CUDA pools (cuMemFree failed: CUDA_ERROR_ILLEGAL_ADDRESS)" in caplog.text
    assert not os.path.exists(runtime.ipc_dir)


# A stand-in for libcuda.so.1 with the driver's ABI and two of its rules that no Python fake can check: a
# primary context is reset (its allocations and IPC mappings gone) when its last reference is released,
# and cuIpcOpenMemHandle takes the 64-byte handle by value.
STUB_DRIVER = """
#include <stdint.h>
#include <string.h>
typedef struct { char reserved[64]; } CUipcMemHandle;
static int refs = 0, generation = 0;
static uint64_t live[16]; static int live_gen[16]; static int n_live = 0;
static uint64_t maps[16]; static int map_gen[16]; static int n_maps = 0;
static int current = 0;
int cuInit(unsigned f) { return 0; }
int cuGetErrorName(int e, const char **s) { *s = "CUDA_ERROR_STUB"; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { refs++; *c = (void *)(uintptr_t)(0x100 + d); return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { if (--refs == 0) generation++; return 0; }  /* reset: all gone */
int cuCtxPushCurrent_v2(void *c) { if (refs <= 0) return 201; current = 1; return 0; }
int cuCtxPopCurrent_v2(void **c) { current = 0; return 0; }
static int valid(uint64_t *a, int *g, int n, uint64_t p) {
  for (int i = 0; i < n; i++) if (a[i] == p && g[i] == generation) return i;
  return -1;
}
int cuMemAlloc_v2(uint64_t *p, size_t n) {
  if (!current) return 201;
  *p = 0x7000000 + 0x1000 * (uint64_t)n_live; live[n_live] = *p; live_gen[n_live++] = generation; return 0;
}
int cuMemFree_v2(uint64_t p) { int i = valid(live, live_gen, n_live, p); if (i < 0) return 1; \
live_gen[i] = -1; return 0; }
int cuIpcGetMemHandle(CUipcMemHandle *h, uint64_t p) {
  if (!current || valid(live, live_gen, n_live, p) < 0) return 1;
  memset(h->reserved, 0xAB, 64); memcpy(h->reserved, &p, 8); return 0;
}
int cuIpcOpenMemHandle_v2(uint64_t *out, CUipcMemHandle h, unsigned flags) {
  uint64_t p; memcpy(&p, h.reserved, 8);
  if (!current || flags != 1 || (unsigned char)h.reserved[63] != 0xAB || valid(live, live_gen, n_live, p) < 0) return 1;
  *out = p + 0x100000000ull; maps[n_maps] = *out; map_gen[n_maps++] = generation; return 0;
}
int cuMemGetInfo_v2(size_t *free, size_t *total) {
  if (!current) return 201;
  *total = (size_t)80 << 30; *free = *total - ((size_t)n_live << 20); return 0;
}
int cuIpcCloseMemHandle(uint64_t p) { int i = valid(maps, map_gen, n_maps, p); if (i < 0) return 1; \
map_gen[i] = -1; return 0; }
int stub_live_allocations(void) { int k = 0; for (int i = 0; i < n_live; i++) \
k += live_gen[i] == generation; return k; }
int stub_live_mappings(void) { int k = 0; for (int i = 0; i < n_maps; i++) k += map_gen[i] == generation; return k; }
int stub_context_refs(void) { return refs; }
"""


@pytest.fixture
def stub_driver(tmp_path):
    import ctypes
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the driver stand-in")
    (tmp_path / "stub.c").write_text(STUB_DRIVER)
    lib = tmp_path / "libcuda_stub.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(lib), str(tmp_path / "stub.c")], check=True)
    return str(lib), ctypes.CDLL(str(lib))


def test_the_driver_calls_keep_pools_alive_and_pass_handles_by_value(stub_driver):
    """Against the driver's ABI: pools outlive the calls that made them (the primary context is kept), the
    handle reaches cuIpcOpenMemHandle by value with its flags, and closing releases the contexts."""
    path, stub = stub_driver
    owner = CudaPoolOwner(cuda_pools.DriverApi(path))
    spec = owner.create("kv", (4, 256), torch.bfloat16, device=0)  # alloc, then a handle in a later call
    assert stub.stub_live_allocations() == 1 and len(spec.cuda_handle) == IPC_HANDLE_BYTES
    opener = cuda_pools.DriverApi(path)  # a worker's (here: the same process, so the same stub state)
    pool = OpenedPool(spec, opener)
    assert pool.ptr and stub.stub_live_mappings() == 1  # still mapped after the call returned
    pool.close()
    opener.close()
    free, total = owner.api.mem_info(0)  # in the device's context (the stand-in refuses a call outside one)
    assert total == 80 << 30 and free == total - (1 << 20)
    owner.free_all()
    assert stub.stub_live_allocations() == 0 and stub.stub_context_refs() == 0
