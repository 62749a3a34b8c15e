"""The Serve router names replicas on the hash ring by their Serve rank, so that a replacement replica
(new id, the dead one's rank) takes exactly the dead replica's keys and the survivors keep theirs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve.request_router")

from unifiedserve.ray_serve import app  # noqa: E402
from unifiedserve.ray_serve.router import MediaAffinityRouter  # noqa: E402
from unifiedserve.ray_serve.routing import HashRing  # noqa: E402

KEYS = [f"video-{i:04d}" for i in range(3000)]


def replica(unique_id: str, metadata: dict) -> SimpleNamespace:
    """What ring_names reads of Serve's RunningReplica: the id and the published metadata."""
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id), replica_metadata=metadata)


def owners(replicas) -> dict[str, str]:
    """key -> replica id that owns it, with the ring built from the router's names."""
    names = MediaAffinityRouter.ring_names(replicas)
    ring = HashRing(sorted(names.values()))
    by_name = {name: rid for rid, name in names.items()}
    return {k: by_name[ring.owner(k)] for k in KEYS}


def test_names_are_ranks_when_every_replica_has_a_distinct_one():
    names = MediaAffinityRouter.ring_names([replica("a1", {"rank": 0}), replica("b1", {"rank": 1})])
    assert names == {"a1": "rank-0", "b1": "rank-1"}


@pytest.mark.parametrize("metadata", [[{"rank": 0}, {}], [{"rank": 0}, {"rank": 0}], [{}, {}],
                                      [{"rank": 0}, {"rank": "1"}]])
def test_names_fall_back_to_ids_without_distinct_ranks(metadata):
    names = MediaAffinityRouter.ring_names([replica("a1", metadata[0]), replica("b1", metadata[1])])
    assert names == {"a1": "a1", "b1": "b1"}


def test_a_replacement_takes_exactly_the_dead_replicas_keys():
    before = owners([replica("a1", {"rank": 0}), replica("b1", {"rank": 1}), replica("c1", {"rank": 2})])
    # a1 dies; Serve starts a2 and gives it the released rank 0
    after = owners([replica("a2", {"rank": 0}), replica("b1", {"rank": 1}), replica("c1", {"rank": 2})])
    for key in KEYS:
        assert after[key] == ("a2" if before[key] == "a1" else before[key])
    # keyed by id (what a Serve without ranks gives), the newcomer also takes some of b1's and c1's keys
    before_ids = owners([replica("a1", {}), replica("b1", {}), replica("c1", {})])
    after_ids = owners([replica("a2", {}), replica("b1", {}), replica("c1", {})])
    moved = sum(1 for k in KEYS if before_ids[k] != "a1" and after_ids[k] != before_ids[k])
    assert moved > 0.05 * len(KEYS)


def test_the_replica_publishes_its_rank(monkeypatch):
    context = SimpleNamespace(rank=SimpleNamespace(rank=3, node_rank=0, local_rank=3))
    monkeypatch.setattr(app.serve, "get_replica_context", lambda: context)
    assert app.replica_rank_metadata() == {"rank": 3}
    monkeypatch.setattr(app.serve, "get_replica_context", lambda: SimpleNamespace())  # a Serve without ranks
    assert app.replica_rank_metadata() == {}
    monkeypatch.setattr(app.serve, "get_replica_context", lambda: SimpleNamespace(rank=2))  # a plain int
    assert app.replica_rank_metadata() == {"rank": 2}
