#!/usr/bin/env python3
"""Seeded serving workloads for long-video QA benchmarks, written as JSONL.

One line per request::

    {"request_id": "long-video-00000", "arrival_s": 0.0, "prompt": "What happens in this video?",
     "media": [{"type": "video", "path": "/abs/clip.mp4", "fps": 2.0, "max_frames": null}],
     "output_len": 64, "ignore_eos": true}

``arrival_s`` is the offset from the benchmark start. ``media`` is empty for a text-only request.

Synthetic workloads (media made by ``synthetic_video`` and ``synthetic_image``, videos H.264 with a
GOP of 2-8 s, cached by a content key in ``--media-dir`` so repeated runs reuse the files):

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
local folder; nothing is downloaded. See :func:`workload_datasets.load_mlvu`,
:func:`workload_datasets.load_egoschema` and :func:`workload_datasets.load_visionarena` for the
expected layouts.

Arrivals are cumulative sums of gamma(shape=burstiness, scale=1/(rate*burstiness)) inter-arrival
times, as in ``vllm bench serve``; burstiness 1 is a Poisson process. The first request arrives
at 0 and vLLM's rescaling of the total span is not applied.

Put ``datasets/`` on ``sys.path`` and ``import workloads`` (there is no ``datasets/__init__.py``).
This module holds the CLI and :func:`build_workload`; the rest lives beside it:
``workload_config`` (WorkloadConfig, arrivals), ``workload_synthetic`` (synthetic requests),
``workload_media`` (their media files), ``workload_datasets`` (real-dataset loaders) and
``workload_jsonl`` (read, write and validate JSONL).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

import numpy as np

_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from workload_config import ARRIVALS, SYNTHETIC, WORKLOADS, WorkloadConfig, with_arrivals  # noqa: E402
from workload_datasets import load_egoschema, load_mlvu, load_visionarena  # noqa: E402
from workload_jsonl import write_workload  # noqa: E402
from workload_media import default_media_dir  # noqa: E402
from workload_synthetic import generate_workload  # noqa: E402

__all__ = ["add_arrival_args", "add_workload_args", "build_workload", "config_from_args"]


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
