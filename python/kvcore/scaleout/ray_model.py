"""Ray Serve LLM's ``PrefixCacheAffinityRouter`` policy, in-process, for the cluster simulator.

The Ray router itself cannot run inside ``python -m kvcore.tools.sim``: it is a Serve
``RequestRouter`` built by a deployment handle (it needs a deployment id, the Serve controller
to register its tree actor with, and ``RunningReplica`` actors whose queue lengths it probes by
RPC in wall-clock time), and it keeps its tree in a detached Ray actor that it calls with
blocking ``ray.get``. The simulator runs in virtual time with replica cost models. So this
model drives Ray's own tree class (``PrefixTree``, the class behind that actor, used here as a
plain object) with the decision rule the router documents (ray 2.60.0,
``ray.serve.llm.request_router.PrefixCacheAffinityRouter``):

1. if the queue spread (longest - shortest) exceeds ``imbalanced_threshold`` (default
   infinity: never), power of two choices;
2. else the prompt's longest match in the tree over all replicas: if it covers at least
   ``match_rate_threshold`` (10%) of the prompt, the replicas holding it; otherwise the
   replicas with the fewest characters in the tree;
3. Serve picks the shortest queue among those (first on ties).

Every routed prompt is inserted (no eviction: Ray's default ``do_eviction=False``). Prompts
become text as the deployment's adapter does: one character per token id.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence

import numpy as np

from kvcore.scaleout.router import PowerOfTwoRouter, ReplicaId, _check


def prompt_text(tokens: Sequence[int] | np.ndarray) -> str:
    """One character per token id (``RoutedRequest.prompt`` in the deployment)."""
    return "".join(map(chr, (int(t) for t in tokens)))


class RayPrefixModel:
    """``choose``/``routed``/``remove_replica`` over Ray's ``PrefixTree`` (needs Ray)."""

    name = "ray-prefix"

    def __init__(
        self,
        *,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
        seed: int = 0,
    ):
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

        self.tree = PrefixTree()
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self._p2c = PowerOfTwoRouter(seed=seed)
        self._rng = random.Random(seed)
        self._known: set[ReplicaId] = set()

    def _sync(self, replicas) -> None:
        new = [r for r in replicas if r not in self._known]
        if new:  # Ray adds tenants as replicas appear (update_replicas)
            self.tree.add_tenants([str(r) for r in new], time.time())
            self._known.update(new)

    def choose(self, tokens: Sequence[int] | np.ndarray, loads: Mapping[ReplicaId, int]):
        _check(loads)
        self._sync(loads)
        if max(loads.values()) - min(loads.values()) > self.imbalanced_threshold:
            return self._p2c.choose(tokens, loads)
        text = prompt_text(tokens)
        by_name = {str(r): r for r in loads}
        matched, tenants = self.tree.prefix_match(text, list(by_name))
        if not text or len(matched) / len(text) < self.match_rate_threshold:
            tenants = self.tree.get_smallest_tenants()
        chosen = [by_name[t] for t in tenants or () if t in by_name]
        if not chosen:
            return self._p2c.choose(tokens, loads)
        return min(chosen, key=lambda r: loads[r])

    def routed(self, replica: ReplicaId, tokens: Sequence[int] | np.ndarray) -> None:
        """Insert the routed prompt under the replica (Ray's ``on_request_routed``)."""
        self._sync([replica])
        self.tree.insert(prompt_text(tokens), str(replica), time.time())

    def remove_replica(self, replica: ReplicaId) -> None:
        """Drop the replica's tenant (Ray's ``on_replica_actor_died``)."""
        if replica in self._known:
            self.tree.remove_tenants([str(replica)])
            self._known.discard(replica)
