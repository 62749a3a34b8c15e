"""One server instance's configuration: model, device, pools, budgets, and its ZMQ addresses.

It is built once by the launcher and sent (pickled) to every worker process at start, so all
processes agree on pool shapes and addresses. Addresses live in a private temporary folder, so
two servers on one machine never collide.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from unifiedserve.engine.scheduler import SchedulerConfig
from unifiedserve.runtime.shm import PoolSpec

PROCESSES = ("vision", "core", "decode")
POLICIES = ("unified", "monolithic", "split")


@dataclass(frozen=True)
class RuntimeConfig:
    model: str
    served_model_name: str
    device: str = "cpu"
    dtype: str = "float32"
    policy: str = "unified"
    max_model_len: int = 32768
    default_max_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int = 1024
    page_size: int = 256
    num_patch_pages: int = 512
    num_visual_pages: int = 256
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tbt_slo_ms: float | None = None  # derive the budgets from this (core profiles at start)
    budget_overrides: dict[str, int] = field(default_factory=dict)  # explicit flags win over the derived values
    max_decode_batch: int = 256
    vision_threads: int = 0  # decoder threads; 0: one per core
    #: vision writes and announces each video's temporal slices as they are decoded (MediaReady.num_rows);
    #: False (serve --ingest whole): whole-video hand-off, a video's patches announced once all are decoded
    streaming_ingest: bool = True
    torch_threads: dict[str, int] = field(default_factory=dict)  # per process; missing: torch's default
    cpu_affinity: dict[str, list[int]] = field(default_factory=dict)  # per process; missing: every core
    nice: dict[str, int] = field(default_factory=dict)  # per process niceness increment (lower CPU priority)
    core_threads_while_decoding: int = 0  # core's torch threads while any request decodes; 0: no change
    #: per process: environment set first thing in the worker, before CUDA starts (GPU placement:
    #: CUDA_VISIBLE_DEVICES, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; see runtime/gpu_placement.py)
    process_env: dict[str, dict[str, str]] = field(default_factory=dict)
    gpu: int = 0  # CUDA: the physical GPU the pools live on (workers see it as cuda:0)
    max_video_seconds: float = 3600.0
    enable_prefix_caching: bool = True  # KV of full prompt blocks shared across requests (core)
    media_cache_gb: float = 1.0  # encoded visual tokens kept by media key (core); 0: off
    ipc_dir: str = ""
    instance: str = ""
    pool_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # "kv", "patch", "weights": build_config
    pools: dict[str, PoolSpec] = field(default_factory=dict)  # the shared tensors, once created

    def __post_init__(self) -> None:
        """Refuse impossible values at construction, before any process or pool exists (ValueError)."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        dev = self.device
        if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {dev!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("max_model_len", "default_max_tokens", "block_size", "num_kv_blocks", "page_size",
                     "num_patch_pages", "num_visual_pages", "max_decode_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("vision_threads", "core_threads_while_decoding", "gpu"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.max_video_seconds > 0:
            raise ValueError(f"max_video_seconds must be positive, got {self.max_video_seconds!r}")
        if self.tbt_slo_ms is not None and not self.tbt_slo_ms > 0:
            raise ValueError(f"tbt_slo_ms must be positive, got {self.tbt_slo_ms!r}")
        if not (self.media_cache_gb >= 0 and self.media_cache_gb != float("inf")):
            raise ValueError(f"media_cache_gb must be a finite number >= 0, got {self.media_cache_gb!r}")
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
