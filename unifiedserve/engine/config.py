"""The engine's configuration: pools, budgets, device and dtype of one engine core (no torch at import).

:class:`EngineConfig` is the in-process ``LLM``'s configuration and the ``engine`` branch of the
server's :class:`~unifiedserve.runtime.config.RuntimeConfig`; every default here is the only one
(the server's flags take theirs from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from unifiedserve.engine.scheduler import SchedulerConfig

#: Sizes that must be positive integers (``num_kv_blocks`` may also be None: see EngineConfig).
_SIZES = ("block_size", "num_patch_pages", "num_visual_pages", "page_size", "max_cuda_graph_batch")


@dataclass(frozen=True)
class EngineConfig:
    """Memory pools, budgets, device and dtype of one engine. Defaults suit the CPU demo model.

    ``device`` and ``dtype`` are resolved at construction: ``device="auto"`` is CUDA when torch
    sees a GPU, else the CPU; ``dtype="auto"`` is bfloat16 on CUDA and float32 on the CPU. The
    default device stays the CPU, so code written for the CPU engine behaves the same on a GPU
    machine; ask for ``auto`` or ``cuda`` (the CLI's ``--device`` defaults to ``auto``).
    ``num_kv_blocks=None`` means 1024 on the CPU and, on CUDA, as many blocks as
    ``gpu_memory_utilization`` (default 0.9) of the GPU leaves after the weights and the profiled
    peak of a maximum-size step; an explicit ``num_kv_blocks`` wins. On CUDA, decode steps of up to
    ``max_cuda_graph_batch`` sequences replay CUDA graphs captured at start-up unless
    ``enforce_eager``; the CPU always runs eagerly. ``async_scheduling`` launches each pure-decode step
    before the previous one's tokens are read back (``EngineCore.step``), so the host's work per step
    overlaps the device's (a GPU gain; on the CPU the steps run in turn, same tokens).

    Raises:
        ValueError: an unknown device or dtype (the message names the choices), CUDA without a GPU,
            ``gpu_memory_utilization`` on the CPU or outside (0, 1], a size that is not a positive
            integer, a negative or infinite ``media_cache_gb``.
    """

    num_kv_blocks: int | None = None
    block_size: int = 16
    num_patch_pages: int = 512
    num_visual_pages: int = 256
    page_size: int = 256  # rows per page of the patch and visual-token buffers
    dtype: str = "auto"
    device: str = "cpu"
    enforce_eager: bool = False
    async_scheduling: bool = False
    gpu_memory_utilization: float | None = None
    max_cuda_graph_batch: int = 64
    attention: str = "auto"  # attention backend: auto | flashinfer | torch
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    #: reuse the KV of full prompt blocks another request computed (same tokens, same media)
    enable_prefix_caching: bool = True
    media_cache_gb: float = 1.0  # encoded visual tokens kept by media content; 0: off

    def __post_init__(self) -> None:
        from unifiedserve.attention import BACKEND_NAMES
        from unifiedserve.engine.device import DEFAULT_GPU_MEMORY_UTILIZATION, check_utilization, resolve_device, \
            resolve_dtype

        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, device))
        if self.attention not in BACKEND_NAMES:
            raise ValueError(f"attention must be one of {', '.join(BACKEND_NAMES)}, got {self.attention!r}")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ValueError(f"scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        for name in _SIZES + (("num_kv_blocks",) if self.num_kv_blocks is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if device == "cpu":
            if self.gpu_memory_utilization is not None:
                raise ValueError("gpu_memory_utilization applies to CUDA only; on the CPU give num_kv_blocks")
            if self.num_kv_blocks is None:
                object.__setattr__(self, "num_kv_blocks", 1024)
        else:
            if self.gpu_memory_utilization is None:
                object.__setattr__(self, "gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)
            check_utilization(self.gpu_memory_utilization)
        if not (isinstance(self.media_cache_gb, (int, float)) and self.media_cache_gb >= 0
                and math.isfinite(self.media_cache_gb)):
            raise ValueError(f"media_cache_gb must be a finite number >= 0, got {self.media_cache_gb!r}")

    @property
    def media_cache_bytes(self) -> int:
        """The media cache's bound in bytes (0: off)."""
        return int(self.media_cache_gb * 2**30)
