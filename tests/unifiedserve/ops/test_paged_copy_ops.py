"""paged_scatter / paged_gather: native (csrc/paged_copy.cpp) against the torch reference, and the fallback."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import pathlib
import random
import shutil
import subprocess
import sys

import pytest
import torch

from unifiedserve import ops
from unifiedserve.memory.pages import PageAllocator, PagedStream, RaggedIndex, plan_read, plan_write
from unifiedserve.ops import RaggedIndexTensors, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_index(rng: random.Random, num_pages: int, page_size: int) -> RaggedIndex:
    """A batch of up to 5 requests, each starting at any token position, on distinct random pages."""
    free = list(range(num_pages))
    rng.shuffle(free)
    spans = []
    for _ in range(rng.randint(0, 5)):
        cu = rng.randint(0, 3 * page_size)
        n = rng.choice([0, 1, page_size - 1, page_size, page_size + 1, rng.randint(0, 4 * page_size)])
        need = 0 if n == 0 else -(-(cu % page_size + n) // page_size)
        if need > len(free):
            break
        spans.append((n, cu, [free.pop() for _ in range(need)]))
    return RaggedIndex.build(spans, page_size)


def random_tensor(shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


def shifted_rows(num_rows: int, feature: tuple, dtype, gen, shift: int) -> torch.Tensor:
    """A contiguous [num_rows, *feature] tensor starting ``shift`` elements into its storage (misaligned)."""
    row = math.prod(feature)
    flat = random_tensor(((num_rows + 1) * row + shift,), dtype, gen)
    return flat[shift:shift + num_rows * row].view(num_rows, *feature)


# trailing dims of a row (() = one element per row); with the dtypes they cover every CUDA copy width:
# 16 B (8 x bf16), 8 B (2 x fp32), 4 B, 2 B (1 x fp16), 1 B (uint8)
FEATURES = [(3,), (7,), (2, 5), (), (8,), (2,)]


def check_parity(kernels, device: str, dtype: torch.dtype, page_size: int, trials: int = 20) -> None:
    """Random batches through ``kernels`` (torch.ops.unifiedserve) and the reference: equal bytes."""
    rng, gen = random.Random(page_size), torch.Generator().manual_seed(page_size)
    for trial in range(trials):
        feature = FEATURES[trial % len(FEATURES)]
        num_pages = rng.randint(1, 40)
        index = random_index(rng, num_pages, page_size)
        ix = RaggedIndexTensors.from_index(index, device)
        src = shifted_rows(index.num_tokens, feature, dtype, gen, shift=trial % 3).to(device)
        start = random_tensor((num_pages, page_size, *feature), dtype, gen).to(device)
        got, want = start.clone(), start.clone()
        kernels.paged_scatter(got, src, *ix)
        reference.paged_scatter(want, src, ix)
        assert torch.equal(got, want), f"trial {trial}: scatter differs"  # exact: both only move bytes
        assert torch.equal(kernels.paged_gather(got, *ix), reference.paged_gather(want, ix))
        assert torch.equal(kernels.paged_gather(got, *ix), src)  # a write then a read is the identity


@pytest.mark.parametrize("dtype", DTYPES + [torch.uint8])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_native_matches_reference(native, dtype, page_size):
    check_parity(native, "cpu", dtype, page_size)


def test_threads_split_long_requests(native):
    """Big enough that at::parallel_for splits the pages over threads; one request spans most of them."""
    gen = torch.Generator().manual_seed(0)
    alloc, page_size = PageAllocator(600, 16), 16
    a, b = PagedStream("a", page_size), PagedStream("b", page_size)
    plan_write([(a, 5)], alloc)
    index = plan_write([(a, 7000), (b, 333)], alloc)
    buffer = torch.zeros(600, page_size, 256)
    src = torch.randn(index.num_tokens, 256, generator=gen)
    want = buffer.clone()
    ops.paged_scatter(buffer, src, index)
    reference.paged_scatter(want, src, RaggedIndexTensors.from_index(index))
    assert torch.equal(buffer, want)
    read, _ = plan_read([(a, 5), (b, 100)], page_size)
    read2, _ = plan_read([(a, 7000), (b, 233)], page_size)
    assert torch.equal(ops.paged_gather(buffer, read2), torch.cat([src[:7000], src[7100:]]))
    assert torch.equal(ops.paged_gather(buffer, read)[5:], src[7000:7100])


def test_planned_stream_round_trip(native):
    """Chunks written and read with different chunkings come back in order, through the public ops."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    page_size, dim = 4, 6
    alloc = PageAllocator(64, page_size)
    buffer = torch.zeros(64, page_size, dim, dtype=torch.bfloat16)
    streams = [PagedStream(i, page_size, num_tokens=rng.randint(1, 40)) for i in range(4)]
    rows = {s.request_id: random_tensor((s.num_tokens, dim), torch.bfloat16, gen) for s in streams}
    out = {s.request_id: [] for s in streams}
    while not all(s.is_finished for s in streams):
        writes = [(s, min(rng.randint(0, 9), s.num_tokens - s.num_written_tokens)) for s in streams]
        index = plan_write(writes, alloc)
        ops.paged_scatter(buffer, torch.cat([rows[s.request_id][s.num_written_tokens - n:s.num_written_tokens]
                                             for s, n in writes]), index)
        reads = [(s, rng.randint(0, s.num_unread_tokens)) for s in streams]
        index, to_free = plan_read(reads, page_size)
        chunk = ops.paged_gather(buffer, index)
        for (s, n), start in zip(reads, index.pv_indptr):
            out[s.request_id].append(chunk[start:start + n])
        alloc.free(to_free)
    for s in streams:
        assert torch.equal(torch.cat(out[s.request_id]), rows[s.request_id])
    assert alloc.num_free_pages == alloc.num_pages


def bad_inputs(device: str = "cpu", native: bool = True):
    """The zero buffer, a good index, and (index, src) pairs that must be rejected.

    ``native`` adds the index layouts only the kernels reject (int32, 2-D, strided): the reference takes
    any integer tensors.
    """
    buffer = torch.zeros(4, 4, 3, device=device)
    good = RaggedIndexTensors.from_index(RaggedIndex.build([(3, 2, [1, 2])], 4), device)
    t = lambda values, **kw: torch.tensor(values, device=device, **kw)  # noqa: E731
    ones = lambda *shape, **kw: torch.ones(*shape, device=device, **kw)  # noqa: E731
    cases = [
        (good._replace(pv_page_indices=t([1]), pv_page_indptr=t([0, 1])), ones(3, 3)),  # lists too few pages
        (good._replace(pv_page_indices=t([1, 9])), ones(3, 3)),  # page out of range
        (good._replace(pv_page_indices=t([1, -1])), ones(3, 3)),
        (good._replace(pv_indptr=t([0, -3])), ones(3, 3)),  # negative row count
        (good._replace(pv_indptr=t([0])), ones(3, 3)),  # B+1 entries expected
        (good, ones(2, 3)), (good, ones(3, 3, dtype=torch.float64)), (good, ones(3, 4)),
    ]
    if native:
        cases += [(good._replace(pv_indptr=t([0, 3], dtype=torch.int32)), ones(3, 3)),
                  (good._replace(pv_page_indices=t([[1, 2]])), ones(3, 3)),
                  (good._replace(pv_page_indices=t([1, 5, 2])[::2]), ones(3, 3))]  # not contiguous
    if device != "cpu":  # mixed devices
        cases += [(RaggedIndexTensors.from_index(RaggedIndex.build([(3, 2, [1, 2])], 4)), ones(3, 3)),
                  (good, torch.ones(3, 3))]
    return buffer, good, cases


def check_bad_inputs(scatter, device: str = "cpu", native: bool = True, trace: bool = False) -> None:
    """Each bad case raises and writes nothing. ``trace`` prints each case's number before its call (flushed), so a
    child process that crashes in one (check_in_child) shows which."""
    buffer, good, cases = bad_inputs(device, native)
    cases += [(good, None, buffer.transpose(0, 1)),  # buffer not contiguous
              (good, torch.ones(0, 3, device=device), torch.zeros(4, 0, 3, device=device))]  # page_size 0
    for i, (ix, src, *other) in enumerate(cases):
        target = other[0] if other else buffer
        if trace:
            print(f"bad case {i}", flush=True)
        with pytest.raises(RuntimeError):
            scatter(target, torch.ones(3, 3, device=device) if src is None else src, ix)
        assert not buffer.any(), f"bad case {i} wrote to the buffer"


def test_bad_input_raises_and_writes_nothing_reference():
    check_bad_inputs(reference.paged_scatter, native=False)


# Loaded into a child that crashed, on its second run: prints the native frames of a fatal signal (faulthandler
# shows only the Python ones, then re-raises the signal into this handler).
_NATIVE_TRACE_C = r"""
#include <execinfo.h>
#include <signal.h>
static void on_fatal(int sig) {
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
__attribute__((constructor)) static void install(void) {
  signal(SIGSEGV, on_fatal); signal(SIGBUS, on_fatal); signal(SIGFPE, on_fatal); signal(SIGILL, on_fatal);
}
"""


def _native_trace(argv: list[str], env: dict, tmp: pathlib.Path) -> str:
    """The child's stderr when run again with the native-trace handler preloaded ('' without a C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return ""
    (tmp / "trace.c").write_text(_NATIVE_TRACE_C)
    built = subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp / "trace.so"), str(tmp / "trace.c")],
                           capture_output=True, text=True)
    if built.returncode != 0:
        return f"(native trace handler did not build: {built.stderr[-500:]})"
    run = subprocess.run(argv, capture_output=True, text=True, env={**env, "LD_PRELOAD": str(tmp / "trace.so")},
                         timeout=240)
    return run.stderr[-6000:]


def check_in_child(code: str, tmp: pathlib.Path | None = None) -> None:
    """Run ``code`` (ending in a print of 'all bad inputs raised') in a child process: a native crash then fails
    the calling test with its trace instead of killing the whole pytest run. Given ``tmp``, a child killed by a
    signal runs once more with a handler that adds its native frames to the failure."""
    here = pathlib.Path(__file__).resolve()
    path = os.pathsep.join([str(here.parent), str(here.parents[3]), os.environ.get("PYTHONPATH", "")])
    argv = [sys.executable, "-X", "faulthandler", "-c", code]
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240)
    native = _native_trace(argv, env, tmp) if run.returncode < 0 and tmp is not None else ""
    assert run.returncode == 0 and "all bad inputs raised" in run.stdout, (
        f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}\n{native}")


def test_bad_input_raises_and_writes_nothing_native(native, tmp_path):
    check_in_child("import torch; from unifiedserve import ops; import test_paged_copy_ops as t\n"
                   "assert ops.native_available(), ops.build_info()\n"
                   "t.check_bad_inputs(lambda b, s, ix: torch.ops.unifiedserve.paged_scatter(b, s, *ix), trace=True)\n"
                   "print('all bad inputs raised')", tmp_path)


def test_no_native_env_forces_reference():
    code = ("import os, torch; from unifiedserve import ops; from unifiedserve.memory.pages import RaggedIndex\n"
            "ix = RaggedIndex.build([(3, 2, [1, 2])], 4); b = torch.zeros(4, 4, 2); s = torch.randn(3, 2)\n"
            "ops.paged_scatter(b, s, ix); assert torch.equal(ops.paged_gather(b, ix), s)\n"
            "assert not ops.native_available() and not hasattr(torch.ops.unifiedserve, 'paged_gather')\n"
            "print(ops.build_info()['reason'])")
    env = {**os.environ, "UNIFIEDSERVE_NO_NATIVE": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "UNIFIEDSERVE_NO_NATIVE" in run.stdout and run.stderr == ""


def test_failed_build_warns_once_and_falls_back(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this extension does not compile\n")
    monkeypatch.setattr(ops, "_SOURCES", [broken])
    monkeypatch.setattr(ops, "_CUDA_SOURCES", [])  # one build to fail, on a CUDA machine too
    monkeypatch.setattr(ops, "_EXTENSION_NAME", "unifiedserve_ops_broken_test")
    monkeypatch.setattr(ops, "_native", None)
    monkeypatch.setattr(ops, "_info", {})
    monkeypatch.setenv("UNIFIEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("UNIFIEDSERVE_NO_NATIVE", raising=False)
    index = RaggedIndex.build([(3, 2, [1, 2])], 4)
    buffer, src = torch.zeros(4, 4, 2), torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="unifiedserve.ops"):
        ops.paged_scatter(buffer, src, index)
        assert torch.equal(ops.paged_gather(buffer, index), src)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "using the torch reference" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    assert not ops.native_available() and ops.build_info()["reason"]


def test_failed_cuda_build_falls_back_to_cpu_build(tmp_path, monkeypatch, caplog):
    """A .cu that does not compile costs the CUDA kernels only: one warning, then the CPU-only build loads."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    plain, broken = tmp_path / "plain.cpp", tmp_path / "broken.cu"
    # no op registration, so it loads beside the session's real extension
    plain.write_text("int unifiedserve_fallback_test() { return 1; }\n")
    broken.write_text("#error this CUDA source does not compile\n")
    monkeypatch.setattr(ops, "_SOURCES", [plain])
    monkeypatch.setattr(ops, "_CUDA_SOURCES", [broken])
    monkeypatch.setattr(ops, "_cuda_toolchain", lambda: "")  # as if torch were a CUDA build with nvcc
    monkeypatch.setattr(ops, "_EXTENSION_NAME", "unifiedserve_ops_fallback_test")
    monkeypatch.setattr(ops, "_native", None)
    monkeypatch.setattr(ops, "_info", {})
    monkeypatch.setenv("UNIFIEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("UNIFIEDSERVE_NO_NATIVE", raising=False)
    with caplog.at_level(logging.WARNING, logger="unifiedserve.ops"):
        assert ops.native_available()
    info = ops.build_info()
    assert info["native"] and not info["cuda"] and info["cuda_reason"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "CUDA kernels unavailable" in warnings[0]
    assert not ops._native_for(torch.zeros(1, 1, device="meta"))  # only CPU and (built) CUDA are native


def test_cuda_toolchain_reasons(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "not a CUDA build" in ops._cuda_toolchain()
    monkeypatch.setattr(ops, "_CUDA_SOURCES", [])
    assert ops._cuda_toolchain() == "no CUDA sources"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES + [torch.uint8])
@pytest.mark.parametrize("page_size", [1, 4, 16, 256])
def test_cuda_kernel_matches_reference(cuda_native, dtype, page_size):
    check_parity(cuda_native, "cuda", dtype, page_size)


@pytest.mark.cuda
def test_cuda_public_ops_use_the_kernel(cuda_native, monkeypatch):
    """ops.paged_scatter/paged_gather on CUDA buffers take the kernel, not the reference; long pages split."""
    def no_reference(*args):
        raise AssertionError("the torch reference ran for a CUDA buffer")

    monkeypatch.setattr(reference, "paged_scatter", no_reference)
    monkeypatch.setattr(reference, "paged_gather", no_reference)
    gen = torch.Generator().manual_seed(3)
    alloc, page_size = PageAllocator(64, 256), 256
    a, b = PagedStream("a", page_size), PagedStream("b", page_size)
    plan_write([(a, 100)], alloc)
    index = plan_write([(a, 3000), (b, 700)], alloc)
    buffer = torch.zeros(64, page_size, 1176, dtype=torch.bfloat16, device="cuda")  # pages of 588 KiB
    src = torch.randn(index.num_tokens, 1176, generator=gen).to(torch.bfloat16).cuda()
    ops.paged_scatter(buffer, src, index)
    assert torch.equal(ops.paged_gather(buffer, index), src)
    read, _ = plan_read([(a, 100), (b, 10)], page_size)
    assert torch.equal(ops.paged_gather(buffer, read)[100:], src[3000:3010])


def check_cuda_bad_inputs() -> None:
    native = torch.ops.unifiedserve
    check_bad_inputs(lambda b, s, ix: native.paged_scatter(b, s, *ix), "cuda", trace=True)
    buffer, good, _ = bad_inputs("cuda")
    print("bad gather", flush=True)
    with pytest.raises(RuntimeError):
        native.paged_gather(buffer, *good._replace(pv_page_indices=torch.tensor([1, 9], device="cuda")))


@pytest.mark.cuda
def test_cuda_bad_input_raises_and_writes_nothing(cuda_native, tmp_path):
    """In a child process, as the CPU kernels' test: a crash in an error path (the H100 saw a segfault at the
    first bad index on 2026-11-26, csrc/README.md) fails this test with its Python and native frames instead of
    ending the whole GPU pytest run."""
    check_in_child("from unifiedserve import ops; import test_paged_copy_ops as t\n"
                   "assert ops.native_available() and ops.build_info()['cuda'], ops.build_info()\n"
                   "t.check_cuda_bad_inputs()\n"
                   "print('all bad inputs raised')", tmp_path)


@pytest.mark.slow
def test_cuda_sources_compile_with_nvcc():
    """Without a GPU the CUDA kernel can still be compiled: csrc/nvcc_check.py against this torch's headers."""
    script = pathlib.Path(__file__).resolve().parents[3] / "csrc" / "nvcc_check.py"
    spec = importlib.util.spec_from_file_location("nvcc_check", script)
    nvcc_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nvcc_check)
    if nvcc_check.find_nvcc() is None:
        pytest.skip("nvcc not found")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "paged_copy_cuda.cu: compiles for sm_90" in run.stdout
