"""The ingress's ``/metrics``: every replica's Prometheus text with a ``replica`` label, and the
routing counters. Pure Python (prometheus-client only, no Ray)."""

from __future__ import annotations

import threading
import weakref
from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ROUTERS", "ROUTE_COUNTS", "ROUTE_REASONS", "RouteCounters", "merge_replica_metrics"]

#: how a request was placed (``routing.Route.reason``, decided against where it really went)
ROUTE_REASONS = ("affinity", "overflow", "unavailable", "least_loaded")


class RouteCounters:
    """Requests routed, by reason; incremented by the router, read by the ingress (another thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def inc(self, reason: str) -> None:
        assert reason in ROUTE_REASONS, reason
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {r: self._counts[r] for r in ROUTE_REASONS}

    def families(self) -> list[Metric]:
        counts = self.snapshot()
        routed = CounterMetricFamily(
            "unifiedserve_route_requests", "Requests the media-affinity router placed, by reason: affinity (the "
            "media key's owner), overflow (owner above the load bound, sent to the least-loaded replica), "
            "unavailable (owner gone), least_loaded (no media).", labels=["reason"])
        for reason, n in counts.items():
            routed.add_metric([reason], n)
        hits = CounterMetricFamily("unifiedserve_route_affinity_hits", "Requests with media sent to their key's owner.")
        hits.add_metric([], counts["affinity"])
        over = CounterMetricFamily("unifiedserve_route_overflow_reroutes",
                                   "Requests with media sent away from their key's owner because it was above "
                                   "the load bound (the key stays owned there).")
        over.add_metric([], counts["overflow"])
        return [routed, hits, over]


#: requests routed in this process, by reason (the router counts, the ingress renders them in /metrics)
ROUTE_COUNTS = RouteCounters()
#: the media-affinity routers alive in this process; the ingress reads their replica ids to scrape each one
ROUTERS: weakref.WeakSet = weakref.WeakSet()


def merge_replica_metrics(texts: dict[str, str], extra: list[Metric] = ()) -> bytes:
    """One Prometheus exposition of every replica's metrics, each sample labelled ``replica``.

    Args:
        texts: replica id -> that replica's ``/metrics`` text.
        extra: more families (the routing counters) appended as they are.

    Raises:
        ValueError: a replica's text is not Prometheus exposition format.
    """
    families: dict[str, Metric] = {}
    for replica_id, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            out = families.get(family.name)
            if out is None:
                out = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, "replica": replica_id}, s.value, s.timestamp, s.exemplar)

    class _Merged:
        def collect(self):
            return [*families.values(), *extra]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)
