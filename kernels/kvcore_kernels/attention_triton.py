"""Triton paged attention for a whole step, with split-KV (flash-decoding) and its merge.

Grid ``(num_tiles, num_kv_heads, num_splits)``. A tile is up to ``BLOCK_Q`` consecutive query
tokens of one request; its ``BLOCK_M = BLOCK_Q * QUERIES_PER_KV`` rows are those tokens times
the query heads sharing one KV head, so each K/V tile is loaded once for the whole group
(rows packed as in vLLM's unified Triton attention). Row ``m`` of a tile::

    token q_first + m // QUERIES_PER_KV,  head kv_head * QUERIES_PER_KV + m % QUERIES_PER_KV

Its keys are ``[k_start, k_end)`` (causal end of its last token, window start of its first),
walked in ``BLOCK_N`` tiles through the block table with an online softmax in log2 units. With
``num_splits > 1`` (few tiles, long contexts: a decode batch of one still fills the GPU) split
``s`` takes the ``s``-th of ``num_splits`` contiguous shares of the tile's key range and writes
its unnormalised partial (acc, max, sum); ``merge_splits_kernel`` combines them (the
flash-decoding idea of Dao et al.).

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

from kvcore_kernels.checks import check_attention_args, check_block_mass
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.schedule import (
    LOG2E,
    MAX_QUERIES_PER_KV,
    NO_WINDOW,
    SUPPORTED_HEAD_DIMS,
    work_tiles,
)
from kvcore_kernels.softmax_triton import online_softmax, tile_scores
from kvcore_kernels.splits_triton import choose_num_splits, merge_splits_kernel
from kvcore_kernels.triton_util import check_triton_device, compute_dtype, is_interpreted

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


@triton.jit(do_not_specialize=["sliding_window", "num_splits", "num_tokens", "num_released"])
def _paged_attention_kernel(
    query_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    kv_cache_ptr,  # [num_blocks, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    block_table_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    tile_req_ptr,  # [num_tiles] int32: request of each query tile
    tile_start_ptr,  # [num_tiles] int32: first query of the tile, counted within its request
    alibi_slopes_ptr,  # [num_q_heads] fp32 (read only if USE_ALIBI)
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM] (written unless SPLIT_KV)
    part_acc_ptr,  # [num_splits, num_tokens, num_q_heads, HEAD_DIM] fp32 (if SPLIT_KV)
    part_max_ptr,  # [num_splits, num_tokens, num_q_heads] fp32, log2 units
    part_sum_ptr,  # [num_splits, num_tokens, num_q_heads] fp32
    block_mass_ptr,  # [num_reqs, max_blocks] fp32, added to (read only if WITH_MASS)
    qk_scale,  # scale * log2(e)
    soft_cap,  # soft_cap * log2(e) (read only if USE_SOFTCAP)
    sliding_window,  # NO_WINDOW when off
    num_splits,  # grid axis 2; a runtime value, so split counts share one compiled kernel
    num_released,  # null entries in the step's block table: > 0 sends every tile masked
    num_tokens,
    num_q_heads,
    tune_bucket,  # unused by the body: the autotuner's key (log2 of the step's query count)
    stride_query_tok,
    stride_query_head,
    stride_cache_block,
    stride_cache_kv,
    stride_cache_slot,
    stride_cache_head,
    stride_table_req,
    stride_mass_req,
    stride_out_tok,
    stride_out_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # num_splits > 1: write partials for merge_splits_kernel
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    WITH_MASS: tl.constexpr,  # add attention mass to block_mass (needs num_splits == 1)
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    q_first = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = q_first + rows // QUERIES_PER_KV  # query index within the request
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
    q_pos = ctx + q_idx  # [BLOCK_M] position in the sequence
    tok = (q_begin + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    q = tl.load(  # [BLOCK_M, HEAD_DIM]
        query_ptr
        + tok[:, None] * stride_query_tok
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(COMPUTE_DTYPE)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634

    last_q = tl.minimum(q_first + BLOCK_Q, q_len) - 1
    k_end = ctx + last_q + 1
    k_start = tl.maximum(ctx + q_first - sliding_window + 1, 0)
    num_kv_tiles = tl.cdiv(k_end - k_start, BLOCK_N)
    per_split = tl.cdiv(num_kv_tiles, num_splits)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, num_kv_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    cache_head = kv_cache_ptr + kv_head * stride_cache_head
    table_row = block_table_ptr + req * stride_table_req
    # Tiles whose every key precedes every query row of the tile (and no window): no causal,
    # window or bounds mask (the tutorial's on-/off-diagonal split); the rest are masked.
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
    if not SPLIT_KV:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0 only on padding rows
        tl.store(
            out_ptr
            + tok[:, None] * stride_out_tok
            + head[:, None] * stride_out_head
            + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:
        part = (split * num_tokens + tok) * num_q_heads + head  # [BLOCK_M] int64
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


# Prefill / mixed steps: tiles and pipeline depth autotuned per (head dim, GQA group, BLOCK_M,
# step size bucket) on the GPU (Hopper wants deeper K/V pipelines: num_stages 3-4); the
# interpreter and decode steps launch the plain kernel with fixed choices (_block_shape).
PREFILL_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
    for bn, w, st in (
        (64, 8, 2),
        (64, 8, 3),
        (64, 4, 3),
        (64, 8, 4),
        (128, 8, 2),
        (128, 8, 3),
        (32, 4, 4),
    )
]
_paged_attention_prefill = triton.autotune(
    PREFILL_CONFIGS, key=["HEAD_DIM", "QUERIES_PER_KV", "BLOCK_M", "SPLIT_KV", "tune_bucket"]
)(_paged_attention_kernel)


def _block_shape(decode_only: bool, group: int, row_bytes: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query rows and keys per tile, smaller for wide rows (fp32, 256).

    Decode tiles hold one token's query heads (padded to the 16 rows ``tl.dot`` needs);
    mixed and prefill steps pack several tokens per tile.
    """
    narrow = row_bytes <= 256  # bf16/fp16 with head_dim <= 128
    block_n = 64 if narrow else (32 if row_bytes <= 512 else 16)
    if decode_only:
        return max(16, triton.next_power_of_2(group)), block_n
    return (128 if narrow else (64 if row_bytes <= 512 else 32)), block_n


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``paged_attention`` (same contract as ``paged_attention_torch``)."""
    shape = check_attention_args(
        query, kv_cache, meta, scale, sliding_window, soft_cap, alibi_slopes, out
    )
    check_block_mass(block_mass, meta, query.device)
    scale = float(scale)
    sliding_window = None if sliding_window is None else int(sliding_window)
    soft_cap = None if soft_cap is None else float(soft_cap)
    check_triton_device(query, _paged_attention_kernel)
    hq, hk, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    group = hq // hk
    if d not in SUPPORTED_HEAD_DIMS:
        raise KernelConfigError(f"Triton paged attention supports head_dim {SUPPORTED_HEAD_DIMS}")
    if group > MAX_QUERIES_PER_KV:
        raise KernelConfigError(
            f"Triton paged attention supports <= {MAX_QUERIES_PER_KV} query "
            f"heads per KV head, got {group}"
        )
    if out is None:
        out = torch.empty_like(query)
    if meta.num_tokens == 0:
        return out
    block_m, block_n = _block_shape(meta.max_q_len == 1, group, d * query.element_size())
    block_q = block_m // group
    tile_req, tile_start = work_tiles(meta, block_q)
    num_tiles = tile_req.shape[0]
    keys = (
        meta.max_seq_len
        if sliding_window is None
        else min(meta.max_seq_len, sliding_window + block_q)
    )
    splits = choose_num_splits(num_tiles * hk, keys, query.device, block_n)
    if block_mass is not None:
        splits = 1  # the mass pass needs each row's final max and sum
    if splits > 1:
        part_acc = torch.empty(
            (splits, meta.num_tokens, hq, d), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty(
            (splits, meta.num_tokens, hq), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched
    args = dict(
        query_ptr=query,
        kv_cache_ptr=kv_cache,
        block_table_ptr=meta.block_table,
        query_start_loc_ptr=meta.query_start_loc,
        seq_lens_ptr=meta.seq_lens,
        tile_req_ptr=tile_req,
        tile_start_ptr=tile_start,
        alibi_slopes_ptr=alibi_slopes if alibi_slopes is not None else meta.seq_lens,
        out_ptr=out,
        part_acc_ptr=part_acc,
        part_max_ptr=part_max,
        part_sum_ptr=part_sum,
        block_mass_ptr=block_mass if block_mass is not None else part_sum,
        qk_scale=scale * LOG2E,
        soft_cap=(soft_cap or 1.0) * LOG2E,
        sliding_window=sliding_window if sliding_window is not None else NO_WINDOW,
        num_tokens=meta.num_tokens,
        num_q_heads=hq,
        stride_query_tok=query.stride(0),
        stride_query_head=query.stride(1),
        stride_cache_block=kv_cache.stride(0),
        stride_cache_kv=kv_cache.stride(1),
        stride_cache_slot=kv_cache.stride(2),
        stride_cache_head=kv_cache.stride(3),
        stride_table_req=meta.block_table.stride(0),
        stride_mass_req=block_mass.stride(0) if block_mass is not None else 0,
        stride_out_tok=out.stride(0),
        stride_out_head=out.stride(1),
        BLOCK_SIZE=shape.block_size,
        HEAD_DIM=d,
        QUERIES_PER_KV=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        num_splits=splits,
        num_released=meta.num_released,
        tune_bucket=int(meta.num_tokens).bit_length(),
        SPLIT_KV=splits > 1,
        USE_SOFTCAP=soft_cap is not None,
        USE_ALIBI=alibi_slopes is not None,
        WITH_MASS=block_mass is not None,
        COMPUTE_DTYPE=compute_dtype(query.dtype, _paged_attention_kernel),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    grid = (num_tiles, hk, splits)
    # block_mass accumulates, so it never runs under the autotuner (its trials would add too).
    if meta.max_q_len == 1 or block_mass is not None or is_interpreted(_paged_attention_kernel):
        _paged_attention_kernel[grid](
            **args, BLOCK_N=block_n, num_warps=4 if block_m <= 16 else 8, num_stages=2
        )
    else:
        _paged_attention_prefill[grid](**args)
    if splits > 1:
        merge_splits_kernel[(meta.num_tokens, hq)](
            out_ptr=out,
            part_acc_ptr=part_acc,
            part_max_ptr=part_max,
            part_sum_ptr=part_sum,
            num_tokens=meta.num_tokens,
            num_q_heads=hq,
            num_splits=splits,
            num_released=meta.num_released,
            stride_out_tok=out.stride(0),
            stride_out_head=out.stride(1),
            HEAD_DIM=d,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out
