"""Media-affinity routing: which replica serves a request. Pure bookkeeping over replica ids (no Ray).

A request's media key (``server/media_key.py``, the key of the media and prefix caches) picks its
owner on a consistent-hash ring with virtual nodes, so every question about one video goes to the
replica whose caches already hold it. Bounded load: when the owner already runs more requests than
the bound, the request goes to the least-loaded replica instead and the key stays owned where it
was (the next question goes back to the owner once it has room). Text-only requests go to the
least-loaded replica. A replica that joins takes over only the keys its virtual nodes now win; one
that leaves hands over only its own keys.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["HashRing", "Route", "RoutingConfig", "RoutingHints", "route"]


def _hash64(text: str) -> int:
    # stable across processes and runs (Python's hash() is salted per process)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class RoutingConfig:
    """Routing knobs; validated on construction (ValueError with a fix-it message)."""

    num_virtual_nodes: int = 160  # ring points per replica: key shares within ~10 % of even at 2-16 replicas
    load_factor: float = 1.25  # c of bounded-load hashing: owner full above ceil(c * mean load)
    min_load_bound: int = 4  # an owner with fewer requests than this is never full

    def __post_init__(self):
        if self.num_virtual_nodes < 1:
            raise ValueError(f"num_virtual_nodes must be >= 1, got {self.num_virtual_nodes}")
        if not (self.load_factor >= 1.0 and math.isfinite(self.load_factor)):
            raise ValueError(f"load_factor must be a finite number >= 1 (1 = perfectly even), got {self.load_factor}")
        if self.min_load_bound < 1:
            raise ValueError(f"min_load_bound must be >= 1, got {self.min_load_bound}")

    def load_bound(self, total_load: int, num_replicas: int) -> int:
        """Requests an owner may already run and still take one more keyed request.

        ``max(min_load_bound, ceil(load_factor * (total_load + 1) / num_replicas))``: the bounded-load
        rule of Mirrokni et al. (no replica above c times the mean, counting the new request), with a
        floor so that a lightly loaded cluster never gives away a cache hit to even out 1 vs 0.
        """
        return max(self.min_load_bound, math.ceil(self.load_factor * (total_load + 1) / max(1, num_replicas)))


class HashRing:
    """Consistent hashing with virtual nodes over replica ids (strings).

    Invariant: ``owner(key)`` depends only on the key and the current set of replicas, never on the
    order they were added in.
    """

    def __init__(self, replica_ids: Iterable[str] = (), num_virtual_nodes: int = RoutingConfig.num_virtual_nodes):
        if num_virtual_nodes < 1:
            raise ValueError(f"num_virtual_nodes must be >= 1, got {num_virtual_nodes}")
        self.num_virtual_nodes = num_virtual_nodes
        self._replicas: set[str] = set()
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[str] = []  # replica at each position
        self.sync(replica_ids)

    @property
    def replicas(self) -> frozenset[str]:
        return frozenset(self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)

    def _rebuild(self) -> None:
        # ties between two replicas' points are broken by id, so the order of adds never matters
        ring = sorted((_hash64(f"{rid}#{v}"), rid) for rid in self._replicas for v in range(self.num_virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [rid for _, rid in ring]

    def add(self, replica_id: str) -> None:
        """Put a replica on the ring (no-op when it is there already)."""
        if replica_id not in self._replicas:
            self._replicas.add(replica_id)
            self._rebuild()

    def remove(self, replica_id: str) -> None:
        """Take a replica off the ring (no-op when it is not there)."""
        if replica_id in self._replicas:
            self._replicas.discard(replica_id)
            self._rebuild()

    def sync(self, replica_ids: Iterable[str]) -> None:
        """Make the ring hold exactly ``replica_ids``; replicas already on it keep their points."""
        wanted = set(replica_ids)
        if wanted != self._replicas:
            self._replicas = wanted
            self._rebuild()

    def owner(self, key: str) -> str:
        """The replica owning ``key``: the first virtual node clockwise from the key's hash.

        Raises:
            LookupError: the ring is empty.
        """
        if not self._points:
            raise LookupError("no replica on the ring")
        i = bisect.bisect_right(self._points, _hash64(key)) % len(self._points)
        return self._owners[i]


@dataclass(frozen=True)
class RoutingHints:
    """What the ingress tells the router about one call (the ``routing`` keyword of every replica method)."""

    key: str | None = None  # media key of the request's first media; None: no media (or not resolvable)
    replica_id: str | None = None  # only this replica (metrics scrapes); never counted as routing
    exclude: tuple[str, ...] = ()  # replicas whose runtime refused the request (dead workers)


@dataclass(frozen=True)
class Route:
    """Where one request goes and why."""

    replica_id: str
    # "affinity": its key's owner; "overflow": the owner was above the bound; "unavailable": the owner
    # is not among the available replicas; "least_loaded": a request without media
    reason: str
    owner_id: str | None = None  # the key's owner (also when it overflowed); None without a key


def _least_loaded(loads: Mapping[str, int]) -> str:
    # ties go by a hash of the id, not the id itself, so replica names do not bias who gets work
    return min(loads, key=lambda rid: (loads[rid], _hash64(rid)))


def route(key: str | None, loads: Mapping[str, int], ring: HashRing,
          config: RoutingConfig = RoutingConfig()) -> Route:
    """Choose a replica for one request.

    Args:
        key: the request's media key, or None for a text-only request.
        loads: requests each *available* replica runs or has queued now; only these are chosen.
        ring: the hash ring; it should hold the available replicas (an owner missing from
            ``loads``, e.g. one that just died, is routed around and keeps its keys on the ring).
        config: the bound.

    Returns:
        The chosen replica and the reason.

    Raises:
        LookupError: ``loads`` is empty (no replica available).
    """
    if not loads:
        raise LookupError("no replica available")
    if key is None:
        return Route(_least_loaded(loads), "least_loaded")
    owner = ring.owner(key) if len(ring) else None
    if owner in loads:
        bound = config.load_bound(sum(loads.values()), len(loads))
        if loads[owner] < bound:
            return Route(owner, "affinity", owner)
        others = {rid: n for rid, n in loads.items() if rid != owner}
        if others:
            best = _least_loaded(others)
            if others[best] < loads[owner]:
                return Route(best, "overflow", owner)
        return Route(owner, "affinity", owner)  # every other replica is as busy: the cache hit wins
    return Route(_least_loaded(loads), "unavailable", owner)
