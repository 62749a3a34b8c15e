"""Tests for bench/serve/serve_metrics.py: metrics, SLO attainment and goodput on hand-made records with known
answers, and the ``--goodput`` parser."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT / "bench" / "serve") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench" / "serve"))

import serve_metrics as sm  # noqa: E402
from serve_metrics import RequestRecord  # noqa: E402

# ---------------------------------------------------------------------------
# compute_metrics on records with known answers
# ---------------------------------------------------------------------------


def hand_made() -> list[RequestRecord]:
    return [
        # TTFT 100 ms, ITLs 100/100/200 ms, E2E 500 ms, TPOT 400/3 ms
        RequestRecord("a", 0.0, start_s=0.0, end_s=0.5, token_times_s=[0.1, 0.2, 0.3, 0.5],
                      completion_tokens=4, prompt_tokens=10, is_success=True),
        # TTFT 300 ms, ITLs 50/50 ms, E2E 400 ms, TPOT 50 ms
        RequestRecord("b", 1.0, start_s=1.0, end_s=1.4, token_times_s=[1.3, 1.35, 1.4],
                      completion_tokens=3, prompt_tokens=20, is_success=True),
        RequestRecord("c", 2.0, start_s=2.0, end_s=2.1, error="HTTP 400: bad", prompt_tokens=None),
        # one token: TTFT 50 ms, no ITL, no TPOT
        RequestRecord("d", 0.0, start_s=0.0, end_s=0.05, token_times_s=[0.05], completion_tokens=1,
                      is_success=True),
    ]


def test_metrics_known_answers():
    m = sm.compute_metrics(hand_made(), duration_s=4.0)
    assert (m["num_requests"], m["completed"], m["failed"]) == (4, 3, 1)
    assert m["total_output_tokens"] == 8 and m["total_input_tokens"] == 30
    assert m["request_throughput"] == pytest.approx(0.75) and m["output_throughput"] == pytest.approx(2.0)
    # TTFT [100, 300, 50]: linear-interpolated percentiles of the sorted [50, 100, 300]
    assert m["ttft_ms"] == pytest.approx({"mean": 150.0, "p50": 100.0, "p90": 260.0, "p99": 296.0})
    assert m["itl_ms"]["mean"] == pytest.approx(100.0) and m["itl_ms"]["p50"] == pytest.approx(100.0)
    assert m["itl_ms"]["p90"] == pytest.approx(160.0)  # [50, 50, 100, 100, 200]
    assert m["tpot_ms"]["mean"] == pytest.approx((400 / 3 + 50) / 2)
    assert m["e2e_ms"]["mean"] == pytest.approx(950 / 3) and m["e2e_ms"]["p50"] == pytest.approx(400.0)
    assert m["goodput"] is None


def test_failed_requests_are_counted_but_not_in_latencies():
    recs = hand_made()
    recs[2].token_times_s = [2.001]  # a failure that streamed one chunk first
    m = sm.compute_metrics(recs, 4.0)
    assert m["failed"] == 1 and m["ttft_ms"]["mean"] == pytest.approx(150.0)
    only_failed = sm.compute_metrics([recs[2]], 1.0, goodput={"ttft": 1e9})
    assert only_failed["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert only_failed["goodput"]["num_met"] == 0 and "-" in sm.format_metrics(only_failed)


def test_goodput_uses_the_p90_of_each_requests_tbts():
    # a: TTFT ok; its TBTs [100, 100, 200] have mean 133 but p90 180 -> misses tbt 150, meets tbt 190
    # b: TTFT 300 misses; c failed; d has no TBT and TTFT 50 -> meets
    m = sm.compute_metrics(hand_made(), 4.0, goodput={"ttft": 200, "tbt": 150})
    assert m["goodput"]["num_met"] == 1 and m["goodput"]["attainment"] == pytest.approx(0.25)
    assert m["goodput"]["requests_per_s"] == pytest.approx(0.25)
    assert sm.compute_metrics(hand_made(), 4.0, goodput={"ttft": 200, "tbt": 190})["goodput"]["num_met"] == 2
    assert sm.compute_metrics(hand_made(), 4.0, goodput={"ttft": 350})["goodput"]["num_met"] == 3
    assert "SLO attainment" in sm.format_metrics(m)


def test_metric_argument_errors():
    with pytest.raises(ValueError, match="duration_s"):
        sm.compute_metrics(hand_made(), 0.0)
    with pytest.raises(ValueError, match="unknown SLO"):
        sm.compute_metrics(hand_made(), 1.0, goodput={"tpot": 5})
    assert sm.parse_goodput(["ttft:500", "tbt:50"]) == {"ttft": 500.0, "tbt": 50.0}
    for bad in (["ttft"], ["e2e:5"], ["tbt:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            sm.parse_goodput(bad)
