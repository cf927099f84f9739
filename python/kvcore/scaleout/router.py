"""Request routers for replicas of the engine: prefix-aware, power-of-two choices, random.

Every router answers one question, ``choose(tokens, loads) -> replica``, where ``loads`` maps each
live replica id to its queue length (requests routed there and not finished), and is told what
it routed (``routed``) so it can learn. The simulator (``kvcore.tools.sim_cluster``) and the Ray
Serve deployment (``kvcore.scaleout.ray_router``) call the same objects.

Prefix routing keeps an approximate radix tree per replica: kvcore's own Rust prefix cache
(``KvCacheManager`` in radix mode) fed with the token ids routed to that replica. Its block pool
bounds the tree, and when it is full the least recently used leaves go first, so old prefixes
age out as they do in the replica's real cache. A request goes to the replica with the longest
match, unless that replica's queue exceeds the least loaded one's by more than ``threshold``
requests and by more than ``rel_threshold`` times; then (and when nothing matches) to the least
loaded one. The relative test keeps deep queues (10 against 7) on their prefixes: spilling there
copies a prompt's prefix to a second replica for little balance. (Idea: SGLang's cache-aware
router, its balance_abs_threshold and balance_rel_threshold.)
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from kvcore._kvcore import KvCacheManager
from kvcore.errors import InvalidArgumentError

ReplicaId = Hashable


class ReplicaTree:
    """The router's picture of one replica's prefix cache: the routed prompts, LRU-bounded."""

    def __init__(self, num_blocks: int = 4096, block_size: int = 16):
        self._cache = KvCacheManager(num_blocks, block_size, "radix")
        self._max_tokens = (num_blocks - 2) * block_size
        self._next_id = 0

    def match(self, tokens: np.ndarray) -> int:
        """Length of the longest routed prefix of ``tokens`` still in the tree."""
        if len(tokens) < 2:
            return 0
        return int(self._cache.match_prefix(tokens[: self._max_tokens])[0])

    def insert(self, tokens: np.ndarray) -> None:
        """Remember ``tokens`` as cached on this replica (evicting the oldest if full)."""
        tokens = tokens[: self._max_tokens]
        if len(tokens) == 0:
            return
        rid, self._next_id = self._next_id, self._next_id + 1
        if len(self._cache.admit(rid, len(tokens), tokens)) == 0:
            return  # every block is held: cannot happen with one request at a time
        self._cache.drain_copy_ops()  # only the bookkeeping matters here, never KV data
        self._cache.free(rid, tokens)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks of routed prefixes still in the tree."""
        return int(self._cache.stats()["cached_blocks"])


def _tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.uint32)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be 1-D, got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def _least_loaded(loads: Mapping[ReplicaId, int], rng: random.Random) -> ReplicaId:
    low = min(loads.values())
    return rng.choice([r for r, n in loads.items() if n == low])


def _check(loads: Mapping[ReplicaId, int]) -> None:
    if not loads:
        raise InvalidArgumentError("no replica to route to")


class RandomRouter:
    """Uniformly random replica (the baseline)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def choose(self, tokens: Sequence[int] | np.ndarray, loads: Mapping[ReplicaId, int]):
        _check(loads)
        return self._rng.choice(list(loads))

    def routed(self, replica: ReplicaId, tokens: Sequence[int] | np.ndarray) -> None:
        """Nothing to learn."""

    def remove_replica(self, replica: ReplicaId) -> None:
        """Nothing kept per replica."""


class PowerOfTwoRouter(RandomRouter):
    """Two random replicas, the one with the shorter queue (Ray Serve's default policy)."""

    name = "p2c"

    def choose(self, tokens: Sequence[int] | np.ndarray, loads: Mapping[ReplicaId, int]):
        _check(loads)
        if len(loads) == 1:
            return next(iter(loads))
        a, b = self._rng.sample(list(loads), 2)
        return a if loads[a] <= loads[b] else b


class PrefixRouter:
    """Longest routed-prefix match unless its queue is ``threshold`` longer than the least
    loaded replica's and over ``rel_threshold`` times as long; otherwise the least loaded.
    ``min_match`` tokens count as a match."""

    name = "prefix"

    def __init__(
        self,
        *,
        threshold: int = 4,
        rel_threshold: float = 1.5,
        tree_blocks: int = 4096,
        block_size: int = 16,
        min_match: int = 16,
        seed: int = 0,
    ):
        if threshold < 0 or tree_blocks < 3 or block_size < 1 or min_match < 1:
            raise InvalidArgumentError(
                "threshold >= 0, tree_blocks >= 3, block_size >= 1, min_match >= 1 required"
            )
        if not rel_threshold >= 1.0:  # also refuses nan
            raise InvalidArgumentError(f"rel_threshold must be >= 1, got {rel_threshold!r}")
        self.threshold, self.rel_threshold = threshold, float(rel_threshold)
        self._tree_blocks, self._block_size = tree_blocks, block_size
        self.min_match = min_match
        self.trees: dict[ReplicaId, ReplicaTree] = {}
        self._rng = random.Random(seed)
        self.num_affinity = 0  # routed to the longest match
        self.num_balanced = 0  # routed to the least loaded despite a match elsewhere

    def _tree(self, replica: ReplicaId) -> ReplicaTree:
        tree = self.trees.get(replica)
        if tree is None:
            tree = self.trees[replica] = ReplicaTree(self._tree_blocks, self._block_size)
        return tree

    def matches(self, tokens: Sequence[int] | np.ndarray, replicas) -> dict[ReplicaId, int]:
        """Routed-prefix match length of ``tokens`` on each replica."""
        arr = _tokens(tokens)
        return {r: self.trees[r].match(arr) if r in self.trees else 0 for r in replicas}

    def choose(self, tokens: Sequence[int] | np.ndarray, loads: Mapping[ReplicaId, int]):
        _check(loads)
        least = _least_loaded(loads, self._rng)
        match = self.matches(tokens, loads)
        best_len = max(match.values())
        if best_len < self.min_match:
            return least
        # Among the longest matches, the least loaded.
        best = min((r for r in loads if match[r] == best_len), key=lambda r: loads[r])
        spread = loads[best] - loads[least]
        if spread > self.threshold and loads[best] > self.rel_threshold * loads[least]:
            self.num_balanced += 1
            return least
        self.num_affinity += 1
        return best

    def routed(self, replica: ReplicaId, tokens: Sequence[int] | np.ndarray) -> None:
        """Feed the replica's tree with the prompt just routed there."""
        self._tree(replica).insert(_tokens(tokens))

    def remove_replica(self, replica: ReplicaId) -> None:
        """Drop a dead (or removed) replica's tree: a restarted replica starts cold."""
        self.trees.pop(replica, None)
