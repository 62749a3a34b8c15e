"""The Serve request router that places requests on node replicas by media affinity.

Runs inside the ingress process, on the handle's routing loop (Serve builds one per handle from
the deployment's ``RequestRouterConfig``). The decisions are ``routing.route``; this class only
maps Serve's replicas and queue lengths to ids and loads, and counts where requests went.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# Serve pickles this module by value into each handle's process: state shared with the ingress
# (counters, the live routers) is reached through the metrics module, which is imported by name.
from unifiedserve.ray_serve import metrics as shared
from unifiedserve.ray_serve.routing import HashRing, Route, RoutingConfig, RoutingHints, route


def hints_of(pending_request: PendingRequest | None) -> RoutingHints:
    if pending_request is None:
        return RoutingHints()
    hints = pending_request.kwargs.get("routing")
    return hints if isinstance(hints, RoutingHints) else RoutingHints()


class MediaAffinityRouter(RequestRouter):
    """Consistent hashing of the media key with bounded load (see ``routing.py``).

    The ring holds every running replica, named by its Serve rank (see :meth:`ring_names`), so an
    owner whose Serve queue is full keeps its keys, and a replica's replacement inherits them;
    loads are Serve's cached queue lengths (requests sent and not finished, per replica). No FIFO mixin:
    a replica chosen for one request is given to that request, never to an older one with another key.
    """

    # Serve asks a replica for its queue length when its cached one is older than 10 s, and skips a
    # replica that has not answered within the deadline. A replica's actor shares its node with its
    # own vision/core/decode processes, which keep the cores busy; at Serve's 0.1 s a busy owner
    # looked absent and its video's questions went to a cold replica.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 5.0
    #: rounds (each after a backoff) in which only the chosen replica is offered, before the others
    NUM_OWNER_ONLY_ROUNDS = 3

    def initialize_state(self, num_virtual_nodes: int = RoutingConfig.num_virtual_nodes,
                         load_factor: float = RoutingConfig.load_factor,
                         min_load_bound: int = RoutingConfig.min_load_bound):
        self.config = RoutingConfig(num_virtual_nodes, load_factor, min_load_bound)
        self.ring = HashRing(num_virtual_nodes=num_virtual_nodes)
        self._decisions: dict[str, Route] = {}  # internal request id -> decision, until routed
        self._rounds: dict[str, int] = {}  # internal request id -> routing rounds so far, until routed
        self._names: dict[str, str] = {}  # replica id -> ring name, as of the last routing decision
        shared.ROUTERS.add(self)

    def replica_ids(self) -> list[str]:
        return sorted(rid.unique_id for rid in self.curr_replicas)

    @staticmethod
    def ring_names(replicas: list[RunningReplica]) -> dict[str, str]:
        """Replica id -> its name on the hash ring: ``rank-N`` when every replica published a distinct
        Serve rank (``record_replica_metadata``), else its id.

        A replica that dies is replaced by one with a new id but the same rank. Keyed by id, the
        replacement's points land elsewhere on the ring and take keys from the survivors, whose caches
        hold them; keyed by rank, it takes exactly the dead replica's keys.
        """
        ranks = {r.replica_id.unique_id: r.replica_metadata.get("rank") for r in replicas}
        values = list(ranks.values())
        if values and all(isinstance(v, int) for v in values) and len(set(values)) == len(values):
            return {rid: f"rank-{rank}" for rid, rank in ranks.items()}
        return {rid: rid for rid in ranks}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hints = hints_of(pending_request)
        if pending_request is not None:
            # every replica is considered at once, so a round that found none must back off before
            # the next: without this Serve retries at once, and a replica whose queue length is not
            # known yet spins the routing loop and starves the probe that would answer it
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if hints.replica_id is not None:
            return [[by_id[hints.replica_id]]] if hints.replica_id in by_id else []
        # the ring and the decision speak of ring names (ranks); Serve and the hints of replica ids
        names = self.ring_names(list(self.curr_replicas.values()))
        for rid in by_id:
            names.setdefault(rid, rid)
        self._names = names
        usable = {names[rid]: r for rid, r in by_id.items() if rid not in hints.exclude} \
            or {names[rid]: r for rid, r in by_id.items()}
        if not usable:
            return []
        self.ring.sync(sorted(names[rid] for rid in self.replica_ids()))
        loads = {name: self.replica_queue_len_cache.get(r.replica_id) or 0 for name, r in usable.items()}
        decision = route(hints.key, loads, self.ring, self.config)
        rounds = 0
        if pending_request is not None:
            request_id = pending_request.metadata.internal_request_id
            if len(self._rounds) > 10_000:  # requests cancelled before routing never reach on_request_routed
                self._rounds.clear()
                self._decisions.clear()
            self._decisions[request_id] = decision
            rounds = self._rounds[request_id] = self._rounds.get(request_id, 0) + 1
        chosen = [usable[decision.replica_id]]
        if rounds <= self.NUM_OWNER_ONLY_ROUNDS and decision.reason != "least_loaded":
            return [chosen]  # a slow queue-length answer is no reason to give up the cached media yet
        rest = sorted((rid for rid in usable if rid != decision.replica_id), key=lambda rid: loads[rid])
        return [chosen, [usable[rid] for rid in rest]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self._rounds.pop(pending_request.metadata.internal_request_id, None)
        decision = self._decisions.pop(pending_request.metadata.internal_request_id, None)
        if decision is None:
            return
        # counted by where it went: a full owner skipped by Serve's queue check is not an affinity hit
        went = self._names.get(replica_id.unique_id, replica_id.unique_id)
        if decision.owner_id is None:
            shared.ROUTE_COUNTS.inc("least_loaded")
        elif went == decision.owner_id:
            shared.ROUTE_COUNTS.inc("affinity")
        elif decision.reason == "unavailable":
            shared.ROUTE_COUNTS.inc("unavailable")
        else:
            shared.ROUTE_COUNTS.inc("overflow")
