#!/usr/bin/env python3
"""Same engine, same workload, three placements: unified vs monolithic vs split, at several request rates.

For each policy this starts ``unifiedserve serve --policy P`` (same model, pools and budgets),
replays one seeded workload (``datasets/workloads.py``) at each rate with the ``bench/serve``
client, and stops the server. It writes ``results.json``, a Markdown table of ratios
(``summary.md``) and PNG plots: p99 TBT vs rate, p90 TTFT vs rate, SLO attainment vs rate,
goodput per policy, and a token-generation timeline per policy (tokens emitted vs time, one line
per request; plateaus are decode stalls).

    python bench/policies/bench_policies.py --rates 0.05,0.1,0.2 --num-requests 12 --scale 0.05 \\
        --goodput ttft:20000 tbt:500 --out bench/results/policies
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for extra in (ROOT / "datasets", ROOT / "bench" / "serve"):
    sys.path.insert(0, str(extra))

import workloads  # noqa: E402
from bench_serve import compute_metrics, machine_info, parse_goodput, run_benchmark  # noqa: E402
from server_process import ServerProcess  # noqa: E402

POLICIES = ("unified", "monolithic", "split")


def _pct(m: dict, key: str, q: str) -> float:
    v = (m.get(key) or {}).get(q)
    return float("nan") if v is None else v


def summarize(results: dict, rate: float) -> str:
    """Markdown: each policy's numbers at ``rate`` and unified's ratios to the baselines."""
    rows = ["| policy | completed | mean TTFT (s) | p90 TTFT (s) | p50 TBT (ms) | p99 TBT (ms) | SLO attainment | goodput (req/s) |",
            "|---|---|---|---|---|---|---|---|"]
    at = {p: next((r["metrics"] for r in results[p] if r["rate"] == rate), None) for p in results}
    for policy, m in at.items():
        if m is None:
            continue
        g = m.get("goodput") or {}
        rows.append(f"| {policy} | {m['completed']}/{m['num_requests']} | {_pct(m, 'ttft_ms', 'mean') / 1000:.2f} | "
                    f"{_pct(m, 'ttft_ms', 'p90') / 1000:.2f} | {_pct(m, 'itl_ms', 'p50'):.1f} | "
                    f"{_pct(m, 'itl_ms', 'p99'):.1f} | {g.get('attainment', float('nan')):.2f} | "
                    f"{g.get('requests_per_s', float('nan')):.4f} |")
    u, mono, split = at.get("unified"), at.get("monolithic"), at.get("split")
    lines = ["", f"Ratios at {rate} req/s:", ""]
    if u and mono:
        lines.append(f"- unified p99 TBT / monolithic p99 TBT = **{_pct(u, 'itl_ms', 'p99') / _pct(mono, 'itl_ms', 'p99'):.2f}** (target <= 0.5)")
    if u and split:
        lines.append(f"- unified mean TTFT / split mean TTFT = **{_pct(u, 'ttft_ms', 'mean') / _pct(split, 'ttft_ms', 'mean'):.2f}** (target <= 0.7)")
    if u and (mono or split):
        best = max(((m.get("goodput") or {}).get("requests_per_s", 0.0) for m in (mono, split) if m), default=0.0)
        mine = (u.get("goodput") or {}).get("requests_per_s", 0.0)
        ratio = mine / best if best else math.inf
        lines.append(f"- unified goodput / better baseline = **{ratio:.2f}** (target >= 1.3)")
    return "\n".join(rows + lines) + "\n"


def plot(results: dict, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -r requirements/bench.txt)")
        return []
    files = []
    panels = [("p99 TBT (ms)", lambda m: _pct(m, "itl_ms", "p99")), ("p90 TTFT (s)", lambda m: _pct(m, "ttft_ms", "p90") / 1000),
              ("SLO attainment", lambda m: (m.get("goodput") or {}).get("attainment", float("nan")))]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (label, fn) in zip(axes, panels):
        for policy, runs in results.items():
            ax.plot([r["rate"] for r in runs], [fn(r["metrics"]) for r in runs], marker="o", label=policy)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    ax = axes[3]
    names = list(results)
    best = [max(((r["metrics"].get("goodput") or {}).get("requests_per_s", 0.0) for r in results[p]), default=0)
            for p in names]
    ax.bar(names, best, color=["C0", "C1", "C2"][:len(names)])
    ax.set_ylabel("best goodput (req/s)")
    fig.tight_layout()
    path = out / "policies.png"
    fig.savefig(path, dpi=80)
    files.append(path)
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), sharey=True, squeeze=False)
    for ax, (policy, runs) in zip(axes[0], results.items()):
        run = runs[-1]
        for rec in run["records"]:
            times = rec.get("token_times_s") or []
            ax.step(times, range(1, len(times) + 1), where="post", linewidth=0.8)
        ax.set_title(f"{policy} @ {run['rate']} req/s")
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens emitted")
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path, dpi=80)
    files.append(path)
    return files


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rates", default="0.05,0.1,0.2", help="request rates, req/s (comma-separated)")
    p.add_argument("--workload", default="long-video", choices=workloads.SYNTHETIC)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--scale", type=float, default=0.05, help="shrinks video durations and sizes for CPU runs")
    p.add_argument("--num-videos", type=int, default=2)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=["ttft:20000", "tbt:500"], help="SLOs, e.g. ttft:MS tbt:MS")
    p.add_argument("--server-args", default="", help="extra flags for every server (same for all policies)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "policies")
    a = p.parse_args(argv)
    slo = parse_goodput(a.goodput)
    rates = [float(r) for r in a.rates.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    base = workloads.generate_workload(workloads.WorkloadConfig(
        workload=a.workload, num_requests=a.num_requests, output_len=a.output_len, ignore_eos=True, seed=a.seed,
        scale=a.scale, num_videos=a.num_videos), progress=True)
    media_dir = Path(base[0]["media"][0]["path"]).parent if base and base[0]["media"] else ROOT
    flags = ["--allowed-local-media-path", str(media_dir.parent), "--kv-cache-gb", "0.5", "--patch-buffer-gb", "1",
             *a.server_args.split()]
    results: dict[str, list] = {}
    for policy in a.policies.split(","):
        print(f"\n=== policy {policy}: unifiedserve serve --policy {policy} {' '.join(flags)}", flush=True)
        with ServerProcess(["--policy", policy, *flags], a.out / f"server-{policy}.log") as server:
            runs = results[policy] = []
            for rate in rates:
                reqs = workloads.with_arrivals(base, rate, arrival="gamma" if a.burstiness != 1 else "poisson",
                                               burstiness=a.burstiness, seed=a.seed)
                started = time.perf_counter()
                records, duration = asyncio.run(run_benchmark(server.url, reqs, max_concurrency=a.max_concurrency,
                                                              progress=True))
                m = compute_metrics(records, duration, goodput=slo)
                print(f"{policy} @ {rate} req/s: {m['completed']}/{m['num_requests']} done in "
                      f"{time.perf_counter() - started:.0f} s, mean TTFT {_pct(m, 'ttft_ms', 'mean') / 1000:.2f} s, "
                      f"p99 TBT {_pct(m, 'itl_ms', 'p99'):.0f} ms, goodput {(m['goodput'] or {}).get('requests_per_s')}",
                      flush=True)
                runs.append({"rate": rate, "metrics": m, "records": [r.to_dict() for r in records]})
    complete = [r["rate"] for r in results.get("monolithic", []) if r["metrics"]["failed"] == 0
                and r["metrics"]["completed"] == r["metrics"]["num_requests"]]
    rate = max(complete) if complete else rates[0]
    summary = summarize(results, rate)
    print("\n" + summary)
    (a.out / "summary.md").write_text(summary)
    (a.out / "results.json").write_text(json.dumps({"machine": machine_info(), "args": vars(a) | {"out": str(a.out)},
                                                    "results": results}, indent=1, default=str))
    for f in plot(results, a.out):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
