#!/usr/bin/env python3
"""Decode benchmark: flashcodec vs PyAV, torchcodec, decord, DeepCodec and OpenCV, same run.

Generates 5-minute 720p clips (H.264 with x264's default GOP of 250 and 3 B-frames, and HEVC),
cached on disk and never committed, then for each clip and sampling (dense: Qwen rules, 2 fps,
<= 768 frames; sparse: 32 uniform frames) checks correctness and times every decoder, flashcodec
in both resize modes (``exact``, the default, and ``fast``). Prints a table with ratios and the
decode floor, and writes JSON and a PNG chart.

    python bench/decode/bench_decode.py                    # the full benchmark (several minutes)
    python bench/decode/bench_decode.py --duration 20      # a quick run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "datasets"))

import synthetic_video  # noqa: E402

from flashcodec.benchmark import machine_info, run_file_benchmark  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", default="h264,hevc", help="comma-separated: h264, hevc, vp9, av1 (default h264,hevc)")
    p.add_argument("--samplings", default="dense,sparse", help="dense, sparse or both (default both)")
    p.add_argument("--duration", type=float, default=300.0, help="clip length in seconds (default 300)")
    p.add_argument("--size", default="1280x720", help="clip size WxH (default 1280x720)")
    p.add_argument("--fps", type=float, default=30.0, help="clip frame rate (default 30)")
    p.add_argument("--peers", default="all", help="peers to compare, or 'all' installed (default)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per decoder, best kept (default 1)")
    p.add_argument("--threads", type=int, default=None, help="flashcodec threads (default: all cores)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where JSON and PNG go")
    p.add_argument("--cache", type=Path, default=None, help="clip cache (default ~/.cache/flashcodec/videos)")
    p.add_argument("--from-json", type=Path, help="only re-render the Markdown table of an earlier run's JSON")
    return p.parse_args(argv)


def make_clip(codec: str, width: int, height: int, duration: float, fps: float, cache) -> Path:
    spec = dict(codec=codec, width=width, height=height, duration_s=duration, fps=fps, gop=250, bframes=3,
                suffix=".mp4", preset="veryfast", seed=0)
    started = time.perf_counter()
    path = synthetic_video.cached_video(spec, cache_dir=cache)
    took = time.perf_counter() - started
    if took > 1:
        print(f"generated {path.name} in {took:.0f} s")
    return path


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        names = [n for n, v in r["results"].items() if "seconds" in v]
        secs = [r["results"][n]["seconds"] for n in names]
        colors = ["tab:orange" if n == "flashcodec" else "navajowhite" if n.startswith("flashcodec") else "tab:gray"
                  for n in names]
        ax.bar(names, secs, color=colors)
        ax.axhline(r["decode_floor_s"], color="tab:blue", linestyle="--", label="decode floor")
        ax.set_title(f"{r['codec']} {r['sampling']} ({r['num_frames']} frames)", fontsize=10)
        ax.set_ylabel("seconds (lower is better)")
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(f"decode of a {results[0]['size'][0]}x{results[0]['size'][1]} clip, "
                 f"{results[0]['machine']['cores']} cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


#: The peer the issue's speed targets name (besides the fastest one).
TARGET_PEER = "deepcodec"


def _ratio(r: dict, mode: str, peer: str | None) -> str:
    speedup = r.get("speedups", {}).get(mode, {}).get(peer) if peer else None
    return f"**{speedup:.2f}x**" if speedup else "-"


def markdown_table(results: list[dict]) -> str:
    """The results as a Markdown table: seconds per decoder, and flashcodec's ratios per resize mode."""
    peers = [n for n in results[0]["results"] if n != "flashcodec"]
    modes = list(results[0].get("resize_s", {"exact": None}))
    head = ["clip", "sampling", "frames", "flashcodec s", "floor s", "vs floor"] + [f"{p} s" for p in peers] + \
        [f"fastest peer / {m}" for m in modes] + [f"{TARGET_PEER} / {m}" for m in modes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["codec"], r["sampling"], f"{r['num_frames']} @ {r['out_size'][0]}x{r['out_size'][1]}",
                 f"**{r['flashcodec_s']:.2f}**", f"{r['decode_floor_s']:.2f}", f"{r['flashcodec_vs_floor']:.2f}x"]
        for p in peers:
            v = r["results"].get(p, {})
            cells.append(f"{v['seconds']:.2f}" if "seconds" in v else "failed")
        cells += [_ratio(r, m, r["fastest_peer"]) + (f" ({r['fastest_peer']})" if r["fastest_peer"] else "")
                  for m in modes]
        cells += [_ratio(r, m, TARGET_PEER) for m in modes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(markdown_table(json.loads(args.from_json.read_text())["results"]))
        return 0
    width, height = (int(v) for v in args.size.lower().split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for codec in [c.strip() for c in args.codecs.split(",") if c.strip()]:
        clip = make_clip(codec, width, height, args.duration, args.fps, args.cache)
        for sampling in [s.strip() for s in args.samplings.split(",") if s.strip()]:
            print()
            results.append(run_file_benchmark(str(clip), sampling=sampling, peers=args.peers, repeat=args.repeat,
                                              num_threads=args.threads))
    print("\nsummary")
    print(f"{'clip':<8} {'sampling':<8} {'resize':<7} {'flashcodec s':>12} {'floor s':>8} {'vs floor':>9} "
          f"{'fastest peer':>14} {'speedup':>8} {'vs ' + TARGET_PEER:>14}")
    for r in results:
        for mode, seconds in r["resize_s"].items():
            speedups = r["speedups"][mode]
            print(f"{r['codec']:<8} {r['sampling']:<8} {mode:<7} {seconds:>12.3f} {r['decode_floor_s']:>8.3f} "
                  f"{seconds / r['decode_floor_s']:>8.2f}x {str(r['fastest_peer']):>14} "
                  f"{speedups.get(r['fastest_peer'], 0):>7.2f}x {speedups.get(TARGET_PEER, 0):>13.2f}x")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_path = args.out / f"decode-{stamp}.json"
    json_path.write_text(json.dumps({"machine": machine_info(), "args": vars(args) | {"out": str(args.out),
                                     "cache": str(args.cache)}, "results": results}, indent=2, default=str))
    png_path = args.out / f"decode-{stamp}.png"
    plot(results, png_path)
    md_path = args.out / f"decode-{stamp}.md"
    md_path.write_text(markdown_table(results) + "\n")
    print(f"wrote {json_path}, {png_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
