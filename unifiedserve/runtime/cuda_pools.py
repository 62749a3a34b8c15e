"""Pools on the GPU, shared between processes by CUDA IPC: one owner allocates, the workers map.

Why the driver API rather than tensors from torch's caching allocator: a pool must keep one device
address for the server's life and never be split, reused or grown by an allocator; the IPC handle of
a caching-allocator block names its whole segment (torch then ships an offset and a reference-count
file with it), and expandable segments cannot be exported at all. One ``cuMemAlloc`` per pool gives
a plain allocation whose handle is 64 bytes that fit in any message.

Lifetime, the rule everything here keeps: memory freed by its owner while another process still
maps it is undefined behaviour. The owner is the launcher: it starts before every worker and stops
after them. :meth:`CudaPoolOwner.free_all` refuses while any opener may still be alive, so the
runtime frees pools only after it has joined every worker. An opener's mapping ends with its
process (or with :meth:`OpenedPool.close`).

Every driver call runs with the device's primary context current: the same context torch's runtime
uses, so pointers are valid in torch's streams.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from unifiedserve.runtime.shm import PoolSpec

__all__ = ["CudaPoolOwner", "DriverApi", "OpenedPool", "open_cuda_pool"]

IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CUipcMemHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed *by value* to ``cuIpcOpenMemHandle`` (a ctypes array
    argument would pass a pointer to them instead)."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class DriverApi:
    """The few CUDA driver calls pools need (``libcuda.so.1`` through ctypes).

    Each device's primary context is retained on first use and kept until :meth:`close`: the driver resets
    a primary context, freeing every allocation and unmapping every IPC mapping made in it, when its last
    reference is released, and the process may hold no other reference yet (torch creates its own only
    when it first needs the device). torch later uses that same primary context, so the pointers stay valid
    in its streams.

    Args:
        library: the driver library to load (tests load a stand-in with the same ABI).
    """

    def __init__(self, library: str = "libcuda.so.1") -> None:
        try:
            self._cuda = ctypes.CDLL(library)
        except OSError as e:
            raise RuntimeError(f"CUDA pools need the NVIDIA driver ({library}): {e}") from None
        self._cuda.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), CUipcMemHandle, ctypes.c_uint]
        self._check(self._cuda.cuInit(0), "cuInit")
        self._lock = threading.Lock()
        self._contexts: dict[int, tuple[ctypes.c_int, ctypes.c_void_p]] = {}  # ordinal -> (CUdevice, its context)

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            name = ctypes.c_char_p()
            self._cuda.cuGetErrorName(status, ctypes.byref(name))
            raise RuntimeError(f"{call} failed: {name.value.decode() if name.value else status}")

    def _in_context(self, device: int, call):
        with self._lock:
            if device not in self._contexts:
                dev, ctx = ctypes.c_int(), ctypes.c_void_p()
                self._check(self._cuda.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
                self._check(self._cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
                self._contexts[device] = (dev, ctx)
            self._check(self._cuda.cuCtxPushCurrent_v2(self._contexts[device][1]), "cuCtxPushCurrent")
            try:
                return call()
            finally:
                popped = ctypes.c_void_p()
                self._cuda.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def close(self) -> None:
        """Release the primary contexts retained here (once nothing allocated or mapped through them is used)."""
        with self._lock:
            for dev, _ in self._contexts.values():
                self._cuda.cuDevicePrimaryCtxRelease_v2(dev)
            self._contexts.clear()

    def alloc(self, device: int, num_bytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._in_context(device, lambda: self._check(self._cuda.cuMemAlloc_v2(ctypes.byref(ptr),
                                                                              ctypes.c_size_t(num_bytes)),
                                                     "cuMemAlloc"))
        return ptr.value

    def free(self, device: int, ptr: int) -> None:
        self._in_context(device, lambda: self._check(self._cuda.cuMemFree_v2(ctypes.c_uint64(ptr)), "cuMemFree"))

    def mem_info(self, device: int) -> tuple[int, int]:
        """``(free, total)`` bytes of ``device``'s memory, as the driver counts them (every process's use)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._in_context(device, lambda: self._check(self._cuda.cuMemGetInfo_v2(ctypes.byref(free),
                                                                                ctypes.byref(total)), "cuMemGetInfo"))
        return free.value, total.value

    def ipc_handle(self, device: int, ptr: int) -> bytes:
        handle = CUipcMemHandle()
        self._in_context(device, lambda: self._check(
            self._cuda.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(ptr)), "cuIpcGetMemHandle"))
        return bytes(handle)

    def ipc_open(self, device: int, handle: bytes) -> int:
        ptr = ctypes.c_uint64()
        raw = CUipcMemHandle.from_buffer_copy(handle)
        self._in_context(device, lambda: self._check(self._cuda.cuIpcOpenMemHandle_v2(
            ctypes.byref(ptr), raw, ctypes.c_uint(_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)), "cuIpcOpenMemHandle"))
        return ptr.value

    def ipc_close(self, device: int, ptr: int) -> None:
        self._in_context(device, lambda: self._check(self._cuda.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)),
                                                     "cuIpcCloseMemHandle"))


@functools.cache
def process_driver() -> DriverApi:
    """This process's :class:`DriverApi`, whose retained contexts keep its mappings alive for the process's life."""
    return DriverApi()


class _DeviceArray:
    """A raw device allocation as ``__cuda_array_interface__`` (bytes), so torch can view it zero-copy.

    torch keeps this object alive as long as any tensor viewing it does.
    """

    def __init__(self, ptr: int, num_bytes: int, owner: object):
        self.owner = owner  # what must outlive the view (the opened mapping, or the owner's record)
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _as_tensor(ptr: int, spec: PoolSpec, device: int, owner: object) -> torch.Tensor:
    flat = torch.as_tensor(_DeviceArray(ptr, spec.num_bytes, owner), device=f"cuda:{device}")  # uint8 [bytes]
    return flat.view(spec.torch_dtype).view(spec.shape)


@dataclass
class _Allocation:
    spec: PoolSpec
    device: int
    ptr: int
    freed: bool = False


class CudaPoolOwner:
    """Allocates pools once and frees them only after every process that opened them has gone.

    Args:
        api: the driver calls (a :class:`DriverApi`; tests pass a fake).
    """

    def __init__(self, api: DriverApi | None = None):
        self.api = api if api is not None else DriverApi()
        self._pools: dict[str, _Allocation] = {}

    def create(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: int) -> PoolSpec:
        """Allocate a pool (its contents are undefined) and describe it for other processes."""
        if name in self._pools:
            raise ValueError(f"pool {name!r} exists already")
        shape = tuple(int(s) for s in shape)
        if not shape or min(shape) < 1:
            raise ValueError(f"pool {name!r} needs a non-empty shape of positive sizes, got {shape}")
        num_bytes = math.prod(shape) * dtype.itemsize
        ptr = self.api.alloc(device, num_bytes)
        spec = PoolSpec(name, shape, str(dtype).removeprefix("torch."),
                        cuda_handle=self.api.ipc_handle(device, ptr), cuda_device=device)
        self._pools[name] = _Allocation(spec, device, ptr)
        return spec

    def tensor(self, name: str) -> torch.Tensor:
        """The owner's own view of a pool (e.g. to zero it once)."""
        a = self._pools[name]
        if a.freed:
            raise RuntimeError(f"pool {name!r} was freed")
        return _as_tensor(a.ptr, a.spec, a.device, self)

    @property
    def num_bytes(self) -> int:
        return sum(a.spec.num_bytes for a in self._pools.values() if not a.freed)

    def free_all(self, live_openers: Iterable[str] = ()) -> None:
        """Free every pool. Call only once no other process maps them.

        Args:
            live_openers: names of opener processes that may still be alive (the runtime passes the
                workers it has not joined). Any name here refuses the free.
        Raises:
            RuntimeError: an opener may still map the pools (nothing is freed then).
        """
        alive = sorted(live_openers)
        if alive:
            raise RuntimeError(f"pools still mapped by {', '.join(alive)}: stop those processes before freeing")
        for a in self._pools.values():
            if not a.freed:
                a.freed = True
                self.api.free(a.device, a.ptr)
        close = getattr(self.api, "close", None)  # the contexts that held the pools
        if close is not None:
            close()


class OpenedPool:
    """One process's mapping of a pool; closed when :meth:`close` is called or the process ends."""

    def __init__(self, spec: PoolSpec, api: DriverApi):
        if spec.cuda_handle is None or spec.cuda_device is None:
            raise ValueError(f"pool {spec.name!r} is not a CUDA IPC pool")
        if len(spec.cuda_handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"pool {spec.name!r} has a {len(spec.cuda_handle)}-byte handle, "
                             f"expected {IPC_HANDLE_BYTES}")
        self.spec, self.api = spec, api
        self.ptr = api.ipc_open(spec.cuda_device, spec.cuda_handle)
        self.is_open = True

    def tensor(self) -> torch.Tensor:
        if not self.is_open:
            raise RuntimeError(f"pool {self.spec.name!r} was closed")
        return _as_tensor(self.ptr, self.spec, self.spec.cuda_device, self)

    def close(self) -> None:
        """Unmap. Tensors viewing the pool must not be used afterwards."""
        if self.is_open:
            self.is_open = False
            self.api.ipc_close(self.spec.cuda_device, self.ptr)


def open_cuda_pool(spec: PoolSpec, api: DriverApi | None = None) -> torch.Tensor:
    """Map a CUDA pool in this process; the mapping lives as long as the returned tensor's process."""
    return OpenedPool(spec, api if api is not None else process_driver()).tensor()
