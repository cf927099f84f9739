"""Triton MLA kernels: the latent store and absorbed-form attention over the paged latent cache.

Backend layer: imports ``mla.cache`` (layout, checks, absorb/unabsorb), ``plan``, ``schedule``,
``softmax_triton`` and ``triton_util``; never the dispatcher. Attention grid ``(num_tiles,
num_head_tiles)``: a tile is up to ``BLOCK_Q`` consecutive query tokens of one request times
``BLOCK_H`` heads; every head shares the one latent "KV head", so each latent tile is loaded
once for all the tile's rows (MQA packing, as in the plain kernel). Row ``m`` of a tile::

    token q_first + m // BLOCK_H,   head head_tile * BLOCK_H + m % BLOCK_H

Per key tile: scores = ``q_lat . c_kv + q_pe . k_pe`` (two dots, so ``r`` and ``rope`` need not
sum to a power of two), an online softmax in log2 units, and ``acc += p . c_kv``: the latent
is the value. ``W_uk`` is folded into the query before the kernel and ``W_uv`` applied to its
latent output after it (two batched matmuls per layer): no per-head K or V is built.
Not yet here: split-KV for long decodes at tiny batch (the plain kernel's flash-decoding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.mla.cache import (
    absorb_query,
    check_mla_args,
    check_store_latent_args,
    unabsorb_output,
)
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.schedule import LOG2E, work_tiles
from kvcore_kernels.softmax_triton import online_softmax
from kvcore_kernels.triton_util import check_dense_metadata, check_triton_device, compute_dtype

MIN_ROWS = 16  # tl.dot wants at least 16 rows


@triton.jit
def _store_latent_kernel(
    c_kv_ptr,  # [num_tokens, R]
    k_pe_ptr,  # [num_tokens, ROPE]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, R + ROPE]
    slot_ptr,  # [num_tokens] int32/int64
    stride_c_tok,
    stride_pe_tok,
    stride_cache_block,
    stride_cache_slot,
    R: tl.constexpr,
    ROPE: tl.constexpr,
    R_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= BLOCK_SIZE:  # null block and negative (padding) slots are skipped
        row = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block
        row += (slot % BLOCK_SIZE) * stride_cache_slot
        dc = tl.arange(0, R_PAD)
        tl.store(row + dc, tl.load(c_kv_ptr + tok * stride_c_tok + dc, mask=dc < R), mask=dc < R)
        dr = tl.arange(0, ROPE_PAD)
        pe = tl.load(k_pe_ptr + tok * stride_pe_tok + dr, mask=dr < ROPE)
        tl.store(row + R + dr, pe, mask=dr < ROPE)


@triton.jit(do_not_specialize=["num_heads"])
def _mla_decode_kernel(
    q_ptr,  # [num_tokens, num_heads, R + ROPE]: [q_nope W_uk | q_pe]
    cache_ptr,  # [num_blocks, BLOCK_SIZE, R + ROPE]
    block_table_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    tile_req_ptr,  # [num_tiles] int32
    tile_start_ptr,  # [num_tiles] int32: first query of the tile within its request
    out_ptr,  # [num_tokens, num_heads, R]: attention-weighted latent
    qk_scale,  # scale * log2(e)
    num_heads,
    stride_q_tok,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_table_req,
    stride_out_tok,
    stride_out_head,
    R: tl.constexpr,
    ROPE: tl.constexpr,
    R_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head_tile = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q_first = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    ctx = tl.load(seq_lens_ptr + req) - q_len

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_idx = q_first + rows // BLOCK_H
    head = head_tile * BLOCK_H + rows % BLOCK_H
    row_ok = (rows < BLOCK_Q * BLOCK_H) & (q_idx < q_len) & (head < num_heads)
    q_pos = ctx + q_idx
    tok = (q_begin + q_idx).to(tl.int64)
    dc = tl.arange(0, R_PAD)
    dr = tl.arange(0, ROPE_PAD)
    q_row = q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head
    q_c = tl.load(q_row + dc[None, :], mask=row_ok[:, None] & (dc[None, :] < R), other=0.0)
    q_r = tl.load(q_row + R + dr[None, :], mask=row_ok[:, None] & (dr[None, :] < ROPE), other=0.0)
    q_c = q_c.to(COMPUTE_DTYPE)  # [BLOCK_M, R_PAD]
    q_r = q_r.to(COMPUTE_DTYPE)  # [BLOCK_M, ROPE_PAD]

    last_q = tl.minimum(q_first + BLOCK_Q, q_len) - 1
    k_end = ctx + last_q + 1
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, R_PAD], dtype=tl.float32)
    for start in range(0, k_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
        key_ok = keys < k_end
        block = tl.load(
            block_table_ptr + req * stride_table_req + keys // BLOCK_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
        row = cache_ptr + block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
        c = tl.load(row[:, None] + dc[None, :], mask=key_ok[:, None] & (dc[None, :] < R), other=0.0)
        c = c.to(COMPUTE_DTYPE)  # [BLOCK_N, R_PAD]
        kr = tl.load(
            row[:, None] + R + dr[None, :], mask=key_ok[:, None] & (dr[None, :] < ROPE), other=0.0
        ).to(COMPUTE_DTYPE)  # [BLOCK_N, ROPE_PAD]
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_r, tl.trans(kr), input_precision=DOT_PRECISION)
        s = s * qk_scale  # [BLOCK_M, BLOCK_N]
        ok = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        s = tl.where(ok, s, float("-inf"))  # causal only: no window, soft-cap or ALiBi here
        p, m_i, l_i, acc = online_softmax(s, m_i, l_i, acc)
        acc = acc + tl.dot(p.to(COMPUTE_DTYPE), c, input_precision=DOT_PRECISION)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_out_tok + head[:, None] * stride_out_head + dc[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dc[None, :] < R),
    )


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def store_latent_triton(
    c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton ``store_latent`` (same contract as ``store_latent_torch``)."""
    layout = check_store_latent_args(c_kv, k_pe, cache, slot_mapping)
    if layout.fp8:
        raise KernelConfigError(
            "the Triton MLA kernels do not read FP8 latents yet: backend='torch'"
        )
    num_blocks, block_size, r = layout.num_blocks, layout.block_size, c_kv.shape[1]
    check_triton_device(cache, _store_latent_kernel)
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_blocks * block_size:
        raise KernelConfigError(f"a slot is past the cache's {num_blocks * block_size} slots")
    if c_kv.shape[0] == 0:
        return
    rope = k_pe.shape[1]
    _store_latent_kernel[(c_kv.shape[0],)](
        c_kv_ptr=c_kv,
        k_pe_ptr=k_pe,
        cache_ptr=cache,
        slot_ptr=slot_mapping,
        stride_c_tok=c_kv.stride(0),
        stride_pe_tok=k_pe.stride(0),
        stride_cache_block=cache.stride(0),
        stride_cache_slot=cache.stride(1),
        R=r,
        ROPE=rope,
        R_PAD=_pad(r),
        ROPE_PAD=_pad(rope),
        BLOCK_SIZE=block_size,
    )


def mla_attention_triton(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``mla_attention`` (absorbed form for every request); returns [T, H, v_dim]."""
    s = check_mla_args(q_nope, q_pe, cache, meta, w_uk, w_uv, scale, out)
    if s.fp8:
        raise KernelConfigError(
            "the Triton MLA kernels do not read FP8 latents yet: backend='torch'"
        )
    check_triton_device(cache, _mla_decode_kernel)
    check_dense_metadata(meta)
    h, r, rope = s.num_heads, s.kv_lora_rank, s.rope_dim
    if out is None:
        out = torch.empty((meta.num_tokens, h, s.v_dim), dtype=cache.dtype, device=cache.device)
    if meta.num_tokens == 0:
        return out
    q = absorb_query(q_nope, q_pe, w_uk)  # [T, H, r + rope]
    lat = torch.empty((meta.num_tokens, h, r), dtype=cache.dtype, device=cache.device)
    block_h = min(triton.next_power_of_2(h), MIN_ROWS)
    block_q = 1 if meta.max_q_len == 1 else max(1, MIN_ROWS // block_h)
    block_m = max(MIN_ROWS, block_q * block_h)
    row_bytes = (r + rope) * cache.element_size()
    block_n = 32 if row_bytes <= 1024 else 16
    tile_req, tile_start = work_tiles(meta, block_q)
    _mla_decode_kernel[(tile_req.shape[0], triton.cdiv(h, block_h))](
        q_ptr=q,
        cache_ptr=cache,
        block_table_ptr=meta.block_table,
        query_start_loc_ptr=meta.query_start_loc,
        seq_lens_ptr=meta.seq_lens,
        tile_req_ptr=tile_req,
        tile_start_ptr=tile_start,
        out_ptr=lat,
        qk_scale=float(scale) * LOG2E,
        num_heads=h,
        stride_q_tok=q.stride(0),
        stride_q_head=q.stride(1),
        stride_cache_block=cache.stride(0),
        stride_cache_slot=cache.stride(1),
        stride_table_req=meta.block_table.stride(0),
        stride_out_tok=lat.stride(0),
        stride_out_head=lat.stride(1),
        R=r,
        ROPE=rope,
        R_PAD=_pad(r),
        ROPE_PAD=_pad(rope),
        BLOCK_SIZE=s.block_size,
        BLOCK_H=block_h,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        COMPUTE_DTYPE=compute_dtype(cache.dtype, _mla_decode_kernel),
        DOT_PRECISION="ieee" if cache.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    out.copy_(unabsorb_output(lat, w_uv))
    return out
