"""Type stubs for the Rust extension ``kvcore._kvcore`` (kept honest by ``mypy.stubtest``)."""

from typing import Self, final

import numpy as np
from numpy.typing import NDArray

# Every name the module exports (pyo3 builds __all__); keep in step with the binary.
__all__ = [
    "DoubleFreeError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvariantError",
    "KvCacheManager",
    "KvCoreError",
    "StaleStepError",
    "TooLongError",
    "UnknownRequestError",
    "__version__",
]

__version__: str

class KvCoreError(Exception):
    """Base class of every kvcore error."""

class InvalidArgumentError(KvCoreError):
    """A malformed argument."""

class UnknownRequestError(KvCoreError):
    """An unknown request id."""

class DuplicateRequestError(KvCoreError):
    """A request id already in use."""

class InvalidBlockError(KvCoreError):
    """A block id out of range or the null block."""

class DoubleFreeError(KvCoreError):
    """Freeing what holds no reference."""

class StaleStepError(KvCoreError):
    """An update for a step that is not outstanding."""

class TooLongError(KvCoreError):
    """An input longer than the cache or model can hold."""

class InvariantError(KvCoreError):
    """Corrupted internal state (a bug)."""

@final
class KvCacheManager:
    """Paged KV-cache bookkeeping: block pool, copy-on-write block tables and a prefix cache.

    Block 0 is the null block (pads tables). The slot of token position ``p`` of a request is
    ``table[p // block_size] * block_size + p % block_size``. Every call takes a batch: request
    ids as a 1-D ``int64``/``uint64`` array, tokens as one flat ``uint32``/``int32`` array plus
    ``int64`` offsets (request ``i`` owns ``tokens[offsets[i]:offsets[i + 1]]``). Wrong dtypes or
    shapes raise ``InvalidArgumentError``; any error leaves the manager unchanged. Running out of
    blocks is not an error: ``admit`` and ``allocate_slots`` stop at the first request that does
    not fit.

    ``prefix_mode`` is ``"radix"`` (radix tree, token-granularity hits), ``"hash"`` (chained
    xxh3-128 block hashes, block-granularity hits) or ``"off"``. Namespaces (cache salt, tenant,
    adapter id; default 0) never share hits.
    """

    def __new__(cls, num_blocks: int, block_size: int = 16, prefix_mode: str = "radix") -> Self:
        """A pool of ``num_blocks`` blocks (null block included, at least 2) of ``block_size``
        tokens (at least 1)."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def prefix_mode(self) -> str:
        """``"radix"``, ``"hash"`` or ``"off"``."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free ones plus cached blocks nobody references."""

    @property
    def num_requests(self) -> int:
        """Live requests."""

    @property
    def usage(self) -> float:
        """Fraction of the non-null blocks that are referenced."""

    def match_prefix(
        self,
        tokens: NDArray[np.uint32] | NDArray[np.int32],
        offsets: NDArray[np.int64],
        namespaces: NDArray[np.int64] | NDArray[np.uint64] | None = None,
    ) -> NDArray[np.int64]:
        """Cached prefix length of each prompt (capped at its length - 1). Counts queries in
        ``stats()``; changes nothing else."""

    def admit(
        self,
        req_ids: NDArray[np.int64] | NDArray[np.uint64],
        num_tokens: NDArray[np.int64],
        tokens: NDArray[np.uint32] | NDArray[np.int32] | None = None,
        offsets: NDArray[np.int64] | None = None,
        namespaces: NDArray[np.int64] | NDArray[np.uint64] | None = None,
        watermark_blocks: int = 0,
    ) -> NDArray[np.int64]:
        """Admits requests in order; request ``i``'s table covers ``num_tokens[i]`` tokens.

        With ``tokens``/``offsets`` (the prompts), each request first looks up its prefix
        (capped at ``min(len(prompt), num_tokens[i]) - 1``) and shares the cached blocks; a hit
        ending inside a block copies it (see ``drain_copy_ops``). Stops at the first request
        that would leave fewer than ``watermark_blocks`` free blocks. Returns the prefix-hit
        length of each admitted request: its length is the number admitted."""

    def allocate_slots(
        self, req_ids: NDArray[np.int64] | NDArray[np.uint64], num_total_tokens: NDArray[np.int64]
    ) -> int:
        """Grows each table to cover ``num_total_tokens[i]`` tokens (copy-on-write for a shared
        or cached partial last block). Stops at the first request short of blocks; returns how
        many were grown."""

    def cache_computed(
        self,
        req_ids: NDArray[np.int64] | NDArray[np.uint64],
        tokens: NDArray[np.uint32] | NDArray[np.int32],
        offsets: NDArray[np.int64],
    ) -> None:
        """Each request's span is its first tokens, all computed: their full blocks become
        cached so other requests can hit them."""

    def free(
        self,
        req_ids: NDArray[np.int64] | NDArray[np.uint64],
        tokens: NDArray[np.uint32] | NDArray[np.int32] | None = None,
        offsets: NDArray[np.int64] | None = None,
    ) -> None:
        """Releases requests; with tokens (their computed tokens) full blocks are cached first.
        Unreferenced cached blocks stay revivable until evicted (LRU, leaves first)."""

    def fork(
        self,
        parent_ids: NDArray[np.int64] | NDArray[np.uint64],
        child_ids: NDArray[np.int64] | NDArray[np.uint64],
    ) -> None:
        """Each child shares every block of its parent (parallel sampling, beam search)."""

    def block_table(self, req_id: int) -> NDArray[np.int32]:
        """One request's block ids in token order."""

    def block_tables(
        self, req_ids: NDArray[np.int64] | NDArray[np.uint64], width: int | None = None
    ) -> NDArray[np.int32]:
        """``[len(req_ids), width]`` block ids padded with the null block (0); ``width``
        defaults to the longest table."""

    def drain_copy_ops(self) -> NDArray[np.int32]:
        """Pending copy-on-write ops as ``[n, 2]`` (src, dst) block pairs; clears them. Apply
        them before the next forward pass."""

    def ref_counts(self, block_ids: NDArray[np.int64]) -> NDArray[np.int64]:
        """Ref count of each block id (``InvalidBlockError`` outside the pool)."""

    def free_queue(self) -> NDArray[np.int32]:
        """The free queue, next allocated first (debugging; O(num_blocks))."""

    def block_hash(self, block_id: int) -> int | None:
        """The 128-bit chained hash of a cached block in hash mode, else ``None``."""

    def stats(self) -> dict[str, int]:
        """Counters: queries, query_tokens, hit_tokens, evictions, cached_blocks, copy_ops,
        deduplicated_blocks."""

    def check_invariants(self) -> None:
        """Raises ``InvariantError`` if the pool, tables and cache disagree (a bug)."""

    def __contains__(self, req_id: int, /) -> bool: ...
    def __len__(self) -> int: ...
