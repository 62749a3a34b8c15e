"""Serving metrics (pure): per-request records, and TTFT, TPOT, ITL and E2E percentiles, throughput,
SLO attainment and goodput over them, in the style of ``vllm bench serve``.

``bench_serve.py`` fills the records from a run against a server; other scripts build them from their own
streams or from a ``results.json``:

    sys.path.insert(0, "bench/serve")
    from serve_metrics import RequestRecord, compute_metrics, format_metrics
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RequestRecord", "compute_metrics", "format_metrics", "meets_slo", "parse_goodput"]


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds from the benchmark start."""

    request_id: str
    scheduled_s: float  # arrival time from the workload
    start_s: float = 0.0  # request sent (after waiting for a --max-concurrency slot)
    end_s: float = 0.0  # stream finished or failed
    token_times_s: list[float] = field(default_factory=list)  # each chunk with non-empty content
    completion_tokens: int = 0  # usage.completion_tokens of the final chunk, else the chunk count
    prompt_tokens: int | None = None  # usage.prompt_tokens, when the server reports it
    output_text: str = ""
    is_success: bool = False
    error: str | None = None  # "HTTP 400: message" or "ExceptionName: message"

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.start_s if self.token_times_s else None

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ttft_s": self.ttft_s, "itls_s": self.itls_s, "e2e_s": self.e2e_s}


# ---------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------


def _stats_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slo(rec: RequestRecord, *, ttft_ms: float | None = None, tbt_ms: float | None = None) -> bool:
    """HydraInfer's rule: TTFT <= ttft_ms and the p90 of the request's own TBTs (ITLs) <= tbt_ms.

    Failed requests never meet it; a request with a single token has no TBT to check.
    """
    if not rec.is_success:
        return False
    if ttft_ms is not None and rec.ttft_s * 1e3 > ttft_ms:
        return False
    if tbt_ms is not None and rec.itls_s and float(np.percentile(rec.itls_s, 90)) * 1e3 > tbt_ms:
        return False
    return True


def compute_metrics(records: list[RequestRecord], duration_s: float, goodput: dict | None = None) -> dict:
    """Latency percentiles (ms) over successful requests, throughputs over ``duration_s``.

    TPOT per request is (E2E - TTFT) / (completion_tokens - 1), for requests with >= 2 tokens;
    ITL pools the gaps between streamed chunks of all requests. ``goodput``:
    ``{"ttft": ms, "tbt": ms}`` (either may be left out) adds the number of requests meeting
    :func:`meets_slo`, their share of all requests (failures count against it) and their rate.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.is_success]
    output_tokens = sum(r.completion_tokens for r in ok)
    metrics = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_output_tokens": output_tokens,
        "total_input_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)
                              for r in ok if r.completion_tokens > 1]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
        "goodput": None,
    }
    if goodput:
        unknown = set(goodput) - {"ttft", "tbt"}
        if unknown:
            raise ValueError(f"unknown SLO keys {sorted(unknown)}; use ttft and tbt (ms)")
        num_met = sum(meets_slo(r, ttft_ms=goodput.get("ttft"), tbt_ms=goodput.get("tbt")) for r in records)
        metrics["goodput"] = {
            "slo_ms": dict(goodput), "num_met": num_met,
            "attainment": num_met / len(records) if records else 0.0,
            "requests_per_s": num_met / duration_s,
        }
    return metrics


def format_metrics(m: dict) -> str:
    """A plain-text table of :func:`compute_metrics`'s result."""
    lines = [
        f"{' Serving Benchmark Result ':=^60}",
        f"{'Successful requests:':<40}{m['completed']:>20}",
        f"{'Failed requests:':<40}{m['failed']:>20}",
        f"{'Benchmark duration (s):':<40}{m['duration_s']:>20.2f}",
        f"{'Total output tokens:':<40}{m['total_output_tokens']:>20}",
        f"{'Request throughput (req/s):':<40}{m['request_throughput']:>20.3f}",
        f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:>20.2f}",
    ]
    g = m.get("goodput")
    if g:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in g["slo_ms"].items())
        lines += [f"{'SLO':<40}{slo:>20}",
                  f"{'SLO attainment:':<40}{g['attainment']:>19.1%}",
                  f"{'Goodput (req/s):':<40}{g['requests_per_s']:>20.3f}"]
    lines.append(f"{'':-^60}")
    lines.append(f"{'(ms)':<12}" + "".join(f"{c:>12}" for c in ("mean", "p50", "p90", "p99")))
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = m[f"{name}_ms"]
        lines.append(f"{name.upper():<12}" + "".join(
            f"{s[c]:>12.2f}" if s[c] is not None else f"{'-':>12}" for c in ("mean", "p50", "p90", "p99")))
    lines.append("=" * 60)
    return "\n".join(lines)


def parse_goodput(items: list[str] | None) -> dict | None:
    """``["ttft:500", "tbt:50"]`` -> ``{"ttft": 500.0, "tbt": 50.0}``; ValueError when malformed."""
    if not items:
        return None
    slo = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tbt") or not value:
            raise ValueError(f"--goodput takes ttft:MS and/or tbt:MS, got {item!r}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not slo[key] > 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slo
