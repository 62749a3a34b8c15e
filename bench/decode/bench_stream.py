#!/usr/bin/env python3
"""A streamed decode's prefix: when each quarter of the frames is handed out, in-order queue vs lanes, same run.

A stream (``add_decoding_request(stream=True)``, the server's streaming ingest) hands out the prefix of finished
frames. flashcodec gives a streamed request's segments to a rank's slots as one queue in display order; the
peer here is the lane plan every other request gets (one contiguous run of segments per slot), where the prefix
is the first lane's progress. Both run on the same engine, alternated; the lane plan is forced by giving the
scheduler's jobs ``in_order=False``. A whole (unstreamed) decode of the same video runs beside them, so a stream's
cost over it shows; each run is traced (every slot's opens and segments), and the median run's trace is
summarised per rank.

    python bench/decode/bench_stream.py                      # 720p H.264, 60 s, 2-s GOPs, the CPU's threads
    python bench/decode/bench_stream.py --device cuda:0      # NVDEC sessions
    python bench/decode/bench_stream.py --device cuda:0,cpu --size 854x480 --duration 180 --gop 250
                                                             # the GPU server's video on its decoders
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "datasets"))
sys.path.insert(0, str(ROOT / "bench" / "decode"))

import synthetic_video  # noqa: E402
from bench_open import positive_int, size_arg  # noqa: E402

import flashcodec  # noqa: E402
from flashcodec import FlashCodecError  # noqa: E402
from flashcodec.decode import fast_open, rank_job  # noqa: E402
from flashcodec.decode.trace import describe_rank, rank_slots, trace_summary  # noqa: E402

QUARTERS = (0.25, 0.5, 0.75, 1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda:N (NVDEC sessions only), or a list such as cuda:0,cpu (NVDEC and the CPU's "
                        "threads, as the GPU server's vision process); default cpu")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU decoder threads (default: flashcodec's default)")
    p.add_argument("--clip", type=Path, help="a video to use instead of the generated clip")
    p.add_argument("--size", type=size_arg, default=(1280, 720), help="generated clip's size WxH (default 1280x720)")
    p.add_argument("--duration", type=float, default=60.0, help="generated clip's length in seconds (default 60)")
    p.add_argument("--gop", type=positive_int, default=60, help="generated clip's GOP in frames at 30 fps (default 60)")
    p.add_argument("--max-pixels", type=positive_int, default=None,
                   help="frame size budget per sampled frame, as a request's max_pixels (default: flashcodec's)")
    p.add_argument("--output", choices=("rgb", "patches"), default="rgb",
                   help="frames, or Qwen2.5-VL patch rows as the server asks for (default rgb)")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs per plan, alternated (default 3)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the JSON goes")
    p.add_argument("--cache", type=Path, default=None, help="clip cache (default ~/.cache/flashcodec/videos)")
    return p.parse_args(argv)


class _Plans:
    """Lets the scheduler's jobs take their ``in_order`` from the engine (ours) or not (the lane plan)."""

    def __init__(self):
        self.in_order = True
        self._init = rank_job.RankJob.__init__
        plans = self

        def init(job, *args, **kwargs):
            kwargs["in_order"] = kwargs.get("in_order", False) and plans.in_order
            plans._init(job, *args, **kwargs)

        rank_job.RankJob.__init__ = init

    def restore(self):
        rank_job.RankJob.__init__ = self._init


def sampling(args) -> dict:
    return {} if args.max_pixels is None else {"max_pixels": args.max_pixels}


def streamed(engine, path: str, args) -> dict:
    analysis = engine.analyse_bitstream(path, **sampling(args))
    n = len(analysis.plan.frame_indices)
    started = time.perf_counter()
    engine.add_decoding_request(analysis.key_id, output=args.output, stream=True, trace=True)
    marks: dict[float, float] = {}
    first, trace = None, []
    for part in engine.stream_decoding_output(analysis.key_id):
        first = time.perf_counter() - started if first is None else first
        trace = part.trace or trace
        for q in QUARTERS:  # by rows: frames, or patch rows (whole temporal patches) with --output patches
            if q not in marks and part.stop >= q * part.num_rows:
                marks[q] = time.perf_counter() - started
    total = time.perf_counter() - started
    return {"frames": n, "seconds": total, "first_part_s": first,
            "share_of_time": {str(q): marks[q] / total for q in QUARTERS},
            "trace": trace_summary(trace, total, rank_slots(engine))}


def whole(engine, path: str, args) -> dict:
    analysis = engine.analyse_bitstream(path, **sampling(args))
    started = time.perf_counter()
    engine.add_decoding_request(analysis.key_id, output=args.output, trace=True)
    out = engine.get_decoding_output(analysis.key_id)
    total = time.perf_counter() - started
    return {"frames": len(analysis.plan.frame_indices), "seconds": total,
            "trace": trace_summary(out.trace, total, rank_slots(engine))}


def rank_lines(trace: dict) -> list[str]:
    return ["    " + describe_rank(rank, t) for rank, t in trace["ranks"].items() if t["segments"]]


def main(argv=None) -> int:
    args = parse_args(argv)
    fast_open.install()
    width, height = args.size
    spec = dict(codec="h264", width=width, height=height, duration_s=args.duration, fps=30.0, gop=args.gop, bframes=3,
                suffix=".mp4", preset="veryfast", seed=0)
    path = str(args.clip or synthetic_video.cached_video(spec, cache_dir=args.cache))
    try:
        info = flashcodec.probe(path)
    except FlashCodecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    devices = args.device.split(",")
    try:  # an unknown device or one this machine lacks: one error line
        engine = flashcodec.DecodeEngine(devices=devices, cpu_threads=0 if all(d.startswith("cuda") for d in devices)
                                           else args.threads)
    except (FlashCodecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plans = _Plans()
    runs: dict[str, list[dict]] = {"in_order": [], "lanes": [], "whole": []}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench_stream_{args.device.replace(':', '').replace(',', '+')}.json"

    def save(summary: dict | None) -> None:  # after every run too: a run cut at a device's time limit keeps its runs
        out.write_text(json.dumps({"command": "python bench/decode/bench_stream.py " + " ".join(argv or sys.argv[1:]),
                                   "clip": str(args.clip) if args.clip else spec, "runs": runs,
                                   **({"median": summary} if summary is not None else {"partial": True})}, indent=1))

    try:
        with engine:
            streamed(engine, path, args)  # warm: opens, kernels
            for _ in range(args.repeat):
                for name in runs:
                    plans.in_order = name == "in_order"
                    runs[name].append(whole(engine, path, args) if name == "whole" else streamed(engine, path, args))
                    save(None)
    finally:
        plans.restore()
    print(f"{Path(path).name}: {info.codec} {info.width}x{info.height}, {len(info.gops)} GOPs; "
          f"{runs['in_order'][0]['frames']} frames streamed on {args.device}")
    print(f"{'plan':<10} first part s " + " ".join(f"{int(q * 100):>4}%" for q in QUARTERS)
          + "  (share of the decode's time, median run)   seconds")
    print("(traced: a stream's last part waits for every slot to end its work, which its 100% and seconds include)")
    summary = {}
    for name, rs in runs.items():
        middle = sorted(rs, key=lambda r: r["share_of_time"]["0.5"] if "share_of_time" in r else r["seconds"])[
            len(rs) // 2]
        summary[name] = middle
        shares = (" ".join(f"{middle['share_of_time'][str(q)]:5.2f}" for q in QUARTERS) if "share_of_time" in middle
                  else " ".join(f"{'-':>5}" for _ in QUARTERS))
        first = f"{middle['first_part_s']:12.3f}" if "first_part_s" in middle else f"{'-':>12}"
        print(f"{name:<10} {first} {shares}  " + ", ".join(f"{r['seconds']:.2f}" for r in rs))
        print("\n".join(rank_lines(middle["trace"])))
    save(summary)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
