"""Synthetic media of the workloads: seeded video and image specs, and the files made from them.

Videos are made by ``synthetic_video`` (H.264, a GOP of 2-8 s) and images by ``synthetic_image``;
both are cached by a content key in the media folder, so repeated runs reuse the files; missing
files are made in parallel processes.
"""

from __future__ import annotations

import os
import pathlib
import sys
import uuid

import numpy as np

from tqdm import tqdm

import synthetic_image
import synthetic_video
from workload_config import WorkloadConfig

__all__ = ["default_media_dir", "image_spec", "video_spec"]

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


def default_media_dir() -> pathlib.Path:
    """``$FLASHCODEC_CACHE/workloads`` or ``~/.cache/flashcodec/workloads``."""
    return synthetic_video.default_cache_dir().parent / "workloads"


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
            synthetic_image.make_image(tmp, width=spec["width"], height=spec["height"], seed=spec["seed"])
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


def media_paths(needed: list[tuple[str, int]], cfg: WorkloadConfig, media_dir: pathlib.Path,
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
