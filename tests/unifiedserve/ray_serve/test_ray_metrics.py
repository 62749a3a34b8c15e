"""The ingress's /metrics: replicas' metrics labelled by replica, and the routing counters (no Ray)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from unifiedserve.ray_serve.metrics import RouteCounters, merge_replica_metrics


def replica_text(num_requests: int, latency_s: float) -> str:
    r = CollectorRegistry()
    Counter("unifiedserve_requests", "Finished requests.", ["model_name"], registry=r).labels("m").inc(num_requests)
    Histogram("unifiedserve_ttft_seconds", "TTFT.", ["model_name"], buckets=(0.1, 1.0), registry=r).labels(
        "m").observe(latency_s)
    return generate_latest(r).decode()


def samples(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_every_sample_gets_its_replica_label():
    counters = RouteCounters()
    for reason in ["affinity", "affinity", "overflow", "least_loaded"]:
        counters.inc(reason)
    got = samples(merge_replica_metrics({"r1": replica_text(3, 0.05), "r2": replica_text(5, 0.5)},
                                        counters.families()))
    assert got["unifiedserve_requests_total", (("model_name", "m"), ("replica", "r1"))] == 3
    assert got["unifiedserve_requests_total", (("model_name", "m"), ("replica", "r2"))] == 5
    assert got["unifiedserve_ttft_seconds_bucket", (("le", "0.1"), ("model_name", "m"), ("replica", "r1"))] == 1
    assert got["unifiedserve_ttft_seconds_bucket", (("le", "0.1"), ("model_name", "m"), ("replica", "r2"))] == 0
    assert got["unifiedserve_route_requests_total", (("reason", "affinity"),)] == 2
    assert got["unifiedserve_route_requests_total", (("reason", "unavailable"),)] == 0
    assert got["unifiedserve_route_affinity_hits_total", ()] == 2
    assert got["unifiedserve_route_overflow_reroutes_total", ()] == 1


def test_one_help_and_type_per_family():
    text = merge_replica_metrics({"a": replica_text(1, 1), "b": replica_text(2, 2)}).decode()
    assert text.count("# TYPE unifiedserve_requests_total counter") == 1


def test_bad_replica_text_and_reason():
    with pytest.raises(ValueError):
        merge_replica_metrics({"a": "not { prometheus"})
    with pytest.raises(AssertionError):
        RouteCounters().inc("lucky")
