"""kvcore's routers inside Ray Serve: a ``RequestRouter`` over ``kvcore.scaleout.router``.

Ray Serve calls ``choose_replicas`` for every request sent through a deployment handle; this
class asks the kvcore policy (``prefix``, ``p2c`` or ``random``) for one replica and ranks it
first, the others after it (Ray falls back to them when the first is at
``max_ongoing_requests``). Queue lengths are the requests this router sent and Ray has not yet
reported completed (``on_request_routed`` / ``on_request_completed``): the ingress is the only
caller of the engine deployment, so its count is exact. A replica that dies or leaves has its
tree dropped (``on_replica_actor_died``, ``update_replicas``).

The routed argument is a ``RoutedRequest``: its ``token_ids`` feed the prefix trees; its
``prompt`` (the same ids as text) lets Ray's own ``PrefixCacheAffinityRouter`` route the same
deployment for comparison.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from kvcore.scaleout.policies import make_router

log = logging.getLogger("kvcore.scaleout")


def _token_ids(pending: PendingRequest | None) -> list[int]:
    if pending is None:
        return []
    for arg in pending.args:
        ids = getattr(arg, "token_ids", None)
        if ids is not None:
            return list(ids)
    return []


class KvcoreRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router driven by a kvcore policy (``request_router_kwargs``:
    ``policy`` = prefix | p2c | random, ``seed``, and PrefixRouter's ``threshold``,
    ``rel_threshold``, ``tree_blocks``, ``block_size``, ``min_match``)."""

    def initialize_state(self, policy: str = "prefix", seed: int = 0, **kwargs: Any) -> None:
        self.policy = make_router(policy, seed=seed, **kwargs)
        self.inflight: dict[ReplicaID, int] = {}
        self.routed_counts: dict[ReplicaID, int] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        loads = {r.replica_id: self.inflight.get(r.replica_id, 0) for r in candidate_replicas}
        chosen = self.policy.choose(_token_ids(pending_request), loads)
        first = [r for r in candidate_replicas if r.replica_id == chosen]
        rest = sorted(
            (r for r in candidate_replicas if r.replica_id != chosen),
            key=lambda r: loads[r.replica_id],
        )
        return [first, rest] if rest else [first]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self.inflight[replica_id] = self.inflight.get(replica_id, 0) + 1
        self.routed_counts[replica_id] = self.routed_counts.get(replica_id, 0) + 1
        ids = _token_ids(pending_request)
        if ids:
            self.policy.routed(replica_id, ids)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.inflight.get(replica_id, 0) > 0:
            self.inflight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self.curr_replicas)
        super().update_replicas(replicas)
        for gone in before - set(self.curr_replicas):
            self._forget(gone)

    def _forget(self, replica_id: ReplicaID) -> None:
        log.info("router: dropping replica %s and its prefix tree", replica_id)
        self.policy.remove_replica(replica_id)
        self.inflight.pop(replica_id, None)
