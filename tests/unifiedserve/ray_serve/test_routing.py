"""Media-affinity routing decisions (pure bookkeeping, no Ray)."""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unifiedserve.ray_serve.routing import HashRing, Route, RoutingConfig, route

KEYS = [f"video-{i:04d}" for i in range(4000)]


def shares(ring: HashRing) -> dict[str, float]:
    counts = collections.Counter(ring.owner(k) for k in KEYS)
    return {rid: counts[rid] / len(KEYS) for rid in ring.replicas}


def test_the_routing_module_does_not_import_ray():
    code = "import sys, unifiedserve.ray_serve.routing; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("n", [2, 4, 16])
def test_keys_spread_evenly(n):
    got = shares(HashRing([f"r{i}" for i in range(n)]))
    assert set(got) == {f"r{i}" for i in range(n)}
    assert max(got.values()) < 1.25 / n and min(got.values()) > 0.75 / n


def test_owner_does_not_depend_on_the_order_of_adds():
    a = HashRing(["x", "y", "z"])
    b = HashRing()
    for rid in ["z", "x", "y"]:
        b.add(rid)
    assert [a.owner(k) for k in KEYS[:500]] == [b.owner(k) for k in KEYS[:500]]


def test_a_joining_replica_takes_only_keys_it_now_owns():
    ring = HashRing(["a", "b", "c"])
    before = {k: ring.owner(k) for k in KEYS}
    ring.add("d")
    after = {k: ring.owner(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "d" for k in moved)  # nothing moves between the old replicas
    assert 0.15 < len(moved) / len(KEYS) < 0.35  # about 1/4 of the keys


def test_a_leaving_replica_hands_over_only_its_own_keys():
    ring = HashRing(["a", "b", "c", "d"])
    before = {k: ring.owner(k) for k in KEYS}
    ring.remove("b")
    after = {k: ring.owner(k) for k in KEYS}
    for k in KEYS:
        if before[k] != "b":
            assert after[k] == before[k]
        else:
            assert after[k] in {"a", "c", "d"}
    ring.sync(["a", "b", "c", "d"])  # it comes back: the same keys return to it
    assert {k: ring.owner(k) for k in KEYS} == before


@settings(max_examples=50, deadline=None)
@given(st.sets(st.text(min_size=1, max_size=8), min_size=1, max_size=6), st.text(max_size=20))
def test_owner_is_on_the_ring(ids, key):
    assert HashRing(ids, num_virtual_nodes=8).owner(key) in ids


def test_empty_ring_and_bad_config():
    with pytest.raises(LookupError):
        HashRing().owner("k")
    with pytest.raises(ValueError, match="load_factor"):
        RoutingConfig(load_factor=0.5)
    with pytest.raises(ValueError, match="num_virtual_nodes"):
        HashRing(["a"], num_virtual_nodes=0)
    with pytest.raises(LookupError):
        route("k", {}, HashRing(["a"]))


# ---------------------------------------------------------------------------
# bounded load
# ---------------------------------------------------------------------------


def owned_by(ring: HashRing, rid: str) -> str:
    return next(k for k in KEYS if ring.owner(k) == rid)


def test_key_goes_to_its_owner_below_the_bound():
    ring = HashRing(["a", "b"])
    key = owned_by(ring, "a")
    assert route(key, {"a": 3, "b": 0}, ring) == Route("a", "affinity", "a")  # 3 < floor 4: keep the cache hit


def test_owner_above_the_bound_overflows_to_the_least_loaded_and_keeps_the_key():
    cfg = RoutingConfig(load_factor=1.25, min_load_bound=2)
    ring = HashRing(["a", "b", "c"])
    key = owned_by(ring, "a")
    # total 6 -> bound max(2, ceil(1.25 * 7 / 3)) = 3; a runs 4
    assert cfg.load_bound(6, 3) == 3
    assert route(key, {"a": 4, "b": 2, "c": 0}, ring, cfg) == Route("c", "overflow", "a")
    assert ring.owner(key) == "a"  # ownership stays put
    assert route(key, {"a": 2, "b": 2, "c": 0}, ring, cfg).replica_id == "a"  # room again: back to the owner


def test_owner_stays_when_every_other_replica_is_as_busy():
    cfg = RoutingConfig(min_load_bound=1)
    ring = HashRing(["a", "b"])
    key = owned_by(ring, "a")
    assert route(key, {"a": 5, "b": 5}, ring, cfg) == Route("a", "affinity", "a")


def test_text_only_goes_to_the_least_loaded():
    ring = HashRing(["a", "b", "c"])
    assert route(None, {"a": 2, "b": 1, "c": 3}, ring) == Route("b", "least_loaded")


def test_dead_owner_is_routed_around():
    ring = HashRing(["a", "b"])
    key = owned_by(ring, "a")
    got = route(key, {"b": 7}, ring)  # a is gone from the available replicas, still on the ring
    assert got == Route("b", "unavailable", "a")


def test_multi_question_stream_keeps_affinity_below_the_bound():
    """Simulate 4 questions per video on 2 replicas, each taking 3 units of time: >= 95 % affinity."""
    ring = HashRing(["r0", "r1"])
    loads = {"r0": 0, "r1": 0}
    running: list[tuple[int, str]] = []  # (finish time, replica)
    hits = total = 0
    for t in range(400):
        for item in [x for x in running if x[0] <= t]:
            running.remove(item)
            loads[item[1]] -= 1
        key = f"video-{t // 4}"  # one question per tick, 4 per video
        r = route(key, loads, ring)
        hits += r.reason == "affinity"
        total += 1
        loads[r.replica_id] += 1
        running.append((t + 3, r.replica_id))
    assert hits / total >= 0.95
    assert {ring.owner(f"video-{v}") for v in range(100)} == {"r0", "r1"}  # both replicas used
