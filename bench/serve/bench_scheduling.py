#!/usr/bin/env python3
"""srpt vs fcfs on one mixed workload: who gets the encode and prefill budgets first (``--scheduling-policy``).

``unifiedserve serve`` runs twice, ``--scheduling-policy srpt`` (default) then ``fcfs``, same model, pools and
budgets, with the caches off (each request's cost is then its own). Each replays one seeded workload
(``datasets/workloads.py --workload mixed``: long and short videos, images and text, Poisson arrivals; or one
kind alone, ``--workload``) with the ``bench/serve`` client. Prints TTFT percentiles per kind of request and
overall, goodput under ``--goodput``, and the ratios srpt / fcfs.

    python bench/serve/bench_scheduling.py --num-requests 24 --request-rate 0.5 --scale 0.25 \\
        --goodput ttft:5000 --out bench/results/scheduling
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for extra in (ROOT / "datasets", HERE):
    sys.path.insert(0, str(extra))

import workload_config  # noqa: E402
import workload_media  # noqa: E402
import workloads  # noqa: E402
from bench_serve import machine_info, run_benchmark  # noqa: E402
from serve_metrics import compute_metrics, parse_goodput  # noqa: E402
from server_process import ServerProcess, run_main  # noqa: E402

from flashcodec import probe  # noqa: E402
from unifiedserve.engine.scheduler import SCHEDULING_POLICIES  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("mixed", "long-video", "short-video", "image"), default="mixed",
                   help="datasets/workloads.py workload (default mixed; one kind alone checks srpt costs nothing "
                        "where requests are alike)")
    p.add_argument("--num-requests", type=int, default=24, help="requests (default 24)")
    p.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals per second (default 0.5)")
    p.add_argument("--scale", type=float, default=0.25,
                   help="multiplies the workload's video lengths and media sizes, in (0, 1] (default 0.25)")
    p.add_argument("--output-len", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=["ttft:5000"],
                   help="SLO of goodput, e.g. ttft:5000 tbt:500 (default ttft:5000)")
    p.add_argument("--server-args", default="", help="extra flags for both servers, one string")
    p.add_argument("--media-dir", type=Path, default=None,
                   help="where the generated media go (default: the workloads' cache folder)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scheduling", help="results folder")
    return p.parse_args(argv)


def kinds(records: list[dict]) -> dict[str, str]:
    """Request id -> ``text``, ``image``, ``short video`` or ``long video`` (split at the median video length)."""
    seconds = {}
    for r in records:
        video = next((m for m in r["media"] if m["type"] == "video"), None)
        if video is not None:
            seconds[r["request_id"]] = probe(video["path"]).duration_s
    median = float(np.median(list(seconds.values()))) if seconds else 0.0
    out = {}
    for r in records:
        if r["request_id"] in seconds:
            out[r["request_id"]] = "long video" if seconds[r["request_id"]] > median else "short video"
        else:
            out[r["request_id"]] = "image" if r["media"] else "text"
    return out


def ttft_by_kind(recs, kind_of: dict[str, str]) -> dict[str, dict]:
    groups: dict[str, list[float]] = {}
    for rec in recs:
        if rec.is_success:
            groups.setdefault(kind_of[rec.request_id], []).append(rec.ttft_s)
    return {k: {"n": len(v), "p50_s": float(np.percentile(v, 50)), "p90_s": float(np.percentile(v, 90)),
                "mean_s": float(np.mean(v))} for k, v in sorted(groups.items())}


def main(argv=None) -> int:
    a = parse_args(argv)
    media_dir = a.media_dir or workload_media.default_media_dir()
    try:  # the flags the workload and the SLO check: one error line, not a traceback
        if "--scheduling-policy" in a.server_args:
            raise ValueError("--server-args must not set --scheduling-policy (one server runs per policy)")
        cfg = workload_config.WorkloadConfig(workload=a.workload, num_requests=a.num_requests,
                                             request_rate=a.request_rate, output_len=a.output_len, scale=a.scale,
                                             seed=a.seed, media_dir=str(media_dir))
        slo = parse_goodput(a.goodput)
    except ValueError as e:
        print(f"bench_scheduling.py: error: {e}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    records = workloads.build_workload(cfg)
    kind_of = kinds(records)
    allowed = str(Path("/").resolve())  # workload media live in the cache folder; allow the file system root
    results = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(a).items()}, "policies": {}}
    for policy in SCHEDULING_POLICIES:
        flags = ["--allowed-local-media-path", allowed, "--no-prefix-caching", "--media-cache-gb", "0",
                 "--scheduling-policy", policy, *a.server_args.split()]
        server = ServerProcess(flags, a.out / f"server-{policy}.log")
        try:
            recs, duration = asyncio.run(run_benchmark(server.url, records, progress=False))
        finally:
            server.stop()
        results["policies"][policy] = {"metrics": compute_metrics(recs, duration, slo),
                                       "ttft_by_kind": ttft_by_kind(recs, kind_of)}
        (a.out / "results.json").write_text(json.dumps(results, indent=2))
    counts = {k: sum(1 for v in kind_of.values() if v == k) for k in sorted(set(kind_of.values()))}
    print(f"\n{a.workload} workload: {a.num_requests} requests ({', '.join(f'{n} {k}' for k, n in counts.items())}), "
          f"{a.request_rate}/s Poisson, scale {a.scale:g}, {a.output_len} tokens each, caches off, SLO {slo}")
    print(f"{'TTFT p50 / p90 (s)':<22}" + "".join(f"{p:>18}" for p in SCHEDULING_POLICIES) + f"{'srpt / fcfs p50':>18}")
    by = {p: results["policies"][p]["ttft_by_kind"] for p in SCHEDULING_POLICIES}
    for kind in counts:
        cells = [f"{by[p][kind]['p50_s']:.2f} / {by[p][kind]['p90_s']:.2f}" if kind in by[p] else "-"
                 for p in SCHEDULING_POLICIES]
        ratio = (f"{by['srpt'][kind]['p50_s'] / by['fcfs'][kind]['p50_s']:.2f}x"
                 if kind in by["srpt"] and kind in by["fcfs"] else "-")
        print(f"{kind:<22}" + "".join(f"{c:>18}" for c in cells) + f"{ratio:>18}")
    m = {p: results["policies"][p]["metrics"] for p in SCHEDULING_POLICIES}
    print(f"{'all':<22}" + "".join(f"{m[p]['ttft_ms']['p50'] / 1e3:.2f} / {m[p]['ttft_ms']['p90'] / 1e3:.2f}".rjust(18)
                                   for p in SCHEDULING_POLICIES)
          + f"{m['srpt']['ttft_ms']['p50'] / m['fcfs']['ttft_ms']['p50']:.2f}x".rjust(18))
    for p in SCHEDULING_POLICIES:
        g = m[p]["goodput"]
        print(f"{p}: goodput {g['requests_per_s']:.3f} req/s ({g['attainment']:.0%} in SLO), mean TTFT "
              f"{m[p]['ttft_ms']['mean'] / 1e3:.2f} s, duration {m[p]['duration_s']:.1f} s, failed {m[p]['failed']}")
    fcfs_good = m["fcfs"]["goodput"]["requests_per_s"]
    ratio = m["srpt"]["goodput"]["requests_per_s"] / fcfs_good if fcfs_good else float("inf")
    print(f"goodput srpt / fcfs: {ratio:.2f}x\nresults: {a.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "bench_scheduling.py"))
