"""Triton paged attention over a plain cache: the K/V loop ``paged_triton``'s kernel runs.

The skeleton (query tile, splits, output) is ``paged_triton.paged_attention_kernel``; this
module gives it ``plain_kv_loop``, the walk over the model-dtype cache
``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` in ``BLOCK_N``-key tiles through the
block table, with an online softmax in log2 units. Tiles whose every key precedes every query
row of the tile (no window, no released block) run without the causal / window / bounds mask
and with unmasked loads (the tutorial's on-/off-diagonal split); the rest are masked.

Released blocks (null block-table entries, ``plan`` module doc): with any in the step, every
tile takes the masked path, whose key mask also drops keys of null entries (never loaded,
weight 0); a step without them runs exactly as before. ``block_mass`` (H2O): after the online
softmax a second pass over the keys recomputes each score, normalises it with the row's final
max and sum and atomically adds the per-key sums over the tile's rows (query tokens x heads) at
``block_mass[request, key // block_size]``; it needs the final max and sum, so it runs without
splits (one program sees a row's whole key range).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_kernels.checks import check_attention_call
from kvcore_kernels.paged_triton import plan_launch, split_tiles
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.schedule import NO_WINDOW
from kvcore_kernels.softmax_triton import online_softmax, tile_scores

NO_WINDOW_C = tl.constexpr(NO_WINDOW)


@triton.jit
def _tile_step(
    acc,  # [BLOCK_M, HEAD_DIM] fp32 running output
    m_i,  # [BLOCK_M] running max (log2 units)
    l_i,  # [BLOCK_M] running sum
    q,  # [BLOCK_M, HEAD_DIM] COMPUTE_DTYPE
    q_pos,  # [BLOCK_M] position of each row's token
    slope,  # [BLOCK_M] ALiBi slope * log2(e) (if USE_ALIBI)
    cache_head,  # pointer: the cache at this KV head
    table_row,  # pointer: this request's block table row
    first_key,  # position of the tile's first key
    k_end,
    qk_scale,
    soft_cap,
    sliding_window,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One ``BLOCK_N``-key tile of the online softmax: returns the updated (acc, m_i, l_i)."""
    keys = first_key + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
    dims = tl.arange(0, HEAD_DIM)
    key_ok = keys < k_end
    if MASKED:
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        key_ok = key_ok & (block != 0)  # released blocks: never loaded, weight 0
    else:
        block = tl.load(table_row + keys // BLOCK_SIZE).to(tl.int64)
    kv_offset = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
    kv_ptrs = cache_head + kv_offset[:, None] + dims[None, :]  # [BLOCK_N, HEAD_DIM]
    if MASKED:
        k = tl.load(kv_ptrs, mask=key_ok[:, None], other=0.0).to(COMPUTE_DTYPE)
        v = tl.load(kv_ptrs + stride_cache_kv, mask=key_ok[:, None], other=0.0).to(COMPUTE_DTYPE)
    else:
        k = tl.load(kv_ptrs).to(COMPUTE_DTYPE)
        v = tl.load(kv_ptrs + stride_cache_kv).to(COMPUTE_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    s = tile_scores(
        s, keys, key_ok, q_pos, slope, soft_cap, sliding_window, MASKED, USE_SOFTCAP, USE_ALIBI
    )
    p, m_new, l_i, acc = online_softmax(s, m_i, l_i, acc)
    acc = acc + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _mass_pass(
    m_i,  # [BLOCK_M] final running max (log2 units)
    l_i,  # [BLOCK_M] final running sum
    q,  # [BLOCK_M, HEAD_DIM]
    q_pos,
    slope,
    row_ok,  # [BLOCK_M] real rows (padding rows add nothing)
    cache_head,
    table_row,
    mass_row,  # pointer: block_mass at this request's row, fp32
    k_start,
    k_end,
    t_begin,
    t_end,
    qk_scale,
    soft_cap,
    sliding_window,
    stride_cache_block,
    stride_cache_slot,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Add each key's normalised probability, summed over the tile's rows, to its block."""
    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    dims = tl.arange(0, HEAD_DIM)
    for t in range(t_begin, t_end):
        keys = k_start + t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_ok = keys < k_end
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        key_ok = key_ok & (block != 0)
        kv_offset = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
        k = tl.load(
            cache_head + kv_offset[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0
        ).to(COMPUTE_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tile_scores(
            s, keys, key_ok, q_pos, slope, soft_cap, sliding_window, True, USE_SOFTCAP, USE_ALIBI
        )
        p = tl.exp2(s - m_safe[:, None]) * inv_l[:, None]  # [BLOCK_M, BLOCK_N]
        p = tl.where(row_ok[:, None], p, 0.0)
        tl.atomic_add(mass_row + keys // BLOCK_SIZE, tl.sum(p, 0), mask=key_ok)


@triton.jit
def plain_kv_loop(
    acc, m_i, l_i, q, q_pos, slope, row_ok, req, kv_head, split, num_splits, ctx, q_first,
    k_start, k_end, table_row, qk_scale, soft_cap, sliding_window, num_released,
    cache,  # (kv_cache_ptr, 4 cache strides (block, kv, slot, head), block_mass_ptr, its stride)
    CACHE: tl.constexpr,  # (WITH_MASS,): add attention mass to block_mass (no splits then)
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_ALIBI: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The plain cache's ``KV_LOOP`` (``paged_triton``): returns the updated (acc, m_i, l_i)."""
    (
        kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
        stride_cache_block,
        stride_cache_kv,
        stride_cache_slot,
        stride_cache_head,
        block_mass_ptr,  # [num_reqs, max_blocks] fp32, added to (read only if WITH_MASS)
        stride_mass_req,
    ) = cache
    WITH_MASS: tl.constexpr = CACHE[0]
    t_begin, t_end = split_tiles(tl.cdiv(k_end - k_start, BLOCK_N), split, num_splits)
    cache_head = kv_cache_ptr + kv_head * stride_cache_head
    no_mask = (sliding_window >= NO_WINDOW_C) & (num_released == 0)
    n_full = tl.where(no_mask, (ctx + q_first - k_start + 1) // BLOCK_N, 0)
    for t in range(t_begin, tl.minimum(t_end, n_full)):
        acc, m_i, l_i = _tile_step(
            acc, m_i, l_i, q, q_pos, slope, cache_head, table_row, k_start + t * BLOCK_N, k_end,
            qk_scale, soft_cap, sliding_window, stride_cache_block, stride_cache_kv,
            stride_cache_slot, BLOCK_SIZE, HEAD_DIM, BLOCK_N, False, USE_SOFTCAP, USE_ALIBI,
            COMPUTE_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    for t in range(tl.maximum(t_begin, n_full), t_end):
        acc, m_i, l_i = _tile_step(
            acc, m_i, l_i, q, q_pos, slope, cache_head, table_row, k_start + t * BLOCK_N, k_end,
            qk_scale, soft_cap, sliding_window, stride_cache_block, stride_cache_kv,
            stride_cache_slot, BLOCK_SIZE, HEAD_DIM, BLOCK_N, True, USE_SOFTCAP, USE_ALIBI,
            COMPUTE_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    if WITH_MASS:
        _mass_pass(
            m_i, l_i, q, q_pos, slope, row_ok, cache_head, table_row,
            block_mass_ptr + req * stride_mass_req, k_start, k_end, t_begin, t_end, qk_scale,
            soft_cap, sliding_window, stride_cache_block, stride_cache_slot, BLOCK_SIZE,
            HEAD_DIM, BLOCK_N, USE_SOFTCAP, USE_ALIBI, COMPUTE_DTYPE, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


def paged_attention_triton(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, **options
) -> torch.Tensor:
    """Triton ``paged_attention`` over a plain cache: ``options`` are that function's keywords
    (``scale``, ``sliding_window``, ``soft_cap``, ``alibi_slopes``, ``out``, ``block_mass``);
    same contract as ``paged_attention_torch``."""
    call = check_attention_call(query, kv_cache, meta, options)
    launch = plan_launch(query, meta, call)
    mass = call.block_mass
    cache = (
        kv_cache, *kv_cache.stride()[:4],
        mass if mass is not None else call.out, mass.stride(0) if mass is not None else 0,
    )  # fmt: skip
    return launch.run(plain_kv_loop, cache, (mass is not None,), autotune=True)
