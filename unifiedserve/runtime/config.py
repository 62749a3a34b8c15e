"""One server instance's configuration: the engine's (pools, device, budgets), placement, server, addresses.

:class:`RuntimeConfig` composes the engine core's :class:`~unifiedserve.engine.config.EngineConfig`
(``engine``: written and validated there, once) with what only the multi-process server has: the
policy and per-process placement, request defaults, the ingest mode, and the pools' shapes and
ZMQ addresses. It is built once by the launcher and sent (pickled) to every worker process at
start, so all processes agree on pool shapes and addresses. Addresses live in a private temporary
folder, so two servers on one machine never collide. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from unifiedserve.engine.config import EngineConfig
from unifiedserve.runtime.shm import PoolSpec

PROCESSES = ("vision", "core", "decode")
POLICIES = ("unified", "monolithic", "split")
#: where the vision process decodes (``RuntimeConfig.vision_device``, ``serve --vision-device``)
VISION_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class PoolBudgets:
    """Memory budgets (GiB) the launcher sizes the server engine's pools from (``build_config``)."""

    kv_cache_gb: float = 1.0  # KV cache
    num_kv_blocks: int | None = None  # KV cache in blocks instead of kv_cache_gb
    patch_buffer_gb: float = 2.0  # patch buffer, vision -> encode: one request's patches must fit
    visual_buffer_gb: float = 0.25  # visual-token buffer, encode -> prefill

    def __post_init__(self) -> None:
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        for name in ("kv_cache_gb", "patch_buffer_gb", "visual_buffer_gb"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class RuntimeConfig:
    """The server's configuration tree: ``engine`` (an :class:`EngineConfig`) and the fields below.

    Raises:
        ValueError: at construction, before any process or pool exists: an impossible value (the
            engine's own are refused by :class:`EngineConfig`), or an engine without a fixed KV size
            (the shared KV pool is created before any worker starts).
    """

    model: str
    served_model_name: str
    #: pools, device, dtype, scheduler budgets (max_decode_batch too), caches: shared by every engine core
    engine: EngineConfig = field(default_factory=EngineConfig)
    policy: str = "unified"
    max_model_len: int = 32768
    default_max_tokens: int = 512
    tbt_slo_ms: float | None = None  # derive the budgets from this (core profiles at start)
    budget_overrides: dict[str, int] = field(default_factory=dict)  # explicit flags win over the derived values
    vision_threads: int = 0  # decoder threads; 0: one per core
    #: the vision process's decoders on a CUDA server: "auto" its GPU's NVDEC sessions and the CPU decoders
    #: together, "cuda" NVDEC (the CPU only for what NVDEC cannot take), "cpu" the CPU decoders; patches are
    #: made on the GPU in every case; images go to nvJPEG batches on the GPU under "auto" and "cuda" where it works.
    #: A CPU server decodes on the CPU ("cuda" is refused there).
    vision_device: str = "auto"
    #: decoded patches (GiB) vision may hold for requests core has not admitted yet; more videos wait to be
    #: decoded until memory frees or their request is admitted (runtime/vision_worker.py: _start_decodes)
    vision_ahead_gb: float = 2.0
    #: vision writes and announces each video's temporal slices as they are decoded (MediaReady.num_rows);
    #: False (serve --ingest whole): whole-video hand-off, a video's patches announced once all are decoded
    streaming_ingest: bool = True
    torch_threads: dict[str, int] = field(default_factory=dict)  # per process; missing: torch's default
    cpu_affinity: dict[str, list[int]] = field(default_factory=dict)  # per process; missing: every core
    nice: dict[str, int] = field(default_factory=dict)  # per process niceness increment (lower CPU priority)
    core_threads_shared: int = 0  # core's torch threads while decode or vision is busy; 0: no change
    #: per process: environment set first thing in the worker, before CUDA starts (GPU placement:
    #: CUDA_VISIBLE_DEVICES, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; see runtime/gpu_placement.py)
    process_env: dict[str, dict[str, str]] = field(default_factory=dict)
    gpu: int = 0  # CUDA: the physical GPU the pools live on (workers see it as cuda:0)
    max_video_seconds: float = 3600.0
    #: the largest stored image (width x height) the vision process decodes, read from its header before any pixel
    #: (``--max-image-source-mp``); about 10 bytes of vision-process memory per pixel while it decodes
    max_image_source_pixels: int = 50_000_000
    ipc_dir: str = ""
    instance: str = ""
    pool_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # "kv", "patch", "weights": build_config
    pools: dict[str, PoolSpec] = field(default_factory=dict)  # the shared tensors, once created

    def __post_init__(self) -> None:
        """Refuse impossible values at construction, before any process or pool exists (ValueError)."""
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        if self.engine.num_kv_blocks is None:
            raise ValueError("engine.num_kv_blocks must be given: the shared KV pool is sized before any worker "
                             "starts (build_config derives it from --kv-cache-gb)")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("max_model_len", "default_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("vision_threads", "core_threads_shared", "gpu"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not (isinstance(self.vision_ahead_gb, (int, float)) and self.vision_ahead_gb > 0
                and math.isfinite(self.vision_ahead_gb)):
            raise ValueError(f"vision_ahead_gb must be a positive finite number, got {self.vision_ahead_gb!r}")
        if self.vision_device not in VISION_DEVICES:
            raise ValueError(f"vision_device must be one of {', '.join(VISION_DEVICES)}, got {self.vision_device!r}")
        if self.vision_device == "cuda" and self.engine.device == "cpu":
            raise ValueError("vision_device cuda (NVDEC) needs the server on CUDA (--device cuda); this one runs on "
                             "the CPU")
        if not self.max_video_seconds > 0:
            raise ValueError(f"max_video_seconds must be positive, got {self.max_video_seconds!r}")
        if not self.max_image_source_pixels > 0:
            raise ValueError(f"max_image_source_pixels must be positive, got {self.max_image_source_pixels!r}")
        if self.tbt_slo_ms is not None and not self.tbt_slo_ms > 0:
            raise ValueError(f"tbt_slo_ms must be positive, got {self.tbt_slo_ms!r}")
        unknown = set(self.torch_threads) | set(self.cpu_affinity) | set(self.nice) | set(self.process_env)
        unknown -= set(PROCESSES)
        if unknown:
            raise ValueError(f"per-process settings name unknown processes {sorted(unknown)}; "
                             f"the processes are {', '.join(PROCESSES)}")

    @property
    def processes(self) -> tuple[str, ...]:
        """Worker processes of this policy: monolithic decodes inside core."""
        return ("vision", "core") if self.policy == "monolithic" else PROCESSES

    def address(self, process: str) -> str:
        """The ZMQ address a process binds its inbox at ("api", "vision", "core", "decode")."""
        return f"ipc://{os.path.join(self.ipc_dir, process)}.sock"
