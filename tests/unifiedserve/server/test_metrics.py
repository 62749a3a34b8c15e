"""/metrics from the workers' gauges: what the vision process holds ahead of admission, and what waits."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from unifiedserve.server.metrics import Metrics


def samples(metrics: Metrics) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples}


def test_the_vision_bound_is_exported_from_the_vision_gauges():
    metrics = Metrics("m")
    metrics.update_workers({"vision_requests": 3, "vision_in_flight": 1, "vision_waiting": 2,
                            "vision_probes_waiting": 4, "vision_ahead_bytes": 5 * 2**20}, num_in_api=0)
    got = samples(metrics)
    assert got["unifiedserve_vision_ahead_bytes"] == 5 * 2**20
    assert got["unifiedserve_vision_videos_waiting"] == 2
    assert got["unifiedserve_vision_probes_waiting"] == 4
    metrics.update_workers({"num_waiting": 1}, num_in_api=0)  # a refresh without vision's gauges keeps the last
    assert samples(metrics)["unifiedserve_vision_videos_waiting"] == 2
