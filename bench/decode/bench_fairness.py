#!/usr/bin/env python3
"""A short video asked while a long one decodes: its latency with the slots shared (fair) vs first come first served.

A server's vision process decodes every request in flight on one engine. Two requests arrive: a long video, then,
``--gap`` seconds later, a short one. flashcodec's slots serve the request the fewest of them work for
(``DecodeEngine(request_order="fair")``, the default); the peer is first come first served (``"fifo"``: every
slot takes the oldest request's segments until none is left), on an engine built the same way. Both orders run
alternated, ``--repeat`` times each; the table gives each request's seconds from its own submission to its output
(medians) and the ratios fifo / fair.

    python bench/decode/bench_fairness.py                        # 480x270 H.264: 120 s then 4 s, the CPU's threads
    python bench/decode/bench_fairness.py --device cuda:0        # NVDEC sessions
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "datasets"))
sys.path.insert(0, str(ROOT / "bench" / "decode"))

import synthetic_video  # noqa: E402
from bench_open import positive_int, size_arg  # noqa: E402

import flashcodec  # noqa: E402
from flashcodec import FlashCodecError  # noqa: E402
from flashcodec.decode import fast_open  # noqa: E402
from flashcodec.decode.scheduler import REQUEST_ORDERS  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda:N, or a list such as cuda:0,cpu (default cpu)")
    p.add_argument("--threads", type=positive_int, default=None, help="CPU decoder threads (default: flashcodec's)")
    p.add_argument("--size", type=size_arg, default=(480, 270), help="both clips' size WxH (default 480x270)")
    p.add_argument("--long", type=float, default=120.0, help="the long clip's seconds (default 120)")
    p.add_argument("--short", type=float, default=4.0, help="the short clip's seconds (default 4)")
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled per second, as the server's default (2)")
    p.add_argument("--gap", type=float, default=0.1, help="seconds between the two submissions (default 0.1)")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs per order, alternated (default 3)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the JSON goes")
    p.add_argument("--cache", type=Path, default=None, help="clip cache (default ~/.cache/flashcodec/videos)")
    return p.parse_args(argv)


def clip(args, seconds: float, seed: int) -> str:
    width, height = args.size
    spec = dict(codec="h264", width=width, height=height, duration_s=seconds, fps=30.0, gop=60, bframes=3,
                suffix=".mp4", preset="veryfast", seed=seed)
    return str(synthetic_video.cached_video(spec, cache_dir=args.cache))


def one_run(engine, long_path: str, short_path: str, args) -> dict:
    """Seconds from each request's submission to its output."""
    seconds, submitted = {}, threading.Event()

    def decode(name: str, path: str) -> None:
        analysis = engine.analyse_bitstream(path, fps=args.fps)
        started = time.perf_counter()
        engine.add_decoding_request(analysis.key_id)
        submitted.set()
        engine.get_decoding_output(analysis.key_id)
        seconds[name] = time.perf_counter() - started

    first = threading.Thread(target=decode, args=("long", long_path))
    first.start()
    submitted.wait()  # the gap counts from the long request's submission, not from its probe
    time.sleep(args.gap)
    decode("short", short_path)
    first.join()
    return seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    fast_open.install()
    long_path, short_path = clip(args, args.long, 0), clip(args, args.short, 1)
    devices = args.device.split(",")
    cpu_threads = 0 if all(d.startswith("cuda") for d in devices) else args.threads
    try:  # an unknown device or one this machine lacks: one error line
        engines = {order: flashcodec.DecodeEngine(devices=devices, cpu_threads=cpu_threads, request_order=order)
                   for order in REQUEST_ORDERS}
    except (FlashCodecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {order: [] for order in REQUEST_ORDERS}
    try:
        for engine in engines.values():  # warm: opens
            engine.decode_video(short_path, fps=args.fps)
        for _ in range(args.repeat):
            for order, engine in engines.items():
                runs[order].append(one_run(engine, long_path, short_path, args))
    finally:
        for engine in engines.values():
            engine.close()
    medians = {order: {name: statistics.median(r[name] for r in rs) for name in ("long", "short")}
               for order, rs in runs.items()}
    ratios = {name: medians["fifo"][name] / medians["fair"][name] for name in ("long", "short")}
    print(f"{args.long:g}-s and {args.short:g}-s {args.size[0]}x{args.size[1]} H.264 at {args.fps:g} fps on "
          f"{args.device} ({engines['fair'].num_threads} CPU threads), the short one {args.gap:g} s after the long one")
    print(f"{'order':<6} {'short s':>8} {'long s':>8}   (medians of {args.repeat}; each run: short/long)")
    for order, m in medians.items():
        print(f"{order:<6} {m['short']:8.3f} {m['long']:8.3f}   "
              + ", ".join(f"{r['short']:.2f}/{r['long']:.2f}" for r in runs[order]))
    print(f"fifo / fair: short {ratios['short']:.2f}x, long {ratios['long']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench_fairness_{args.device.replace(':', '').replace(',', '+')}.json"
    out.write_text(json.dumps({"command": "python bench/decode/bench_fairness.py " + " ".join(argv or sys.argv[1:]),
                               "runs": runs, "medians": medians, "fifo_over_fair": ratios}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
