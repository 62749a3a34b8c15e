#!/usr/bin/env python3
"""Caches on vs off, same server, same workloads: what a video's follow-up questions cost.

Two parts, each run against ``unifiedserve serve`` twice (default flags, then ``--no-prefix-caching
--media-cache-gb 0``), same model, pools and budgets:

1. **Follow-ups.** On an idle server, one video (``--followup-video-s`` long, 480x270) is asked a
   question, then a different question, then the first question again, then a question placed
   before the video, one at a time. Prints each TTFT and its ratio to the first, and checks that the
   repeated greedy question gives the same answer.
2. **Multi-question workload** (``datasets/workloads.py --workload multi-question``: k questions per
   video, Poisson arrivals). Prints TTFT percentiles, goodput under ``--goodput`` and the ratio.

    python bench/serve/bench_caching.py --num-requests 16 --request-rate 0.5 --goodput ttft:5000 \\
        --out bench/results/caching
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for extra in (ROOT / "datasets", HERE):
    sys.path.insert(0, str(extra))

import synthetic_video  # noqa: E402
import workload_config  # noqa: E402
import workload_media  # noqa: E402
import workloads  # noqa: E402
from bench_serve import machine_info, run_benchmark  # noqa: E402
from serve_metrics import compute_metrics, parse_goodput  # noqa: E402
from server_process import ServerProcess, run_main  # noqa: E402

MODES = {"caching": [], "no-caching": ["--no-prefix-caching", "--media-cache-gb", "0"]}
FOLLOW_UPS = [("What happens in this video?", True), ("What colours do you see?", True),
              ("What happens in this video?", True), ("Is anything moving?", False)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--followup-video-s", type=float, default=60.0, help="length of the follow-up video (default 60)")
    p.add_argument("--num-requests", type=int, default=16, help="multi-question requests (default 16; 0 skips part 2)")
    p.add_argument("--request-rate", type=float, default=0.5, help="multi-question arrivals per second (default 0.5)")
    p.add_argument("--questions-per-video", type=int, default=4, help="questions per video (default 4)")
    p.add_argument("--num-videos", type=int, default=2, help="videos asked about at once (default 2)")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=["ttft:5000"],
                   help="SLO of goodput, e.g. ttft:5000 tbt:500 (default ttft:5000)")
    p.add_argument("--server-args", default="", help="extra flags for both servers, one string")
    p.add_argument("--media-dir", type=Path, default=None, help="where the generated videos go (default: the "
                   "workloads' cache folder)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "caching", help="results folder")
    return p.parse_args(argv)


async def _one(url: str, video: Path, question: str, video_first: bool, output_len: int) -> tuple[float, str]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    parts = [{"type": "video_url", "video_url": {"url": f"file://{video}", "fps": 2.0}},
             {"type": "text", "text": question}]
    t0 = time.perf_counter()
    ttft, text = None, []
    stream = await client.chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": parts if video_first else parts[::-1]}],
        temperature=0, max_tokens=output_len, stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - t0
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    await client.close()
    return ttft, "".join(text)


async def _text_warmup(url: str) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    await client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "warm up"}],
                                         max_tokens=2)
    await client.close()


def follow_ups(server: ServerProcess, video: Path, output_len: int) -> list[dict]:
    rows = []
    for question, video_first in FOLLOW_UPS:
        ttft, text = asyncio.run(_one(server.url, video, question, video_first, output_len))
        rows.append({"question": question, "video_first": video_first, "ttft_s": ttft, "text": text})
    return rows


def main(argv=None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    media_dir = a.media_dir or workload_media.default_media_dir()
    media_dir.mkdir(parents=True, exist_ok=True)
    video = synthetic_video.make_video(media_dir / f"followup-{a.followup_video_s:g}s.mp4", codec="h264", width=480,
                                       height=270, duration_s=a.followup_video_s, fps=24.0, gop=48, seed=11)
    records = []
    if a.num_requests:
        cfg = workload_config.WorkloadConfig(workload="multi-question", num_requests=a.num_requests,
                                             request_rate=a.request_rate, output_len=a.output_len,
                                             num_videos=a.num_videos, questions_per_video=a.questions_per_video,
                                             media_dir=str(media_dir))
        records = workloads.build_workload(cfg)
    slo = parse_goodput(a.goodput)
    allowed = str(Path("/").resolve())  # workload media live in the cache folder; allow the file system root
    results = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(a).items()}, "modes": {}}
    for mode, flags in MODES.items():
        args = ["--allowed-local-media-path", allowed, *flags, *a.server_args.split()]
        server = ServerProcess(args, a.out / f"server-{mode}.log")
        try:
            asyncio.run(_text_warmup(server.url))
            rows = follow_ups(server, video, a.output_len)
            entry = {"follow_ups": rows}
            if records:
                recs, duration = asyncio.run(run_benchmark(server.url, records, progress=False))
                entry["workload"] = compute_metrics(recs, duration, slo)
            results["modes"][mode] = entry
        finally:
            server.stop()
    (a.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nFollow-up questions on one {a.followup_video_s:g}-s 480x270 video (idle server, one at a time):")
    print(f"{'question':<34}{'video first':>12}" + "".join(f"{m + ' TTFT':>20}" for m in MODES))
    for i, (q, first) in enumerate(FOLLOW_UPS):
        cells = []
        for m in MODES:
            rows = results["modes"][m]["follow_ups"]
            cells.append(f"{rows[i]['ttft_s']:.2f} s ({rows[i]['ttft_s'] / rows[0]['ttft_s']:.2f}x)")
        print(f"{q:<34}{str(first):>12}" + "".join(f"{c:>20}" for c in cells))
    on = results["modes"]["caching"]["follow_ups"]
    print(f"repeated greedy question, same answer with caching: {on[0]['text'] == on[2]['text']}; "
          f"caching vs not: {on[0]['text'] == results['modes']['no-caching']['follow_ups'][0]['text']}")
    if records:
        print(f"\nMulti-question workload: {a.num_requests} requests, {a.questions_per_video} per video, "
              f"{a.request_rate}/s Poisson, SLO {slo}:")
        good = {}
        for m in MODES:
            w = results["modes"][m]["workload"]
            good[m] = w["goodput"]["requests_per_s"]
            print(f"  {m:<12} TTFT p50 {w['ttft_ms']['p50']:.0f} ms  p90 {w['ttft_ms']['p90']:.0f} ms  "
                  f"goodput {good[m]:.3f} req/s ({w['goodput']['attainment']:.0%} in SLO)  "
                  f"duration {w['duration_s']:.1f} s  failed {w['failed']}")
        ratio = good["caching"] / good["no-caching"] if good["no-caching"] else float("inf")
        print(f"  goodput ratio caching / no-caching: {ratio:.2f}x")
    print(f"\nresults: {a.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "bench_caching.py"))
