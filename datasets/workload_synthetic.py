"""Synthetic workloads: which question about which media file, request by request.

Request contents come from one seeded stream; the media they name is made by ``workload_media``.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np

from workload_config import SYNTHETIC, WorkloadConfig, arrival_times
from workload_media import media_paths, default_media_dir

__all__ = ["generate_workload", "video_questions"]

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
    paths = media_paths(needed, cfg, media_dir, progress)

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
