"""Device and dtype resolution, and KV-pool sizing from GPU memory (``gpu_memory_utilization``).

Everything here is pure (no allocation): the engine calls it with figures it measured, so the
arithmetic is tested on any machine.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: dtype names the engine accepts, beside ``auto``.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
#: vLLM's default share of the GPU's memory the engine may use.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(name: str, cuda_available: bool | None = None, device_count: int | None = None) -> str:
    """The concrete device for a ``--device`` value.

    Args:
        name: ``auto`` (``cuda`` when torch sees a GPU, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``.
        cuda_available, device_count: what torch reports (asked when ``None``; tests pass them).

    Returns:
        ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ValueError: an unknown name, CUDA asked for without a GPU, or ``cuda:N`` past the last GPU.
    """
    if not isinstance(name, str) or not _DEVICE_RE.match(name):
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {name!r}")
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if cuda_available else "cpu"
    if name == "cpu":
        return name
    if not cuda_available:
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    if ":" in name:
        if device_count is None:
            device_count = torch.cuda.device_count()
        index = int(name.split(":")[1])
        if index >= device_count:
            raise ValueError(f"device {name!r} asked for, but torch sees {device_count} GPU(s)")
    return name


def resolve_dtype(name: str, device: str) -> str:
    """The concrete dtype name: ``auto`` is bfloat16 on CUDA and float32 on CPU.

    Raises:
        ValueError: a name outside :data:`DTYPE_CHOICES`.
    """
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return name


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize


class KVPoolSizing:
    """What the engine's and the server's KV sizings share: the pool's bytes and their start-up line. A subclass
    has ``total``, ``utilization``, ``bytes_per_block`` and ``num_blocks``, and names what it subtracted."""

    utilization_name = "utilization"  # how the line names the share

    def deductions(self) -> list[tuple[str, int]]:
        """``(name, bytes)`` of each figure subtracted from ``total x utilization``, in order."""
        raise NotImplementedError

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        gib = 2 ** 30
        terms = "".join(f" - {name} {size / gib:.2f}" for name, size in self.deductions())
        return (f"KV pool: {self.num_blocks} blocks = {self.kv_bytes / gib:.2f} GiB (total {self.total / gib:.2f} GiB "
                f"x {self.utilization_name} {self.utilization:.2f}{terms}; "
                f"{self.bytes_per_block / 2**20:.2f} MiB per block)")


@dataclass(frozen=True)
class KVSizing(KVPoolSizing):
    """How the KV pool was sized from GPU memory; every figure in bytes except the block counts."""

    total: int  # the GPU's memory
    utilization: float  # share of ``total`` the engine may use
    weights: int  # model weights (and whatever else torch held right after loading them)
    activations: int  # peak activations of a dummy maximum-size step
    other: int  # memory the pool must leave alone: non-torch (CUDA context, other processes), buffers
    bytes_per_block: int
    num_blocks: int

    def deductions(self) -> list[tuple[str, int]]:
        return [("weights", self.weights), ("peak activations", self.activations), ("other", self.other)]


def size_kv_pool(total: int, utilization: float, weights: int, activations: int, other: int,
                 bytes_per_block: int) -> KVSizing:
    """KV blocks that fit in ``total * utilization - weights - activations - other``.

    Raises:
        ValueError: ``utilization`` outside (0, 1], a negative figure, or not even one block fits
            (the message names every figure, so the user sees which one to change).
    """
    check_utilization(utilization)
    if min(total, weights, activations, other) < 0 or bytes_per_block < 1:
        raise ValueError(f"memory figures must be non-negative and bytes_per_block positive, got total={total} "
                         f"weights={weights} activations={activations} other={other} "
                         f"bytes_per_block={bytes_per_block}")
    free = int(total * utilization) - weights - activations - other
    sizing = KVSizing(total, utilization, weights, activations, other, bytes_per_block,
                      max(free, 0) // bytes_per_block)
    if sizing.num_blocks < 1:
        raise ValueError(f"no room for the KV cache: {sizing.describe()}; raise gpu_memory_utilization, lower the "
                         f"prefill/encode budgets, or give num_kv_blocks")
    return sizing


def check_utilization(utilization: float) -> None:
    """Raises ValueError unless ``0 < utilization <= 1``."""
    if not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Decode batch sizes to capture as CUDA graphs: 1, 2, 4, 8, then every multiple of 8 up to 32, then
    powers of two, and ``max_batch`` itself; a step of ``n`` sequences replays the smallest size >= n.

    Raises:
        ValueError: ``max_batch < 1``.
    """
    if max_batch < 1:
        raise ValueError(f"the largest CUDA-graph batch must be at least 1, got {max_batch}")
    sizes = {1, 2, 4} | set(range(8, 33, 8))
    size = 64
    while size < max_batch:
        sizes.add(size)
        size *= 2
    return tuple(sorted(s for s in sizes | {max_batch} if s <= max_batch))
