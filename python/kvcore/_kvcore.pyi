"""Type stubs for the Rust extension ``kvcore._kvcore`` (kept honest by ``mypy.stubtest``)."""

from collections.abc import Sequence
from typing import Any, Self, final

import numpy as np
from numpy.typing import NDArray

# Every name the module exports (pyo3 builds __all__); keep in step with the binary.
__all__ = [
    "DEBUG_BUILD",
    "DoubleFreeError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "InvariantError",
    "KvCacheManager",
    "KvCoreError",
    "Scheduler",
    "SchedulerStats",
    "StaleStepError",
    "StepOutput",
    "StepPlan",
    "TierPlan",
    "TooLongError",
    "UnknownRequestError",
    "__version__",
    "copy_block_rows",
    "kv_snapshot",
]

# A 1-D integer array (any integer dtype), or a sequence of Python ints.
_Ints = NDArray[np.integer] | Sequence[int]

__version__: str
DEBUG_BUILD: bool
"""True when the extension was built without optimizations (benchmarks refuse it)."""

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
    ids, counts and tokens as 1-D integer arrays (any integer dtype; contiguous ``uint32`` tokens
    are read without a copy), sequences of ints, or one int (a batch of one; for a per-request
    count or namespace, the value of every request). Tokens of several requests are one flat
    array plus offsets (request ``i`` owns ``tokens[offsets[i]:offsets[i + 1]]``); offsets may be
    left out for a batch of one. Request ids and namespaces are ints in ``0 .. 2**63 - 1``
    (as in ``Scheduler``); token ids in ``0 .. 2**32 - 1``.

    Every bad argument (type, shape, range, unknown or duplicate id) raises a ``KvCoreError``
    subclass, never ``TypeError`` or ``OverflowError``, and leaves the manager unchanged.
    Running out of blocks is not an error: ``admit`` and ``allocate_slots`` stop at the first
    request that does not fit.

    The manager remembers the tokens each request holds: its prompt (given to ``admit``) and
    every full block stated computed since. ``cache_computed`` and ``free`` must state the same
    tokens over that range (``InvalidArgumentError`` otherwise), so one request's KV is never
    published under another's tokens; only a partial last block may still change. (With
    ``prefix_mode="off"`` nothing is published and tokens are not kept.)

    Thread safety: every method may be called from any thread. Calls are serialized by a lock
    and each is atomic; a call made while another thread's call runs waits for it (heavy calls
    release the GIL while they work).

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
        tokens: int | _Ints,
        offsets: _Ints | None = None,
        namespaces: int | _Ints | None = None,
    ) -> NDArray[np.int64]:
        """Cached prefix length of each prompt (capped at its length - 1); without ``offsets``
        ``tokens`` is one prompt. Counts queries in ``stats()``; changes nothing else."""

    def admit(
        self,
        req_ids: int | _Ints,
        num_tokens: int | _Ints,
        tokens: int | _Ints | None = None,
        offsets: _Ints | None = None,
        namespaces: int | _Ints | None = None,
        watermark_blocks: int = 0,
    ) -> NDArray[np.int64]:
        """Admits requests in order; request ``i``'s table covers ``num_tokens[i]`` tokens.

        With ``tokens``/``offsets`` (the prompts), each request first looks up its prefix
        (capped at ``min(len(prompt), num_tokens[i]) - 1``) and shares the cached blocks; a hit
        ending inside a block copies it (see ``drain_copy_ops``). Stops at the first request
        that would leave fewer than ``watermark_blocks`` free blocks. Returns the prefix-hit
        length of each admitted request: its length is the number admitted. The prompt becomes
        tokens the request holds (see the class docs)."""

    def allocate_slots(self, req_ids: int | _Ints, num_total_tokens: int | _Ints) -> int:
        """Grows each table to cover ``num_total_tokens[i]`` tokens (copy-on-write for a shared
        or cached partial last block). Stops at the first request short of blocks; returns how
        many were grown."""

    def cache_computed(
        self,
        req_ids: int | _Ints,
        tokens: int | _Ints,
        offsets: _Ints | None = None,
    ) -> None:
        """Each request's span is its first tokens, all computed: their full blocks become
        cached so other requests can hit them. ``InvalidArgumentError`` (nothing cached) if a
        span is longer than the request's table or disagrees with the tokens it holds. A
        block waiting for a copy (``drain_copy_ops``) is cached by a later call."""

    def free(
        self,
        req_ids: int | _Ints,
        tokens: int | _Ints | None = None,
        offsets: _Ints | None = None,
    ) -> None:
        """Releases requests; with tokens (their computed tokens, checked as in
        ``cache_computed``) full blocks are cached first. Pending copies into a freed block
        nobody else holds are cancelled. Unreferenced cached blocks stay revivable until
        evicted (LRU, leaves first)."""

    def fork(self, parent_ids: int | _Ints, child_ids: int | _Ints) -> None:
        """Each child shares every block of its parent (parallel sampling, beam search) and
        the tokens they hold."""

    def block_table(self, req_id: int) -> NDArray[np.int32]:
        """One request's block ids in token order."""

    def block_tables(self, req_ids: int | _Ints, width: int | None = None) -> NDArray[np.int32]:
        """``[len(req_ids), width]`` block ids padded with the null block (0); ``width``
        defaults to the longest table."""

    def drain_copy_ops(self) -> NDArray[np.int32]:
        """Pending copy-on-write ops as ``[n, 2]`` (src, dst) block pairs; clears them. Apply
        them before the next forward pass."""

    def ref_counts(self, block_ids: int | _Ints) -> NDArray[np.int64]:
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

    def __contains__(self, req_id: object, /) -> bool:
        """True for a live request id; False for anything else (never raises)."""
    def __len__(self) -> int: ...

@final
class StepPlan:
    """One step's work, returned by ``Scheduler.schedule()``: flat NumPy arrays handed over from
    Rust without a copy. ``R = num_reqs`` rows (one per scheduled sequence), ``T = num_tokens``
    tokens, ``S = num_sampled`` samples.

    Rows ``[0, num_decode)`` have exactly one query token; rows ``[num_decode, R)`` more than
    one (prefill chunks). Row ``r`` computes tokens ``input_ids[query_start_loc[r]:
    query_start_loc[r + 1]]`` at consecutive positions ending at ``seq_lens[r] - 1``; the KV of
    token ``t`` goes to slot ``slot_mapping[t]`` (``block * block_size + position %
    block_size``). A row whose chunk stops short of its sequence's end samples nothing.

    Sample ``k`` reads the logits of token ``logits_indices[k]`` (the last token of row
    ``sample_rows[k]``); it is sample ``sample_seq_index[k]`` of request ``sample_req_ids[k]``.
    A request with ``n > 1`` prefills once: the step that completes its prompt lists that row's
    last token ``n`` times (sample indices ``0..n``), and ``update`` forks it into ``n``
    sequences. Pass ``update`` exactly ``S`` tokens, in this order.
    """

    @property
    def step_id(self) -> int:
        """The id to pass to ``update``."""

    @property
    def num_reqs(self) -> int:
        """Rows ``R``."""

    @property
    def num_tokens(self) -> int:
        """Tokens ``T``."""

    @property
    def num_decode(self) -> int:
        """Rows with one query token (they come first)."""

    @property
    def num_prefill(self) -> int:
        """Rows with more than one query token."""

    @property
    def num_sampled(self) -> int:
        """Samples ``S``: the length of the array ``update`` expects."""

    @property
    def max_query_len(self) -> int:
        """Longest query of the step."""

    @property
    def max_seq_len(self) -> int:
        """Largest ``seq_lens`` entry."""

    @property
    def req_ids(self) -> NDArray[np.int64]:
        """``[R]`` request id of each row."""

    @property
    def seq_index(self) -> NDArray[np.int32]:
        """``[R]`` which of its request's ``n`` samples each row is (0 before the fork)."""

    @property
    def input_ids(self) -> NDArray[np.int64]:
        """``[T]`` token ids to compute, row after row."""

    @property
    def positions(self) -> NDArray[np.int64]:
        """``[T]`` position of each token in its sequence."""

    @property
    def slot_mapping(self) -> NDArray[np.int64]:
        """``[T]`` KV-cache slot each token's key and value are written to."""

    @property
    def query_start_loc(self) -> NDArray[np.int32]:
        """``[R + 1]`` offsets of each row's tokens (cu_seqlens of the queries)."""

    @property
    def seq_lens(self) -> NDArray[np.int32]:
        """``[R]`` context length of each row, this step's tokens included."""

    @property
    def block_table(self) -> NDArray[np.int32]:
        """``[R, max_blocks]`` block ids of each row (those covering ``seq_lens``), padded with
        the null block 0; ``max_blocks`` is the largest ``ceil(seq_lens / block_size)``."""

    @property
    def group_block_table(self) -> NDArray[np.int32]:
        """``[G - 1, num_reqs, max_blocks]`` block tables of the extra KV cache groups
        (``group_windows``), laid out like ``block_table``; ``G - 1 = 0`` without groups."""

    @property
    def group_slot_mapping(self) -> NDArray[np.int64]:
        """``[G - 1, num_tokens]`` each token's slot in each extra group's table."""

    @property
    def copy_ops(self) -> NDArray[np.int32]:
        """``[n, 2]`` (src, dst) block pairs to copy, in order, before the forward
        (copy-on-write of shared partial blocks)."""

    @property
    def tier_offload(self) -> NDArray[np.int32]:
        """``[n, 2]`` (L1 block, L2 slot) copies to apply before ``tier_load`` and ``copy_ops``
        (write-back of evicted cached blocks, swap-out of preempted sequences)."""

    @property
    def tier_load(self) -> NDArray[np.int32]:
        """``[m, 2]`` (L2 slot, L1 block) copies to apply after ``tier_offload``, before
        ``copy_ops`` (prefix hits in L2, swap-ins)."""

    @property
    def tier_io(self) -> TierPlan:
        """Keys, token ids and fetch lists of this step's tier moves."""

    @property
    def logits_indices(self) -> NDArray[np.int64]:
        """``[S]`` index into the ``T`` tokens of each sampled logits row."""

    @property
    def sample_rows(self) -> NDArray[np.int32]:
        """``[S]`` plan row of each sample."""

    @property
    def sample_req_ids(self) -> NDArray[np.int64]:
        """``[S]`` request id of each sample (to find its sampling parameters)."""

    @property
    def sample_seq_index(self) -> NDArray[np.int32]:
        """``[S]`` sample index (``0..n``) within its request of each sample."""

@final
class TierPlan:
    """The I/O half of a step's tier moves (the copies are ``StepPlan.tier_offload`` /
    ``tier_load``). Keys are chained SHA-256 block keys (32 bytes); ``bs`` is the block size.
    Apply order: gather ``publish`` blocks, ``tier_offload``, ``tier_load``, ``copy_ops``."""

    @property
    def offload_kind(self) -> NDArray[np.uint8]:
        """``[n]`` 1: a cached block written back on eviction; 2: a swapped-out block."""

    @property
    def offload_keys(self) -> NDArray[np.uint8]:
        """``[n, 32]`` key of each offload (zeros for swaps)."""

    @property
    def offload_tokens(self) -> NDArray[np.int32]:
        """``[n, bs]`` token ids of each offload (zeros for swaps)."""

    @property
    def publish(self) -> NDArray[np.int32]:
        """``[p]`` newly cached L1 blocks to write through to L3/L4."""

    @property
    def publish_keys(self) -> NDArray[np.uint8]:
        """``[p, 32]`` their keys."""

    @property
    def publish_tokens(self) -> NDArray[np.int32]:
        """``[p, bs]`` their token ids."""

    @property
    def fetch_seqs(self) -> NDArray[np.int64]:
        """``[r]`` ids of waiting sequences that want blocks from L3/L4 (pass back to
        ``Scheduler.tier_fetched``)."""

    @property
    def fetch_offsets(self) -> NDArray[np.int32]:
        """``[r + 1]`` offsets of each sequence's keys in ``fetch_keys``."""

    @property
    def fetch_keys(self) -> NDArray[np.uint8]:
        """``[k, 32]`` keys to fetch, in chain order (only a leading run is useful)."""

    @property
    def fetch_tokens(self) -> NDArray[np.int32]:
        """``[k, bs]`` token ids of ``fetch_keys`` (compare with what a value stores)."""

@final
class StepOutput:
    """Finished samples (from ``update`` or ``abort_requests``), ``F = num_finished`` entries.

    Entry ``i`` is sample ``seq_index[i]`` of request ``req_ids[i]``; its output tokens are
    ``token_ids[token_offsets[i]:token_offsets[i + 1]]`` (a stop token is included as the
    last one). ``request_done[i]`` is true on the request's last unfinished sample: its id may
    be reused from then on.
    """

    @property
    def num_finished(self) -> int:
        """Entries ``F``."""

    @property
    def req_ids(self) -> NDArray[np.int64]:
        """``[F]`` request ids."""

    @property
    def seq_index(self) -> NDArray[np.int32]:
        """``[F]`` sample index within the request."""

    @property
    def finish_reasons(self) -> tuple[str, ...]:
        """``F`` reasons: ``"length"`` (max_tokens or max_model_len), ``"stop"`` (EOS or a stop
        token id) or ``"abort"``."""

    @property
    def request_done(self) -> NDArray[np.bool_]:
        """``[F]`` true where the request has no unfinished sample left."""

    @property
    def token_offsets(self) -> NDArray[np.int64]:
        """``[F + 1]`` offsets into ``token_ids``."""

    @property
    def token_ids(self) -> NDArray[np.int64]:
        """All output tokens, entry after entry."""

    @property
    def peak_blocks(self) -> NDArray[np.int64]:
        """``[F]`` most KV blocks the sample held at once (retention bounds it)."""

    def outputs(self) -> list[tuple[int, int, str, list[int]]]:
        """``[(req_id, seq_index, finish_reason, token_ids)]`` (convenience, builds lists)."""

    def __len__(self) -> int: ...

@final
class SchedulerStats:
    """A snapshot of the scheduler's gauges and counters."""

    @property
    def num_running(self) -> int:
        """Running sequences."""

    @property
    def num_waiting(self) -> int:
        """Waiting sequences (new and preempted)."""

    @property
    def num_requests(self) -> int:
        """Unfinished requests."""

    @property
    def kv_usage(self) -> float:
        """Fraction of the non-null blocks referenced."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free plus evictable cached)."""

    @property
    def prefix_queries(self) -> int:
        """Prefix-cache lookups (one per admission attempt)."""

    @property
    def prefix_query_tokens(self) -> int:
        """Tokens looked up."""

    @property
    def prefix_hit_tokens(self) -> int:
        """Tokens found cached (never recomputed)."""

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start."""

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens scheduled by the last ``schedule()``."""

    @property
    def num_computed_tokens(self) -> int:
        """Computed tokens summed over running sequences."""

    @property
    def num_steps(self) -> int:
        """Steps scheduled since start."""

    @property
    def num_finished(self) -> int:
        """Samples finished since start (aborted ones included)."""

    @property
    def num_released_blocks(self) -> int:
        """Blocks released by retention (sliding windows, lossy policies) since start."""

    @property
    def peak_seq_blocks(self) -> int:
        """Most blocks any one sequence held at once since start."""

@final
class Scheduler:
    """The continuous-batching scheduler over a paged KV cache (Rust).

    Each step: ``plan = schedule()``, run the model on the plan, then ``update(plan.step_id,
    sampled)`` with one token per sample; two calls whatever the batch size. Every sequence has
    a number of computed tokens that catches up with its length within the step's token budget:
    decodes first, then prefill chunks of running sequences, then admission of waiting ones
    (prefix-cache hits count as computed; the head is admitted only if its first chunk fits with
    ``watermark`` of the pool kept free). When a running sequence cannot get a block, the least
    important running sequence is preempted (its blocks freed, full ones kept in the prefix
    cache) and recomputed later with its output kept, so outputs never change.

    Order of service: ``"fcfs"`` by arrival; ``"priority"`` by ``priority`` (smaller first),
    then arrival. Preemption takes the last in that order. A request with ``n > 1`` takes ``n``
    of the ``max_num_seqs`` slots from admission on. Every ``schedule()`` must be followed by
    ``update()`` for its step (an empty plan too). Errors are ``KvCoreError`` subclasses and
    change nothing; a bad configuration or argument of any type raises
    ``InvalidArgumentError`` (never ``TypeError`` or ``OverflowError``). Request ids and
    namespaces are ints in ``0 .. 2**63 - 1``, as in ``KvCacheManager``.

    Thread safety: every method may be called from any thread (for example ``add_requests`` or
    ``abort_requests`` while another thread steps). Calls are serialized by a lock and each is
    atomic; a call made while another runs waits for it (``schedule`` and ``update`` release
    the GIL while they work).
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        prefix_mode: str = "radix",
        policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        watermark: float = 0.01,
        eos_token_id: int | None = None,
        enable_chunked_prefill: bool = True,
        host_blocks: int = 0,
        tier_fetch: bool = False,
        tier_publish: bool = False,
        tier_root: bytes | None = None,
        bytes_per_block: int = 1,
        preemption: str = "recompute",
        sliding_window: int = 0,
        group_windows: _Ints | None = None,
    ) -> Self:
        """``num_blocks`` includes the null block; ``prefix_mode`` is ``"radix"``, ``"hash"``
        (xxh3-128), ``"hash_sha256"`` or ``"off"`` (hash modes compare token ids on a match);
        ``long_prefill_token_threshold`` caps a sequence's prefill chunk per step (0: no cap);
        ``watermark`` is the fraction of blocks admission keeps free;
        ``enable_chunked_prefill=False`` computes each prompt in one step (the budget must
        hold ``max_model_len`` tokens).

        Tiers (``host_blocks > 0``): an L2 of that many host slots takes evicted cached blocks
        (``StepPlan.tier_offload``) and serves prefix hits (``tier_load``); ``tier_fetch`` makes
        waiting sequences ask L3/L4 for missing blocks (``TierPlan.fetch_*``, answered with
        ``tier_fetched``); ``tier_publish`` writes newly cached blocks through (``TierPlan.
        publish``); ``tier_root`` (32 bytes) roots the key chain; ``preemption`` is
        ``"recompute"``, ``"swap"`` or ``"auto"`` (swap when ``bytes_per_block`` times the blocks
        over the measured copy bandwidth costs less than recomputing the computed tokens).

        ``sliding_window`` (tokens; 0: off) is the window of *every* attention layer: blocks
        wholly behind it are released as sequences grow (exact), and their block-table entries
        become the null block 0 (positions stay logical; see docs/retention.md).
        ``group_windows`` (tokens; 0: full attention) adds one KV cache group per entry for hybrid
        models: every sequence gets one more block table per group, released behind that window
        (``StepPlan.group_block_table``), while ``block_table`` (group 0, the global layers)
        follows ``sliding_window``; groups need ``prefix_mode="off"`` and no tiers."""

    def add_requests(
        self,
        req_ids: int | _Ints,
        prompt_token_ids: int | _Ints,
        prompt_offsets: _Ints,
        max_tokens: int | _Ints,
        *,
        priorities: int | _Ints | None = None,
        namespaces: int | _Ints | None = None,
        n: int | _Ints | None = None,
        ignore_eos: bool | Sequence[bool] | NDArray[np.bool_] | None = None,
        stop_token_ids: _Ints | None = None,
        stop_offsets: _Ints | None = None,
        retention_sink: int | _Ints | None = None,
        retention_window: int | _Ints | None = None,
    ) -> None:
        """Adds ``R = len(req_ids)`` requests in order, all or none. Request ``i``'s prompt is
        ``prompt_token_ids[prompt_offsets[i]:prompt_offsets[i + 1]]`` (``prompt_offsets`` has
        ``R + 1`` entries from 0), its stop ids likewise with ``stop_offsets``. Scalars apply to
        every request. ``DuplicateRequestError`` for an id in use; ``TooLongError`` for a prompt
        of ``max_model_len`` tokens or more, or a request whose longest run cannot fit in the
        pool; ``InvalidArgumentError`` for empty prompts, zero ``max_tokens`` or ``n``, ``n >
        max_num_seqs``, bad shapes or values.

        ``retention_window > 0`` (blocks) gives a request a lossy policy: it keeps its first
        ``retention_sink`` blocks and the ``retention_window`` full blocks before the block
        being written, releases the rest as it grows (null entries in its block-table rows) and
        publishes nothing to the prefix cache after its first drop. 0 (default): keep all."""

    def add_request(
        self,
        req_id: int,
        prompt_token_ids: _Ints,
        max_tokens: int,
        *,
        priority: int = 0,
        namespace: int = 0,
        n: int = 1,
        ignore_eos: bool = False,
        stop_token_ids: _Ints | None = None,
        retention_sink: int = 0,
        retention_window: int = 0,
    ) -> None:
        """Adds one request (``add_requests`` for one)."""

    def abort_requests(self, req_ids: int | _Ints) -> StepOutput:
        """Aborts requests (``UnknownRequestError`` if any id is not unfinished; then none is
        aborted). Also between ``schedule`` and ``update``: the aborted rows' samples are then
        ignored. Returns one ``"abort"`` entry per unfinished sample, with its output so far."""

    def schedule(self) -> StepPlan:
        """Plans the next step (``InvalidArgumentError`` while a step awaits ``update``)."""

    def update(
        self,
        step_id: int,
        sampled_token_ids: NDArray[np.int32] | NDArray[np.int64],
        drop_blocks: _Ints | None = None,
    ) -> StepOutput:
        """Appends ``sampled_token_ids[k]`` (1-D ``int32``/``int64``, length ``num_sampled``)
        to sample ``k`` of the plan, applies the stop rules (stop ids, EOS unless ignored,
        ``max_tokens``, ``max_model_len``) and returns the finished samples. ``StaleStepError``
        for a step that is not outstanding (stale or repeated); ``InvalidArgumentError`` for a
        wrong length, dtype or token id.

        ``drop_blocks`` (a caller-side policy such as H2O): flat ``(plan row, logical block)``
        pairs; each must be a full block its row's sequence computed before this step, else
        ``InvalidArgumentError`` and nothing changes. The blocks are released after the tokens
        are applied, in every KV cache group, as a lossy drop (the sequence publishes nothing to
        the prefix cache from then on); rows that finished or were aborted are skipped."""

    def stats(self) -> SchedulerStats:
        """Gauges and counters now."""

    def check_invariants(self) -> None:
        """Raises ``InvariantError`` if the scheduler or KV manager state is inconsistent."""

    def tier_fetched(
        self, kv_ids: _Ints, counts: _Ints
    ) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Reports finished fetches: the first ``counts[i]`` blocks of sequence ``kv_ids[i]``
        arrived (0: a miss). Returns ``(offsets [r + 1], slots)``: the L2 slots to write sequence
        ``i``'s blocks into, in order, ``-1`` for a block L2 already holds."""

    def set_tier_costs(self, copy_bytes_per_s: float, seconds_per_token: float) -> None:
        """Updates the swap cost model's measurements (ignored unless finite and > 0)."""

    def tier_stats(self) -> dict[str, int]:
        """Tier counters: l1_hit_tokens, l2_hit_tokens, offloaded_blocks, offload_dropped,
        loaded_blocks, swap_outs, swap_ins, published_blocks, fetch_requests, fetched_blocks,
        host_evictions, num_fetching; and l2_entries, the prefix-cache entries (radix nodes'
        blocks or hash entries) that name an L2 slot now."""

    def has_unfinished(self) -> bool:
        """True while some request is unfinished."""

    def bench_step(self, token_id: int) -> tuple[int, int]:
        """Benchmarks only: ``schedule()`` + ``update()`` in Rust with every sample =
        ``token_id`` and no NumPy arrays; returns (nanoseconds, samples finished)."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""

    @property
    def max_num_batched_tokens(self) -> int:
        """Token budget per step."""

    @property
    def max_num_seqs(self) -> int:
        """Most running sequences."""

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) per sequence."""

    @property
    def prefix_mode(self) -> str:
        """``"radix"``, ``"hash"`` or ``"off"``."""

    @property
    def policy(self) -> str:
        """``"fcfs"`` or ``"priority"``."""

    @property
    def eos_token_id(self) -> int | None:
        """The EOS token id, if any."""

    @property
    def sliding_window(self) -> int:
        """The model-wide sliding window whose blocks are released (0: none)."""

    @property
    def group_windows(self) -> list[int]:
        """Windows of the extra KV cache groups (empty: one group)."""

    @property
    def outstanding_step(self) -> int | None:
        """The step awaiting ``update``, if any."""

def copy_block_rows(
    dst: Sequence[NDArray[np.uint8]],
    src: Sequence[NDArray[np.uint8]],
    pairs: NDArray[np.int32] | NDArray[np.int64],
    threads: int = 1,
) -> None:
    """Copies row ``pairs[i, 0]`` of ``src[l]`` to row ``pairs[i, 1]`` of ``dst[l]`` for every
    pair and layer ``l``, one pass per row with the GIL released, over up to ``threads``
    threads (by layer). ``dst``/``src``: one C-contiguous 2-D ``uint8`` array per layer, the
    same row width per layer pair (NumPy views of the pool's and the host tier's tensors).
    Raises ``InvalidArgumentError`` (nothing copied) on a layer count or row width mismatch,
    an index out of range, a non-contiguous or aliased array."""

def kv_snapshot(scheduler: Scheduler) -> dict[str, Any]:
    """One read-only picture of ``scheduler``'s KV state, taken under its lock in one call
    (O(blocks + table entries); the live dashboard's only call, ``kvcore.engine.inspect``).
    Keys: ``ref_counts`` (uint32 [num_blocks], null block included), ``cached`` (uint8
    [num_blocks], 1 = in the prefix cache), ``kv_ids`` (uint64 [R]: the KV tables, one per
    sequence and KV group, sorted), ``req_ids`` (uint64 [R]: each table's request id, the
    caller's), ``namespaces`` / ``num_tokens`` / ``num_released`` (uint64 [R]: prefix-cache
    namespace, tokens the table covers, entries released by retention), ``offsets`` (uint64
    [R + 1]) and ``blocks`` (uint32: table ``i`` is ``blocks[offsets[i]:offsets[i + 1]]``, released
    entries as the null block), ``num_l2_entries`` (int: blocks in the host tier) and
    ``stats`` (the ``SchedulerStats`` of the same instant)."""
