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

Where one run cannot hold all three policies (a GPU run is capped at 10 minutes), run one policy at a
time with the same options, then merge the runs' ``results.json`` into one table and plots:

    python bench/policies/bench_policies.py --merge run-unified run-monolithic run-split --out merged

A run may also hold only some rates of a policy (``--rates``, or rates ``--time-budget-s`` skipped):
runs of one policy at other rates merge into its row. ``results.json`` is rewritten after every rate,
so a run stopped from outside keeps the rates it finished (marked ``"partial": true``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for extra in (ROOT / "datasets", ROOT / "bench" / "serve"):
    sys.path.insert(0, str(extra))

import workload_config  # noqa: E402
import workload_synthetic  # noqa: E402
import workloads  # noqa: E402
from bench_serve import CUT_ERROR, machine_info, run_benchmark, warm_up  # noqa: E402
from serve_metrics import RequestRecord, compute_metrics, meets_slo, parse_goodput  # noqa: E402
from server_process import ServerProcess, on_gpu, run_main  # noqa: E402

POLICIES = ("unified", "monolithic", "split")


ATTAINMENT_FOR_CAPACITY = 0.9  # DistServe-style capacity: the highest rate with this share of requests in SLO
SLO_SCALES = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)


def _pct(m: dict, key: str, q: str) -> float:
    v = (m.get(key) or {}).get(q)
    return float("nan") if v is None else v


def _goodput(m: dict | None) -> float:
    return ((m or {}).get("goodput") or {}).get("requests_per_s", float("nan"))


def _attainment(m: dict | None) -> float:
    return ((m or {}).get("goodput") or {}).get("attainment", float("nan"))


def _at(results: dict, rate: float) -> dict[str, dict | None]:
    return {p: next((r["metrics"] for r in runs if r["rate"] == rate), None) for p, runs in results.items()}


#: --time-budget-s: after a rate's last arrival its queue still drains; a rate is started only if its predicted
#: length (:func:`predicted_s`) fits what is left, and a rate still running when the budget ends is cut with
#: REPORT_S left to write the results (its unfinished requests count as failed, and the run says "cut").
#: DRAIN_SHARE and DRAIN_S: on an H200 (2026-11-28, 64 requests) the three rates ended 12, 18 and 60 s after their
#: last arrival, 9 s before to 8 s after what the two allow for (docs/gpu-runs/2026-11-28-h200-b)
DRAIN_SHARE, DRAIN_S, REPORT_S = 1 / 6, 10.0, 15.0


def predicted_s(last_arrival_s: float, num_requests: int, alone: RequestRecord | None = None) -> float:
    """About how long a rate's run takes: its arrivals (until the seeded schedule's last one, ``last_arrival_s``)
    and a sixth more for the queue to drain, or, when one request served alone (``alone``, the last warm-up) says
    the server cannot keep up, the requests' first tokens one after another (each request's TTFT alone: its
    decode, encode and prefill, which no policy overlaps with another request's on one GPU) and the last one's
    remaining tokens; plus DRAIN_S."""
    span = last_arrival_s * (1 + DRAIN_SHARE)
    if alone is not None and alone.is_success and alone.ttft_s is not None:
        span = max(span, num_requests * alone.ttft_s + (alone.e2e_s - alone.ttft_s))
    return span + DRAIN_S


def measured_rates(results: dict) -> list[float]:
    """Every rate any policy in ``results`` was run at, ascending."""
    return sorted({run["rate"] for runs in results.values() for run in runs})


def monolithic_complete(results: dict) -> list[float]:
    """The rates at which monolithic completed every request."""
    return [r["rate"] for r in results.get("monolithic", []) if r["metrics"]["failed"] == 0
            and r["metrics"]["completed"] == r["metrics"]["num_requests"]]


def comparison_rate(results: dict, rates: list[float]) -> float:
    """The issue's condition: the highest rate at which monolithic completed every request (else the lowest)."""
    complete = monolithic_complete(results)
    return max(complete) if complete else rates[0]


def ratios(at: dict[str, dict | None]) -> dict[str, float]:
    """unified's p99 TBT / monolithic's, mean TTFT / split's, goodput / the better baseline's."""
    u, mono, split = at.get("unified"), at.get("monolithic"), at.get("split")
    out = {}
    if u and mono:
        out["tbt_p99_vs_monolithic"] = _pct(u, "itl_ms", "p99") / _pct(mono, "itl_ms", "p99")
    if u and split:
        out["ttft_mean_vs_split"] = _pct(u, "ttft_ms", "mean") / _pct(split, "ttft_ms", "mean")
    if u and (mono or split):
        best = max(_goodput(m) for m in (mono, split) if m)
        out["goodput_vs_best_baseline"] = _goodput(u) / best if best > 0 else math.inf
    return out


def records_of(run: dict) -> list[RequestRecord]:
    names = {f.name for f in dataclasses.fields(RequestRecord)}
    return [RequestRecord(**{k: v for k, v in d.items() if k in names}) for d in run["records"]]


def attainment(run: dict, slo: dict, scale: float = 1.0) -> float:
    """Share of a run's requests that meet ``slo`` (ms) multiplied by ``scale``."""
    recs = records_of(run)
    scaled = {k: v * scale for k, v in slo.items()}
    return sum(meets_slo(r, ttft_ms=scaled.get("ttft"), tbt_ms=scaled.get("tbt")) for r in recs) / max(1, len(recs))


def capacity(runs: list[dict], share: float = ATTAINMENT_FOR_CAPACITY) -> float:
    """Highest rate whose SLO attainment is >= ``share`` (0 when none is)."""
    ok = [r["rate"] for r in runs if _attainment(r["metrics"]) >= share]
    return max(ok, default=0.0)


def _capacity_text(policy: str, cap: float, runs: list[dict]) -> str:
    if cap:
        return f"{policy} {cap:g} req/s"
    if not runs:  # a run whose every rate was skipped for time
        return f"{policy} not measured"
    return f"{policy} below {min(r['rate'] for r in runs):g} req/s (no measured rate met it)"


def targets(gpu: bool = False) -> tuple:
    """``(key, text, target text, check)`` per ratio: the GPU table's p99 TBT target is the paper's regime
    (<= 0.2x monolithic, issue 14), the CPU table's <= 0.5x."""
    tbt = 0.2 if gpu else 0.5
    return (("tbt_p99_vs_monolithic", "unified p99 TBT / monolithic p99 TBT", f"<= {tbt:g}", lambda x: x <= tbt),
            ("ttft_mean_vs_split", "unified mean TTFT / split mean TTFT", "<= 0.7", lambda x: x <= 0.7),
            ("goodput_vs_best_baseline", "unified goodput / better baseline's goodput", ">= 1.3", lambda x: x >= 1.3))


def comparison_reason(results: dict, rate: float) -> str:
    """Why ``rate`` is the summary's comparison rate (:func:`comparison_rate`'s rule, or the caller's choice)."""
    complete = monolithic_complete(results)
    if "monolithic" not in results:
        return "monolithic did not run here: the lowest rate"
    if not complete:
        return "monolithic completed every request at no rate: the lowest rate"
    return "the highest rate at which monolithic completed every request" if rate == max(complete) else \
        "the rate asked for"


def summarize(results: dict, rate: float, slo: dict, gpu: bool = False) -> str:
    """Markdown: each policy's numbers at ``rate``, unified's ratios at every rate, capacities."""
    slo_text = " and ".join(f"{'TTFT' if k == 'ttft' else 'p90 of its TBTs'} <= {v:g} ms" for k, v in slo.items())
    rows = [f"Comparison rate: **{rate:g} req/s** ({comparison_reason(results, rate)}). "
            f"A request meets the SLO when {slo_text}.", "",
            "| policy | completed | mean TTFT (s) | p90 TTFT (s) | p50 TBT (ms) | p99 TBT (ms) | SLO attainment "
            "| goodput (req/s) |",
            "|---|---|---|---|---|---|---|---|"]
    at = _at(results, rate)
    for policy, m in at.items():
        if m is None:
            continue
        done = f"{m['completed']}/{m['num_requests']}"
        if any(r.get("cut") for r in results[policy] if r["rate"] == rate):
            done += " (cut)"  # the run's time budget ended first: its unfinished requests count as failed
        rows.append(f"| {policy} | {done} | {_pct(m, 'ttft_ms', 'mean') / 1000:.2f} | "
                    f"{_pct(m, 'ttft_ms', 'p90') / 1000:.2f} | {_pct(m, 'itl_ms', 'p50'):.1f} | "
                    f"{_pct(m, 'itl_ms', 'p99'):.1f} | {_attainment(m):.2f} | {_goodput(m):.3f} |")
    r = ratios(at)
    lines = ["", f"Targets at {rate:g} req/s:", ""]
    for key, text, target, ok in targets(gpu):
        if key in r:
            lines.append(f"- {text} = **{r[key]:.2f}** (target {target}: {'met' if ok(r[key]) else 'missed'})")
    rates = measured_rates(results)
    lines += ["", "unified's ratios at every rate:", "",
              "| rate (req/s) | p99 TBT / monolithic | mean TTFT / split | goodput / better baseline |",
              "|---|---|---|---|"]
    for x in rates:
        q = ratios(_at(results, x))
        lines.append(f"| {x:g} | " + " | ".join(f"{q[k]:.2f}" if k in q else "-" for k, *_ in targets(gpu)) + " |")
    caps = {p: capacity(runs) for p, runs in results.items()}
    lines += ["", f"Capacity (highest measured rate with >= {ATTAINMENT_FOR_CAPACITY:.0%} of requests in SLO): "
              + ", ".join(_capacity_text(p, c, results[p]) for p, c in caps.items()), ""]
    return "\n".join(rows + lines)


def plot(results: dict, rate: float, slo: dict, out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -r requirements/bench.txt)")
        return []
    colors = {p: f"C{i}" for i, p in enumerate(POLICIES)}
    panels = [("p99 TBT (ms, log)", lambda m: _pct(m, "itl_ms", "p99")),
              ("p90 TTFT (s)", lambda m: _pct(m, "ttft_ms", "p90") / 1000),
              ("SLO attainment", _attainment),
              ("goodput (req/s)", _goodput)]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    axes = axes.ravel()
    for ax, (label, fn) in zip(axes, panels):
        for policy, runs in results.items():
            ax.plot([r["rate"] for r in runs], [fn(r["metrics"]) for r in runs], marker="o", label=policy,
                    color=colors.get(policy))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend()
    names = list(results)
    axes[4].bar(names, [_goodput(_at(results, rate)[p]) for p in names], color=[colors.get(p) for p in names])
    axes[4].set_ylabel(f"goodput at {rate:g} req/s (req/s)")
    for policy, runs in results.items():
        run = next((r for r in runs if r["rate"] == rate), None)
        if run is not None:
            axes[5].plot(SLO_SCALES, [attainment(run, slo, s) for s in SLO_SCALES], marker="o", label=policy,
                         color=colors.get(policy))
    axes[5].set_xlabel("SLO scale (x the SLO)")
    axes[5].set_ylabel(f"SLO attainment at {rate:g} req/s")
    axes[5].grid(alpha=0.3)
    fig.tight_layout()
    files = [out / "policies.png"]
    fig.savefig(files[0], dpi=72)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.4), sharey=True, squeeze=False)
    for ax, (policy, runs) in zip(axes[0], results.items()):
        run = next((r for r in runs if r["rate"] == rate), runs[-1])
        for rec in run["records"]:
            times = rec.get("token_times_s") or []
            ax.step(times, range(1, len(times) + 1), where="post", linewidth=0.8)
        ax.set_title(f"{policy} @ {run['rate']:g} req/s")
        ax.set_xlabel("time (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens emitted")
    fig.tight_layout()
    files.append(out / "timeline.png")
    fig.savefig(files[1], dpi=72)
    plt.close(fig)
    return files


def merge(runs: list[Path], out: Path) -> int:
    """Summary and plots of several runs' ``results.json`` (ValueError: unreadable, or not comparable)."""
    loaded = []
    for run in runs:
        path = run / "results.json" if run.is_dir() else run
        try:
            loaded.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"--merge: cannot read {path}: {e}") from None
    same = ("workload", "num_requests", "scale", "video_seconds", "num_videos", "max_frames", "output_len",
            "burstiness", "seed", "goodput", "server_args")
    first = loaded[0]["args"]
    for run, data in zip(runs[1:], loaded[1:]):
        differ = [k for k in same if data["args"].get(k) != first.get(k)]
        if differ:
            raise ValueError(f"--merge: {run} was run with other {', '.join(differ)} than {runs[0]}")
    results: dict[str, list] = {}
    for run, data in zip(runs, loaded):
        for policy, policy_runs in data["results"].items():
            have = {r["rate"] for r in results.get(policy, [])}
            again = sorted(have & {r["rate"] for r in policy_runs})
            if again:
                raise ValueError(f"--merge: policy {policy} at {', '.join(f'{r:g}' for r in again)} req/s is in more "
                                 f"than one run ({run})")
            results[policy] = sorted(results.get(policy, []) + policy_runs, key=lambda r: r["rate"])
    order = {p: i for i, p in enumerate(POLICIES)}
    results = dict(sorted(results.items(), key=lambda item: order.get(item[0], len(order))))
    rates = measured_rates(results)
    if not rates:
        raise ValueError("--merge: the runs hold no finished rate")
    slo = parse_goodput(first["goodput"])
    return report(results, rates, slo, out, on_gpu(first.get("server_args", "")),
                  {"machine": [d.get("machine") for d in loaded], "args": first | {"merged": [str(r) for r in runs]}})


def report(results: dict, rates: list[float], slo: dict, out: Path, gpu: bool, meta: dict) -> int:
    """Print and write the summary, results.json and the plots of ``results`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rate = comparison_rate(results, rates)
    summary = summarize(results, rate, slo, gpu)
    print("\n" + summary)
    (out / "summary.md").write_text(summary)
    (out / "results.json").write_text(json.dumps(meta | {"results": results}, indent=1, default=str))
    for f in plot(results, rate, slo, out):
        print(f"wrote {f}")
    return 0


def main(argv=None) -> int:
    began = time.monotonic()  # --time-budget-s counts from here: the workload's generation is inside it
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rates", default="0.05,0.1,0.2", help="request rates, req/s (comma-separated)")
    p.add_argument("--workload", default="long-video", choices=workload_config.SYNTHETIC)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--scale", type=float, default=0.05, help="shrinks video durations and sizes for CPU runs")
    p.add_argument("--video-seconds", type=workloads.seconds_range, default=None, metavar="MIN,MAX",
                   help="videos last MIN to MAX s at their full size (--scale then shrinks sizes only), e.g. "
                        "60,300 with --scale 1 for the GPU's 1-5 minute 720p videos")
    p.add_argument("--num-videos", type=int, default=2)
    p.add_argument("--max-frames", type=int, default=None, metavar="N",
                   help="frame cap sent with each video (default: the server's, Qwen2.5-VL's 768; at 2 fps a 1-5 "
                        "minute 720p video is then ~110k tokens, see docs/gpu.md for the GPU run's 64)")
    p.add_argument("--warmups", type=int, default=1, metavar="N",
                   help="unmeasured requests per server before the rates; the last one, served alone and warm, "
                        "also sizes each rate's run for --time-budget-s (default 1)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=["ttft:20000", "tbt:500"], help="SLOs, e.g. ttft:MS tbt:MS")
    p.add_argument("--server-args", default="", help="extra flags for every server (same for all policies)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "policies")
    p.add_argument("--time-budget-s", type=float, default=None, metavar="S",
                   help="skip a rate whose arrivals (until the seeded schedule's last one) and the drain after "
                        "them (a sixth of the arrivals and 10 s) would end more than S s after this program started "
                        "(a device run's time limit); with several policies each gets an even share of what is left "
                        "when its server starts; finished rates are kept")
    p.add_argument("--merge", nargs="+", type=Path, metavar="RUN",
                   help="no server: merge the results.json of these runs (one policy or some rates of one each, same "
                        "workload and SLOs) into one summary and plots in --out")
    a = p.parse_args(argv)
    if a.merge:
        try:
            return merge(a.merge, a.out)
        except ValueError as e:
            p.error(str(e))
    if a.max_frames is not None and a.max_frames < 2:
        p.error(f"--max-frames must be at least 2 (one temporal patch), got {a.max_frames}")
    if a.warmups < 1:
        p.error(f"--warmups must be at least 1, got {a.warmups}")
    try:  # the SLO, the rates and the workload's options: one error line, not a traceback
        slo = parse_goodput(a.goodput)
        rates = [float(r) for r in a.rates.split(",")]
        if not all(r > 0 for r in rates):
            raise ValueError(f"--rates must be positive request rates, got {a.rates}")
        cfg = workload_config.WorkloadConfig(
            workload=a.workload, num_requests=a.num_requests, output_len=a.output_len, ignore_eos=True, seed=a.seed,
            scale=a.scale, video_seconds=a.video_seconds, num_videos=a.num_videos, max_frames=a.max_frames)
    except ValueError as e:
        p.error(str(e))
    a.out.mkdir(parents=True, exist_ok=True)
    base = workload_synthetic.generate_workload(cfg, progress=True)
    media_dir = Path(base[0]["media"][0]["path"]).parent if base and base[0]["media"] else ROOT
    flags = ["--allowed-local-media-path", str(media_dir.parent), "--kv-cache-gb", "0.5", "--patch-buffer-gb", "1",
             *a.server_args.split()]
    results: dict[str, list] = {}
    meta = {"machine": machine_info(), "args": vars(a) | {"out": str(a.out), "merge": None}}
    deadline = None if a.time_budget_s is None else began + a.time_budget_s
    policies = a.policies.split(",")
    for i, policy in enumerate(policies):
        # each policy of a budgeted run gets an even share of what is left when it starts (so also what an earlier
        # one left unused): the first policy's rates cannot spend the others' time
        share_end = None if deadline is None else time.monotonic() + (deadline - time.monotonic()) / (len(policies) - i)
        print(f"\n=== policy {policy}: unifiedserve serve --policy {policy} {' '.join(flags)}", flush=True)
        with ServerProcess(["--policy", policy, *flags], a.out / f"server-{policy}.log") as server:
            runs = results[policy] = []
            # first-call costs (thread pools, allocator, kernels) stay out; the last one is a request served alone
            alone = asyncio.run(warm_up(server.url, base, a.warmups))[-1]
            alone_ttft = alone.ttft_s or 0.0  # None only for a stream that showed no token (usage alone)
            print(f"{policy}: one request alone: TTFT {alone_ttft:.2f} s, {alone.e2e_s:.2f} s in all "
                  f"({alone.prompt_tokens} prompt tokens)", flush=True)
            for rate in rates:
                reqs = workload_config.with_arrivals(base, rate, arrival="gamma" if a.burstiness != 1 else "poisson",
                                                     burstiness=a.burstiness, seed=a.seed)
                need = predicted_s(max((r["arrival_s"] for r in reqs), default=0.0), a.num_requests, alone)
                left = None if share_end is None else share_end - time.monotonic()
                if left is not None and need > left:
                    share = "" if len(policies) == 1 else f" (its share: 1/{len(policies) - i} of what was left)"
                    print(f"{policy} @ {rate} req/s: skipped: its arrivals and their drain take about {need:.0f} s, "
                          f"{max(0.0, left):.0f} s of --time-budget-s are left{share}", flush=True)
                    continue
                print(f"{policy} @ {rate} req/s: offered load {rate * alone_ttft:.2f} (rate x one request's TTFT "
                      f"alone), about {need:.0f} s", flush=True)
                started = time.perf_counter()
                records, duration = asyncio.run(run_benchmark(
                    server.url, reqs, max_concurrency=a.max_concurrency, progress=True,
                    deadline_s=None if left is None else max(0.0, left - REPORT_S)))
                m = compute_metrics(records, duration, goodput=slo)
                cut = sum(r.error == CUT_ERROR for r in records)
                note = f" (cut: {cut} unfinished at the time budget)" if cut else ""
                took = time.perf_counter() - started
                ttft, p99 = _pct(m, "ttft_ms", "mean") / 1000, _pct(m, "itl_ms", "p99")
                print(f"{policy} @ {rate} req/s: {m['completed']}/{m['num_requests']} done in {took:.0f} s{note}, "
                      f"mean TTFT {ttft:.2f} s, p99 TBT {p99:.0f} ms, "
                      f"goodput {(m['goodput'] or {}).get('requests_per_s')}", flush=True)
                runs.append({"rate": rate, "metrics": m, "records": [r.to_dict() for r in records]}
                            | ({"cut": cut} if cut else {}))
                # what is finished survives a run stopped from outside (a device run's time limit)
                (a.out / "results.json").write_text(json.dumps(meta | {"partial": True, "results": results},
                                                               indent=1, default=str))
                if cut:
                    break  # the budget is spent: later rates would be cut at once
    results = {policy: runs for policy, runs in results.items() if runs}
    done = measured_rates(results)
    if not done:
        print("bench_policies.py: error: no rate fits --time-budget-s", file=sys.stderr)
        return 1
    return report(results, done, slo, a.out, on_gpu(a.server_args), meta)


if __name__ == "__main__":
    sys.exit(run_main(main, "bench_policies.py"))
