#!/usr/bin/env python3
"""Seeded serving workloads for long-video QA benchmarks, written as JSONL.

One line per request::

    {"request_id": "long-video-00000", "arrival_s": 0.0, "prompt": "What happens in this video?",
     "media": [{"type": "video", "path": "/abs/clip.mp4", "fps": 2.0, "max_frames": null}],
     "output_len": 64, "ignore_eos": true}

``arrival_s`` is the offset from the benchmark start. ``media`` is empty for a text-only request.

Synthetic workloads (media made by ``synthetic_video``, H.264, a GOP of 2-8 s, cached by a
content key in ``--media-dir`` so repeated runs reuse the files):

* ``long-video``  MLVU-like: 8-10 minute 720p30 videos.
* ``short-video`` EgoSchema-like: 3 minute 480p30 videos.
* ``image``       VisionArena-like: one image per request, sizes from phone shots to 2K screens.
* ``mixed``       a seeded mix of the three plus ``--text-share`` text-only requests.
* ``multi-question`` several questions about each video (``--questions-per-video``, default 4,
  each a different text): 8-12 s 480x270 clips, short enough for the CPU demo model. ``--num-videos``
  videos are asked about at once; a video's questions come in order, interleaved at random with
  the other open videos', and a finished video is replaced by a new one, so the run holds
  ceil(num_requests / questions_per_video) distinct videos.

Real datasets (``mlvu``, ``egoschema``, ``visionarena`` with ``--dataset-path``) are read from a
local folder; nothing is downloaded. See :func:`load_mlvu`, :func:`load_egoschema` and
:func:`load_visionarena` for the expected layouts.

Arrivals are cumulative sums of gamma(shape=burstiness, scale=1/(rate*burstiness)) inter-arrival
times, as in ``vllm bench serve``; burstiness 1 is a Poisson process. The first request arrives
at 0 and vLLM's rescaling of the total span is not applied.

Put ``datasets/`` on ``sys.path`` and ``import workloads`` (there is no ``datasets/__init__.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import uuid
import warnings
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from tqdm import tqdm

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import synthetic_video  # noqa: E402

__all__ = [
    "DATASETS", "SYNTHETIC", "WORKLOADS", "WorkloadConfig", "add_arrival_args", "add_workload_args",
    "arrival_times", "build_workload", "config_from_args", "default_media_dir", "generate_workload",
    "image_spec", "load_egoschema", "load_mlvu", "load_visionarena", "read_workload", "validate_record",
    "video_questions", "video_spec", "with_arrivals", "write_workload",
]

SYNTHETIC = ("long-video", "short-video", "image", "mixed", "multi-question")
DATASETS = ("mlvu", "egoschema", "visionarena")
WORKLOADS = SYNTHETIC + DATASETS
ARRIVALS = ("poisson", "gamma")

# Full-scale shapes; --scale multiplies sizes and durations.
_VIDEO_KINDS = {
    "long-video": dict(width=1280, height=720, fps=30.0, min_s=480.0, max_s=600.0),
    "short-video": dict(width=854, height=480, fps=30.0, min_s=180.0, max_s=180.0),
    "multi-question": dict(width=480, height=270, fps=24.0, min_s=8.0, max_s=12.0),
}
_GOP_S = (2.0, 8.0)
_MIN_SIDE = 64
_MIN_DURATION_S = 1.0
# (width, height, suffix): photos, screenshots, a portrait phone shot
_IMAGE_SIZES = (
    (640, 480, ".jpg"), (800, 600, ".jpg"), (1024, 768, ".jpg"), (1280, 720, ".png"),
    (1920, 1080, ".png"), (1080, 1920, ".jpg"), (512, 512, ".jpg"), (2048, 1536, ".jpg"),
    (750, 1334, ".png"),
)
_KIND_IDS = {"long-video": 1, "short-video": 2, "image": 3, "multi-question": 4}

VIDEO_QUESTIONS = (
    "What happens in this video?",
    "Describe the main events of this video in order.",
    "What is the person doing at the beginning of the video?",
    "Summarize this video in three sentences.",
    "How many times does the moving box change direction?",
    "What is the overall goal of the activity shown in the video?",
    "Which object appears most often in the video?",
    "What changes between the start and the end of the video?",
)
IMAGE_QUESTIONS = (
    "What is shown in this image?",
    "Describe this image in detail.",
    "What text can you read in this image?",
    "Which colors dominate this picture?",
    "Is there anything unusual in this image?",
    "Write a short caption for this image.",
)
TEXT_PROMPTS = (
    "Explain what a keyframe is in video compression.",
    "What is the difference between latency and throughput?",
    "Give three tips for summarising a long lecture.",
    "Why do video codecs use B-frames?",
    "Write a haiku about waiting for a video to load.",
)


def default_media_dir() -> pathlib.Path:
    """``$FLASHCODEC_CACHE/workloads`` or ``~/.cache/flashcodec/workloads``."""
    return synthetic_video.default_cache_dir().parent / "workloads"


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


# ---------------------------------------------------------------------------
# synthetic media
# ---------------------------------------------------------------------------


def _scaled_size(width: int, height: int, scale: float) -> tuple[int, int]:
    # keep the aspect ratio; the shorter side stops at _MIN_SIDE
    s = min(1.0, max(scale, _MIN_SIDE / min(width, height)))
    return tuple(max(_MIN_SIDE, 2 * int(round(v * s / 2.0))) for v in (width, height))


def video_spec(kind: str, index: int, *, scale: float = 1.0, seed: int = 0,
               seconds: tuple[float, float] | None = None) -> dict:
    """``synthetic_video.cached_video`` spec of the ``index``-th video of ``kind``.

    ``kind``: "long-video", "short-video" or "multi-question". Sizes and durations are multiplied by ``scale``;
    the aspect ratio is kept, sides stay even and >= 64, durations >= 1 s. ``seconds`` (min, max) replaces
    the kind's range of durations, unscaled. The GOP is a seeded 2-8 s.
    """
    shape = _VIDEO_KINDS[kind]
    rng = np.random.default_rng([seed, _KIND_IDS[kind], index])
    low, high = seconds if seconds is not None else (shape["min_s"], shape["max_s"])
    duration_s = round(float(rng.uniform(low, high)))
    scale_s = 1.0 if seconds is not None else scale
    gop_s = float(rng.uniform(*_GOP_S))
    fps = shape["fps"]
    width, height = _scaled_size(shape["width"], shape["height"], scale)
    return dict(
        codec="h264", suffix=".mp4", preset="veryfast", bframes=2, fps=fps,
        width=width, height=height,
        duration_s=max(_MIN_DURATION_S, round(duration_s * scale_s, 2)),
        gop=max(3, int(round(gop_s * fps))), seed=int(rng.integers(2**31)),
    )


def image_spec(index: int, *, scale: float = 1.0, seed: int = 0) -> dict:
    """``{"width", "height", "seed", "suffix"}`` of the ``index``-th image (size scaled, >= 64)."""
    rng = np.random.default_rng([seed, _KIND_IDS["image"], index])
    w, h, suffix = _IMAGE_SIZES[int(rng.integers(len(_IMAGE_SIZES)))]
    width, height = _scaled_size(w, h, scale)
    return dict(width=width, height=height, seed=int(rng.integers(2**18)), suffix=suffix)


def _image_name(spec: dict) -> str:
    # make_image output depends only on these arguments, so they are the content key
    return (f"img_{spec['width']}x{spec['height']}_s{spec['seed']}"
            f"_v{synthetic_video.GENERATOR_VERSION}{spec['suffix']}")


def _cached_image(spec: dict, cache_dir: pathlib.Path) -> pathlib.Path:
    name = _image_name(spec)
    final = cache_dir / name
    if not final.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"
        try:
            synthetic_video.make_image(tmp, width=spec["width"], height=spec["height"], seed=spec["seed"])
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    return final


def _media_path(kind: str, index: int, cfg: WorkloadConfig, media_dir: pathlib.Path) -> pathlib.Path:
    if kind == "image":
        return _cached_image(image_spec(index, scale=cfg.scale, seed=cfg.seed), media_dir / "images")
    spec = video_spec(kind, index, scale=cfg.scale, seed=cfg.seed, seconds=cfg.video_seconds)
    return synthetic_video.cached_video(spec, cache_dir=media_dir / "videos")


def _media_cached(kind: str, index: int, cfg: WorkloadConfig, media_dir: pathlib.Path) -> bool:
    if kind == "image":
        return (media_dir / "images" / _image_name(image_spec(index, scale=cfg.scale, seed=cfg.seed))).exists()
    spec = video_spec(kind, index, scale=cfg.scale, seed=cfg.seed, seconds=cfg.video_seconds)
    return (media_dir / "videos" / synthetic_video._spec_name(spec)[0]).exists()


def _media_paths(needed: list[tuple[str, int]], cfg: WorkloadConfig, media_dir: pathlib.Path,
                 progress: bool) -> dict[tuple[str, int], str]:
    """Each needed media file's path, made first where missing. Files are made in parallel processes when the
    machine has the cores: drawing a clip's frames is one Python thread per file, so on the GPU machine (16
    cores) four 1-5 minute 720p clips took 145 s one after another (2026-11-26); in parallel the longest clip
    bounds it. Each file is written under a temporary name and renamed (cached_video), so workers never clash."""
    missing = [m for m in needed if not _media_cached(*m, cfg, media_dir)]
    jobs = min(len(missing), max(1, (os.cpu_count() or 1) // 4))
    parallel = jobs > 1 and sys.platform == "linux"
    if parallel:
        import concurrent.futures
        import multiprocessing

        # forkserver, not fork: a fork of a process with threads (torch's, a test runner's) can copy a lock some
        # thread holds, and the workers then wait on it forever (seen under Python 3.13: the pool never finished)
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("forkserver")) as pool:
            futures = [pool.submit(_media_path, kind, index, cfg, media_dir) for kind, index in missing]
            for f in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="media", unit="file",
                          disable=not progress):
                f.result()  # a failed file raises here
    return {(kind, index): str(_media_path(kind, index, cfg, media_dir).resolve())
            for kind, index in tqdm(needed, desc="media", unit="file", disable=not progress or parallel)}


def generate_workload(cfg: WorkloadConfig, *, progress: bool = False) -> list[dict]:
    """Synthetic workload records for ``cfg`` (arrivals included); generates missing media.

    Request contents come from one seeded stream and arrivals from another, so changing the
    request rate keeps the same questions and media.
    """
    if cfg.workload not in SYNTHETIC:
        raise ValueError(f"{cfg.workload!r} is not synthetic; use build_workload")
    rng = np.random.default_rng([cfg.seed, 0xC0DE])
    if cfg.workload == "multi-question":
        plan = _multi_question_plan(cfg, rng)
    else:
        plan = _single_question_plan(cfg, rng)

    media_dir = pathlib.Path(cfg.media_dir) if cfg.media_dir else default_media_dir()
    needed = sorted({(k, i) for k, i, _ in plan if i is not None})
    paths = _media_paths(needed, cfg, media_dir, progress)

    arrivals = arrival_times(cfg.num_requests, cfg.request_rate, arrival=cfg.arrival,
                             burstiness=cfg.burstiness, seed=cfg.seed)
    records = []
    for n, ((kind, index, prompt), t) in enumerate(zip(plan, arrivals)):
        media = []
        if kind == "image":
            media = [{"type": "image", "path": paths[kind, index], "fps": None, "max_frames": None}]
        elif kind != "text":
            media = [{"type": "video", "path": paths[kind, index], "fps": cfg.video_fps,
                      "max_frames": cfg.max_frames}]
        records.append({"request_id": f"{cfg.workload}-{n:05d}", "arrival_s": t, "prompt": prompt,
                        "media": media, "output_len": cfg.output_len, "ignore_eos": cfg.ignore_eos})
    return records


def _single_question_plan(cfg: WorkloadConfig, rng: np.random.Generator) -> list[tuple]:
    """(kind, media index | None, prompt) per request: one random question each, media round-robin."""
    if cfg.workload == "mixed":
        share = (1.0 - cfg.text_share) / 3.0
        kinds = rng.choice(["long-video", "short-video", "image", "text"], size=cfg.num_requests,
                           p=[share, share, share, cfg.text_share]).tolist()
    else:
        kinds = [cfg.workload] * cfg.num_requests
    counters = {k: 0 for k in ("long-video", "short-video", "image", "text")}
    plan = []  # (kind, media index | None, prompt)
    for kind in kinds:
        pool = {"image": IMAGE_QUESTIONS, "text": TEXT_PROMPTS}.get(kind, VIDEO_QUESTIONS)
        prompt = pool[int(rng.integers(len(pool)))]
        media_index = None if kind == "text" else counters[kind] % cfg.num_videos  # round-robin
        counters[kind] += 1
        plan.append((kind, media_index, prompt))
    return plan


def video_questions(k: int, rng: np.random.Generator) -> list[str]:
    """``k`` different questions about one video: VIDEO_QUESTIONS in a seeded order, then
    questions about successive seconds of the video when ``k`` exceeds them."""
    order = rng.permutation(len(VIDEO_QUESTIONS))[:k]
    extra = [f"What is on screen {s} seconds into the video?" for s in range(1, k - len(order) + 1)]
    return [VIDEO_QUESTIONS[int(i)] for i in order] + extra


def _multi_question_plan(cfg: WorkloadConfig, rng: np.random.Generator) -> list[tuple]:
    """(kind, video index, prompt) per request: ``num_videos`` open videos at a time, each asked
    its ``questions_per_video`` questions in order; the next request picks an open video at random,
    and a video whose questions are done gives its place to the next video."""
    k = cfg.questions_per_video
    num_total = math.ceil(cfg.num_requests / k)
    left = [k] * num_total
    left[-1] = cfg.num_requests - k * (num_total - 1)
    questions = [video_questions(n, rng) for n in left]
    open_videos, next_video, plan = [], 0, []
    for _ in range(cfg.num_requests):
        while len(open_videos) < cfg.num_videos and next_video < num_total:
            open_videos.append(next_video)
            next_video += 1
        v = open_videos[int(rng.integers(len(open_videos)))]
        plan.append(("multi-question", v, questions[v][len(questions[v]) - left[v]]))
        left[v] -= 1
        if left[v] == 0:
            open_videos.remove(v)
    return plan


# ---------------------------------------------------------------------------
# real datasets (local folders only)
# ---------------------------------------------------------------------------


def _require_dir(root, name: str, layout: str) -> pathlib.Path:
    root = pathlib.Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{name} folder {str(root)!r} not found; expected layout: {layout}")
    return root


def _record(request_id: str, prompt: str, media: list[dict]) -> dict:
    return {"request_id": request_id, "arrival_s": 0.0, "prompt": prompt, "media": media,
            "output_len": 64, "ignore_eos": True}


def _video(path: pathlib.Path, fps: float | None, max_frames: int | None) -> dict:
    return {"type": "video", "path": str(path.resolve()), "fps": fps, "max_frames": max_frames}


def _multiple_choice(question: str, options: list[str]) -> str:
    letters = "ABCDEFGHIJ"
    lines = [question.strip()] + [f"({letters[i]}) {o}" for i, o in enumerate(options)]
    return "\n".join(lines + ["Answer with the option's letter."])


def _keep_found(records: list[dict], missing: list[str], name: str, root: pathlib.Path) -> list[dict]:
    if missing:
        warnings.warn(f"{name}: skipped {len(missing)} questions whose media is missing, e.g. {missing[0]}")
    if not records:
        raise FileNotFoundError(f"{name}: no question with its media found under {root}")
    return records


MLVU_LAYOUT = ("ROOT/json/*.json (each a list of {video, question, candidates}), "
               "videos in ROOT/video/<json stem>/<video> or ROOT/video/<video>")


def load_mlvu(root, *, video_fps: float | None = 2.0, max_frames: int | None = None) -> list[dict]:
    """Multiple-choice questions of a local MLVU copy (the layout of its dev set).

    Layout: ``ROOT/json/*.json``, each a list of ``{"video": "x.mp4", "question": str,
    "candidates": [str, ...], ...}``; the video of ``json/1_plotQA.json`` is looked up in
    ``ROOT/video/1_plotQA/x.mp4`` and then ``ROOT/video/x.mp4``. Questions whose video is missing
    are skipped with a warning. Records come in file order with ``arrival_s`` 0.

    Raises FileNotFoundError naming this layout when ROOT or ``json/`` is missing, or when no
    video is found.
    """
    root = _require_dir(root, "MLVU", MLVU_LAYOUT)
    files = sorted((root / "json").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"MLVU: no json/*.json under {root}; expected layout: {MLVU_LAYOUT}")
    records, missing = [], []
    for f in files:
        for i, item in enumerate(json.loads(f.read_text())):
            candidates = [root / "video" / f.stem / item["video"], root / "video" / item["video"]]
            path = next((p for p in candidates if p.is_file()), None)
            if path is None:
                missing.append(str(candidates[0]))
                continue
            prompt = _multiple_choice(item["question"], list(item.get("candidates", [])))
            records.append(_record(f"mlvu-{f.stem}-{i}", prompt, [_video(path, video_fps, max_frames)]))
    return _keep_found(records, missing, "MLVU", root)


EGOSCHEMA_LAYOUT = ("ROOT/questions.json (a list of {q_uid, question, option 0..option 4}), "
                    "videos in ROOT/videos/<q_uid>.mp4")


def load_egoschema(root, *, video_fps: float | None = 2.0, max_frames: int | None = None) -> list[dict]:
    """Five-way questions of a local EgoSchema copy.

    Layout: ``ROOT/questions.json``, a list of ``{"q_uid": str, "question": str, "option 0": str,
    ..., "option 4": str}``, and ``ROOT/videos/<q_uid>.mp4``. Questions whose video is missing are
    skipped with a warning.

    Raises FileNotFoundError naming this layout when ROOT or questions.json is missing, or when no
    video is found.
    """
    root = _require_dir(root, "EgoSchema", EGOSCHEMA_LAYOUT)
    qfile = root / "questions.json"
    if not qfile.is_file():
        raise FileNotFoundError(f"EgoSchema: {qfile} not found; expected layout: {EGOSCHEMA_LAYOUT}")
    records, missing = [], []
    for item in json.loads(qfile.read_text()):
        path = root / "videos" / f"{item['q_uid']}.mp4"
        if not path.is_file():
            missing.append(str(path))
            continue
        options = [item[f"option {k}"] for k in range(5) if f"option {k}" in item]
        prompt = _multiple_choice(item["question"], options)
        records.append(_record(f"egoschema-{item['q_uid']}", prompt, [_video(path, video_fps, max_frames)]))
    return _keep_found(records, missing, "EgoSchema", root)


VISIONARENA_LAYOUT = ('ROOT/*.jsonl, one {"question": str, "images": [path, ...]} per line '
                      "(paths relative to the .jsonl's folder, or absolute)")


def load_visionarena(root) -> list[dict]:
    """Image questions of a local VisionArena-style export.

    Layout: ``ROOT/*.jsonl`` with one ``{"question": str, "images": ["img/1.png", ...]}`` per line
    (``"image": str`` is accepted for a single image); relative paths are resolved against the
    .jsonl file's folder. Questions with a missing image are skipped with a warning.

    Raises FileNotFoundError naming this layout when ROOT has no .jsonl file or no image is found.
    """
    root = _require_dir(root, "VisionArena", VISIONARENA_LAYOUT)
    files = sorted(root.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"VisionArena: no *.jsonl under {root}; expected layout: {VISIONARENA_LAYOUT}")
    records, missing = [], []
    for f in files:
        for i, line in enumerate(f.read_text().splitlines()):
            if not line.strip():
                continue
            item = json.loads(line)
            names = item.get("images") or ([item["image"]] if item.get("image") else [])
            paths = [p if p.is_absolute() else f.parent / p for p in map(pathlib.Path, names)]
            lost = [p for p in paths if not p.is_file()]
            if lost or not paths:
                missing.append(str(lost[0]) if lost else f"{f}:{i + 1} (no image)")
                continue
            media = [{"type": "image", "path": str(p.resolve()), "fps": None, "max_frames": None} for p in paths]
            records.append(_record(f"visionarena-{f.stem}-{i}", item["question"], media))
    return _keep_found(records, missing, "VisionArena", root)


def build_workload(cfg: WorkloadConfig, *, progress: bool = False) -> list[dict]:
    """Records for any workload: synthetic ones are generated, dataset ones sampled from disk.

    Dataset questions are shuffled with ``cfg.seed`` and repeated when ``num_requests`` exceeds
    the dataset (repeats get a ``#k`` suffix on their request_id).
    """
    if cfg.workload in SYNTHETIC:
        return generate_workload(cfg, progress=progress)
    if cfg.workload == "visionarena":
        items = load_visionarena(cfg.dataset_path)
    else:
        loader = load_mlvu if cfg.workload == "mlvu" else load_egoschema
        items = loader(cfg.dataset_path, video_fps=cfg.video_fps, max_frames=cfg.max_frames)
    order = np.random.default_rng([cfg.seed, 0x5A3]).permutation(len(items))
    records = []
    for n in range(cfg.num_requests):
        item, repeat = items[int(order[n % len(items)])], n // len(items)
        rid = item["request_id"] + (f"#{repeat}" if repeat else "")
        records.append({**item, "request_id": rid, "output_len": cfg.output_len, "ignore_eos": cfg.ignore_eos})
    return with_arrivals(records, cfg.request_rate, arrival=cfg.arrival, burstiness=cfg.burstiness, seed=cfg.seed)


# ---------------------------------------------------------------------------
# JSONL
# ---------------------------------------------------------------------------


def validate_record(rec) -> dict:
    """Check one request record; returns it. Raises ValueError saying which field is wrong."""

    def bad(msg):
        raise ValueError(msg)

    if not isinstance(rec, dict):
        bad(f"expected a JSON object, got {type(rec).__name__}")
    for key in ("request_id", "arrival_s", "prompt", "media", "output_len", "ignore_eos"):
        if key not in rec:
            bad(f"missing field {key!r}")
    if not isinstance(rec["request_id"], str) or not rec["request_id"]:
        bad("request_id must be a non-empty string")
    t = rec["arrival_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
        bad(f"arrival_s must be a finite number >= 0, got {t!r}")
    if not isinstance(rec["prompt"], str):
        bad("prompt must be a string")
    n = rec["output_len"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        bad(f"output_len must be an integer >= 1, got {n!r}")
    if not isinstance(rec["ignore_eos"], bool):
        bad(f"ignore_eos must be true or false, got {rec['ignore_eos']!r}")
    if not isinstance(rec["media"], list):
        bad("media must be a list")
    for k, m in enumerate(rec["media"]):
        if not isinstance(m, dict) or m.get("type") not in ("video", "image"):
            bad(f"media[{k}].type must be 'video' or 'image'")
        if not isinstance(m.get("path"), str) or not m["path"]:
            bad(f"media[{k}].path must be a non-empty string")
        fps, max_frames = m.get("fps"), m.get("max_frames")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
            bad(f"media[{k}].fps must be null or a number > 0, got {fps!r}")
        if max_frames is not None and (isinstance(max_frames, bool) or not isinstance(max_frames, int)
                                       or max_frames < 1):
            bad(f"media[{k}].max_frames must be null or an integer >= 1, got {max_frames!r}")
    return rec


def write_workload(records: Iterable[dict], path) -> pathlib.Path:
    """Write records as JSONL (one compact object per line); returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(", ", ": ")) + "\n")
    return path


def read_workload(path) -> list[dict]:
    """Read and validate a workload JSONL; blank lines are skipped.

    Raises FileNotFoundError for a missing file and ValueError ``"PATH:LINE: what is wrong"`` for
    a line that is not valid JSON, fails :func:`validate_record`, or repeats a request_id.
    """
    path = pathlib.Path(path)
    records, seen = [], {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = validate_record(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if rec["request_id"] in seen:
                raise ValueError(f"{path}:{lineno}: request_id {rec['request_id']!r} repeats line "
                                 f"{seen[rec['request_id']]}")
            seen[rec["request_id"]] = lineno
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no requests")
    return records


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------

_DEFAULTS = WorkloadConfig()


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Options that choose what is asked (shared with bench/serve/bench_serve.py)."""
    d = _DEFAULTS
    p.add_argument("--workload", choices=WORKLOADS, default=d.workload,
                   help="synthetic (long-video, short-video, image, mixed, multi-question) or a local "
                        "dataset copy")
    p.add_argument("--dataset-path", default=None, help="folder of mlvu | egoschema | visionarena")
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--output-len", type=int, default=d.output_len, help="max_tokens of each request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=d.ignore_eos,
                   help="generate exactly --output-len tokens (fair comparisons)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--scale", type=float, default=d.scale,
                   help="(0, 1]: multiplies video durations and media sizes (e.g. 0.05 for CPU runs)")
    p.add_argument("--video-seconds", type=seconds_range, default=None, metavar="MIN,MAX",
                   help="videos last MIN to MAX seconds, not scaled by --scale (default: the workload's own, "
                        "long-video 480-600 s)")
    p.add_argument("--num-videos", type=int, default=d.num_videos,
                   help="distinct media files per kind; requests reuse them round-robin "
                        "(multi-question: videos asked about at once)")
    p.add_argument("--questions-per-video", type=int, default=None,
                   help=f"multi-question: different questions asked about each video (default {d.questions_per_video})")
    p.add_argument("--video-fps", type=_optional(float), default=d.video_fps,
                   help="sampling fps sent with each video; none: the server's default")
    p.add_argument("--max-frames", type=_optional(int), default=d.max_frames,
                   help="frame cap sent with each video; none: the server's default")
    p.add_argument("--text-share", type=float, default=d.text_share, help="mixed: share of text-only requests")
    p.add_argument("--media-dir", default=None, help=f"where media is generated (default {default_media_dir()})")


def add_arrival_args(p: argparse.ArgumentParser) -> None:
    """--request-rate / --arrival / --burstiness. They default to None so that a caller can tell
    whether they were given; :func:`config_from_args` fills in the defaults."""
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests per second; inf sends all at t=0 (default inf)")
    p.add_argument("--arrival", choices=ARRIVALS, default=None,
                   help="inter-arrival distribution (default gamma when --burstiness != 1, else poisson)")
    p.add_argument("--burstiness", type=float, default=None,
                   help="gamma shape: < 1 burstier than poisson, > 1 more regular (default 1)")


def seconds_range(text: str) -> tuple[float, float]:
    """``"60,300"`` -> ``(60.0, 300.0)`` (argparse type; the config checks the values)."""
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return float(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX seconds, got {text!r}") from None


def _optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def config_from_args(a: argparse.Namespace, **overrides) -> WorkloadConfig:
    """WorkloadConfig from parsed options; options left at None keep the dataclass defaults
    (except the ones where None means "let the server decide")."""
    fields = {f.name for f in dataclasses.fields(WorkloadConfig)}
    values = {k: v for k, v in vars(a).items() if k in fields and v is not None}
    for key in ("video_fps", "max_frames", "media_dir", "dataset_path"):
        if key in vars(a):
            values[key] = getattr(a, key)
    if values.get("burstiness", 1.0) != 1.0:
        values.setdefault("arrival", "gamma")
    values.update(overrides)
    return WorkloadConfig(**values)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="workloads.py", description=__doc__.split("\n\n")[0],
        epilog="example: python datasets/workloads.py --workload long-video --scale 0.05 "
               "--num-requests 50 --request-rate 2 --out long.jsonl")
    add_workload_args(p)
    add_arrival_args(p)
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    try:
        cfg = config_from_args(a)
        records = build_workload(cfg, progress=not a.no_progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    out = write_workload(records, a.out)
    num_files = len({m["path"] for r in records for m in r["media"]})
    span = max(r["arrival_s"] for r in records)
    print(f"wrote {len(records)} requests to {out} ({num_files} media files, arrivals over {span:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
