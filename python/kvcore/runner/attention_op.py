"""kvcore's attention as one torch custom op: ``torch.ops.kvcore.paged_attention``.

``torch.compile`` traces the model around it and leaves the cache write and the paged attention
opaque (one node per layer); a CUDA graph captures whatever it launches. Everything the op reads
goes in as tensors, none as Python objects::

    query [T, Hq, D], key/value [T, Hk, D]       this step's packed tokens (any unit-stride view)
    kv_cache [num_blocks, 2, bs, Hk, D]         mutated: the step's K/V are stored first
    slot_mapping int64 [T]                      slot < bs (the null block): not stored
    query_start_loc int32 [R + 1], seq_lens int32 [R], block_table int32 [R, W]
    -> out [T, Hq, D] (contiguous, query's dtype)

The kernels want the step's host-side layout (``AttentionMetadata``: the Triton work list, the
torch twin's gather chunks), planned once per step and shared by every layer. The op finds that
plan with ``attach_plan``: the runner attaches it to the ``seq_lens`` tensor it passes, stamped
with the tensor's version, and the op reuses it when given the same tensor unchanged. Anything
else (another tensor, a tensor written since) is planned afresh from the tensors themselves, so a
missing plan costs time, never correctness.

Quantized caches (``kvcore_kernels.quant.QuantKVCache``) are Python objects with host-side state
(FP8 calibration, KIVI's residual bookkeeping) and are not ops' arguments: they stay on the eager
path (``kvcore.runner.attention``).
"""

from __future__ import annotations

from typing import Any

import kvcore_kernels
import torch

_PLAN_ATTR = "_kvcore_plan"


def _stamp(t: torch.Tensor) -> int:
    """The tensor's version (bumped by every in-place write); inference tensors have none and
    are never written after the runner makes them, so 0 stands for them."""
    try:
        return int(t._version)
    except RuntimeError:
        return 0


def attach_plan(seq_lens: torch.Tensor, meta: Any) -> None:
    """Let the op reuse ``meta`` (planned from these tensors) while ``seq_lens`` is unchanged."""
    setattr(seq_lens, _PLAN_ATTR, (_stamp(seq_lens), meta))


def plan_for(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> Any:
    """The step's ``AttentionMetadata``: the attached plan if still valid, else planned now."""
    found = getattr(seq_lens, _PLAN_ATTR, None)
    if found is not None and found[0] == _stamp(seq_lens):
        meta = found[1]
        if meta.block_size == block_size and meta.num_reqs == seq_lens.shape[0]:
            PLAN_STATS["hits"] += 1
            return meta
    PLAN_STATS["misses"] += 1
    meta = kvcore_kernels.plan_attention(
        query_start_loc, seq_lens, block_table, block_size, device=seq_lens.device
    )
    attach_plan(seq_lens, meta)
    return meta


PLAN_STATS = {"hits": 0, "misses": 0}  # counters for tests and the benchmark, not state


@torch.library.custom_op("kvcore::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int,
    soft_cap: float,
    backend: str,
) -> torch.Tensor:
    """Store this step's K/V, then paged attention (``sliding_window``/``soft_cap`` 0: off)."""
    meta = plan_for(query_start_loc, seq_lens, block_table, kv_cache.shape[2])
    kvcore_kernels.store_kv(key, value, kv_cache, slot_mapping, backend=backend)
    out = query.new_empty(query.shape)
    kvcore_kernels.paged_attention(
        query,
        kv_cache,
        meta,
        scale=scale,
        sliding_window=sliding_window or None,
        soft_cap=soft_cap or None,
        out=out,
        backend=backend,
    )
    return out


@paged_attention_op.register_fake
def _(
    query, key, value, kv_cache, slot_mapping, query_start_loc, seq_lens, block_table,
    scale, sliding_window, soft_cap, backend,
):  # fmt: skip
    return query.new_empty(query.shape)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Call the op (None for the optional features, as the kernels take them)."""
    return torch.ops.kvcore.paged_attention(
        query,
        key,
        value,
        kv_cache,
        slot_mapping,
        query_start_loc,
        seq_lens,
        block_table,
        float(scale),
        int(sliding_window or 0),
        float(soft_cap or 0.0),
        backend,
    )
