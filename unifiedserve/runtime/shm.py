"""Pools shared between processes: named shared memory on CPU, CUDA IPC handles on GPU.

A pool is described by a :class:`PoolSpec` (picklable, sent to each worker at start). On CPU the
launcher creates one file per pool in a tmpfs folder (``/dev/shm``); every process maps it with
``MAP_SHARED``. Once all workers are up (their pools mapped) the launcher unlinks the files, so from then
on the memory lives exactly as long as the last process that maps it and nothing is left behind, even
after ``kill -9``. A server killed with ``kill -9`` while its workers start leaves its files; ``launch/serve-node.sh
start`` clears its own folder of them.

On CUDA the launcher allocates each pool with the driver and sends its 64-byte IPC handle; every
worker maps it once (``unifiedserve/runtime/cuda_pools.py``; ran on an H200 and an H100, docs/gpu.md).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are made: the CLI's --help must not pay for it
    import torch

DEFAULT_SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class PoolSpec:
    """A shared tensor: its name, shape and dtype, and where it lives."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    path: str | None = None  # CPU: the tmpfs file
    cuda_handle: bytes | None = None  # CUDA: the allocation's IPC handle (cuIpcGetMemHandle)
    cuda_device: int | None = None  # CUDA: the device ordinal the pool lives on

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


#: check_shm_space's default: read the memory cgroup's room
READ_CGROUP = -1


def check_shm_space(shm_dir: str, num_bytes: int, cgroup_room: int | None = READ_CGROUP) -> None:
    """Raise a clear ``ValueError`` when the tmpfs folder is missing or cannot hold the pools, or when the
    process's memory cgroup could not hold them: a tmpfs page counts against the limit of the cgroup that
    touches it, so pools sized by a host-wide /dev/shm in a container with a smaller ``--memory`` would end in
    the OOM killer mid-serving. ``cgroup_room``: that limit's room in bytes (None: no limit), or
    :data:`READ_CGROUP` to read it (:func:`flashcodec._sysmem.cgroup_memory_room`)."""
    if not os.path.isdir(shm_dir):
        raise ValueError(f"--shm-dir {shm_dir} is not a folder; give a tmpfs folder such as /dev/shm")
    shrink = "shrink the pools (--kv-cache-gb, --patch-buffer-gb, --visual-buffer-gb)"
    free = shutil.disk_usage(shm_dir).free
    if free < num_bytes:
        raise ValueError(f"the shared pools need {num_bytes / 2**30:.2f} GiB but {shm_dir} has "
                         f"{free / 2**30:.2f} GiB free; {shrink} or give a bigger tmpfs with --shm-dir (in Docker: "
                         f"--shm-size)")
    if cgroup_room == READ_CGROUP:
        from flashcodec._sysmem import cgroup_memory_room

        cgroup_room = cgroup_memory_room()
    if cgroup_room is not None and cgroup_room < num_bytes:
        raise ValueError(f"the shared pools need {num_bytes / 2**30:.2f} GiB but this process's memory limit "
                         f"(cgroup) leaves {cgroup_room / 2**30:.2f} GiB, and their pages count against it; "
                         f"{shrink} or raise the limit (in Docker: --memory)")


def create_cpu_pool(shm_dir: str, prefix: str, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> PoolSpec:
    """Create the tmpfs file behind a CPU pool (sparse: memory is used as pages are touched)."""
    spec = PoolSpec(name, tuple(int(s) for s in shape), str(dtype).removeprefix("torch."),
                    path=os.path.join(shm_dir, f"{prefix}-{name}"))
    fd = os.open(spec.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, spec.num_bytes)
    finally:
        os.close(fd)
    return spec


def open_pool(spec: PoolSpec) -> torch.Tensor:
    """Map a pool in this process: the same memory every other process sees."""
    if spec.cuda_handle is not None:
        from unifiedserve.runtime.cuda_pools import open_cuda_pool

        return open_cuda_pool(spec)
    if spec.path is None:
        raise ValueError(f"pool {spec.name!r} has neither a file nor a CUDA handle")
    import torch

    numel = math.prod(spec.shape)
    flat = torch.from_file(spec.path, shared=True, size=numel, dtype=spec.torch_dtype)
    return flat.view(spec.shape)


def unlink_pool(spec: PoolSpec) -> None:
    """Remove a CPU pool's file (mappings stay valid); no-op for CUDA pools or a missing file."""
    if spec.path is not None:
        try:
            os.unlink(spec.path)
        except FileNotFoundError:
            pass
