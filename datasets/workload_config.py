"""What a workload is: the workload names, :class:`WorkloadConfig` (validated on construction) and
the requests' arrival times (Poisson or gamma, as in ``vllm bench serve``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["DATASETS", "SYNTHETIC", "WORKLOADS", "WorkloadConfig", "arrival_times", "with_arrivals"]

SYNTHETIC = ("long-video", "short-video", "image", "mixed", "multi-question")
DATASETS = ("mlvu", "egoschema", "visionarena")
WORKLOADS = SYNTHETIC + DATASETS
ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate; validated on construction (ValueError with a fix-it message)."""

    workload: str = "long-video"  # one of WORKLOADS
    num_requests: int = 100
    request_rate: float = math.inf  # requests/s; inf: all arrive at t=0
    arrival: str = "poisson"  # poisson | gamma
    burstiness: float = 1.0  # gamma shape; only with arrival="gamma"
    output_len: int = 64  # max_tokens of each request
    ignore_eos: bool = True  # generate exactly output_len tokens
    seed: int = 0
    scale: float = 1.0  # in (0, 1]: multiplies video durations and media sizes
    video_seconds: tuple[float, float] | None = None  # videos last MIN..MAX s (not scaled); None: the kind's range
    num_videos: int = 4  # distinct media files per kind; multi-question: videos asked about at once
    questions_per_video: int = 4  # multi-question only: questions asked about each video
    video_fps: float | None = 2.0  # sampling fps asked of the server; None: the server's default
    max_frames: int | None = None  # frame cap asked of the server; None: the server's default
    text_share: float = 0.1  # mixed only: share of text-only requests
    media_dir: str | None = None  # None: default_media_dir()
    dataset_path: str | None = None  # needed by mlvu | egoschema | visionarena

    def __post_init__(self):
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {', '.join(WORKLOADS)}")
        if self.workload in DATASETS and not self.dataset_path:
            raise ValueError(f"workload {self.workload!r} reads a local copy: pass --dataset-path")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for all at once), got {self.request_rate}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be poisson or gamma, got {self.arrival!r}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.arrival == "poisson" and self.burstiness != 1.0:
            raise ValueError("burstiness only applies to --arrival gamma (poisson is burstiness 1)")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if not 0.0 < self.scale <= 1.0:
            raise ValueError(f"scale must be in (0, 1], got {self.scale}")
        if self.video_seconds is not None:
            low, high = self.video_seconds
            if not (0 < low <= high and math.isfinite(high)):
                raise ValueError(f"video_seconds must be MIN,MAX with 0 < MIN <= MAX, got {low:g},{high:g}")
            if self.workload == "image" or self.workload in DATASETS:
                raise ValueError(f"video_seconds applies to synthetic videos, not to workload {self.workload!r}")
        if self.num_videos < 1:
            raise ValueError(f"num_videos must be >= 1, got {self.num_videos}")
        if self.questions_per_video < 1:
            raise ValueError(f"questions_per_video must be >= 1, got {self.questions_per_video}")
        if self.workload != "multi-question" and self.questions_per_video != 4:
            raise ValueError("questions_per_video only applies to --workload multi-question")
        if self.video_fps is not None and not (self.video_fps > 0 and math.isfinite(self.video_fps)):
            raise ValueError(f"video_fps must be a positive number, got {self.video_fps}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {self.max_frames}")
        if not 0.0 <= self.text_share <= 1.0:
            raise ValueError(f"text_share must be in [0, 1], got {self.text_share}")


# ---------------------------------------------------------------------------
# arrivals
# ---------------------------------------------------------------------------


def arrival_times(num_requests: int, request_rate: float, *, arrival: str = "poisson",
                  burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of ``num_requests`` requests: 0, then cumulative gamma gaps.

    Gaps are gamma(shape=burstiness, scale=1/(request_rate*burstiness)): mean ``1/request_rate``,
    coefficient of variation ``1/sqrt(burstiness)`` (below 1 is burstier than Poisson).
    ``request_rate=inf`` puts every request at 0. Raises ValueError on bad arguments.
    """
    WorkloadConfig(request_rate=request_rate, arrival=arrival, burstiness=burstiness)  # validates
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng([seed, 0xA771])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0] + [round(float(t), 6) for t in np.cumsum(gaps)]


def with_arrivals(records: list[dict], request_rate: float, *, arrival: str = "poisson",
                  burstiness: float = 1.0, seed: int = 0) -> list[dict]:
    """Copies of ``records`` with fresh ``arrival_s`` from :func:`arrival_times`."""
    times = arrival_times(len(records), request_rate, arrival=arrival, burstiness=burstiness, seed=seed)
    return [{**r, "arrival_s": t} for r, t in zip(records, times)]
