"""Triton paged attention over a quantized cache: decoding happens in the K/V tile loads.

The schedule is the plain kernel's (``kvcore_kernels.schedule.work_tiles``; the split count and
merge kernel of ``kvcore_kernels.splits_triton``): grid ``(num_tiles, num_kv_heads,
num_splits)``, ``BLOCK_M`` rows = query tokens x the query heads of one KV head, an online
softmax over ``BLOCK_N``-key tiles. Only the K/V loads differ: ``load_triton``'s device
functions decode a tile from the block rows (codes times scales) in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_kernels.checks import check_attention_args
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.checks import shape_proxy
from kvcore_kernels.quant.formats import KCODE_EXP_BIAS, kernel_kind, region_offsets
from kvcore_kernels.quant.load_triton import (
    group_dequant,
    kivi_keys,
    load_codes,
    residual_rows,
    tile_keys,
    token_meta,
    unpack,
)
from kvcore_kernels.schedule import (
    LOG2E,
    MAX_QUERIES_PER_KV,
    NO_WINDOW,
    SUPPORTED_HEAD_DIMS,
    work_tiles,
)
from kvcore_kernels.softmax_triton import online_softmax, tile_scores
from kvcore_kernels.splits_triton import choose_num_splits, merge_splits_kernel
from kvcore_kernels.triton_util import check_triton_device, compute_dtype


@triton.jit(do_not_specialize=["sliding_window", "num_splits", "num_tokens"])
def _paged_attention_quant_kernel(
    query_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    buf_ptr,  # uint8 [num_blocks, NUM_KV_HEADS * HEAD_BYTES]
    fp8_scale_ptr,  # float32 [2, NUM_KV_HEADS]
    residual_ptr,  # [num_slots, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
    stage_ptr,  # int32 [num_blocks]
    block_table_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    tile_req_ptr,  # [num_tiles] int32
    tile_start_ptr,  # [num_tiles] int32
    alibi_slopes_ptr,  # [num_q_heads] fp32 (if USE_ALIBI)
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    part_acc_ptr,  # [num_splits, num_tokens, num_q_heads, HEAD_DIM] fp32 (if SPLIT_KV)
    part_max_ptr,  # [num_splits, num_tokens, num_q_heads] fp32
    part_sum_ptr,  # [num_splits, num_tokens, num_q_heads] fp32
    qk_scale,
    soft_cap,
    sliding_window,
    num_splits,
    num_tokens,
    num_q_heads,
    stride_res_slot,
    stride_res_kv,
    stride_res_pos,
    stride_res_head,
    stride_query_tok,
    stride_query_head,
    stride_table_req,
    stride_out_tok,
    stride_out_head,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    K_GROUP: tl.constexpr,  # intg: group sizes of K and V along the head dim
    V_GROUP: tl.constexpr,
    MIN8: tl.constexpr,  # intg: int8 zero points
    HEAD_BYTES: tl.constexpr,  # one head segment of a block row
    DATA_OFF: tl.constexpr,
    META0_OFF: tl.constexpr,
    META1_OFF: tl.constexpr,
    META2_OFF: tl.constexpr,
    META3_OFF: tl.constexpr,
    KCODE_EXP_BIAS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PB: tl.constexpr,  # slots per unit of a key tile (load_triton docstring)
    SUBS: tl.constexpr,  # units per block
    SPLIT_KV: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
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
    ctx = tl.load(seq_lens_ptr + req) - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
    q_pos = ctx + q_idx
    tok = (q_begin + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
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
    # fp8: the per-head scales fold into the scores (K) and the output (V), one multiply each.
    k_scale = qk_scale
    v_scale = 1.0
    if KIND <= 1:
        k_scale = qk_scale * tl.load(fp8_scale_ptr + kv_head)
        v_scale = tl.load(fp8_scale_ptr + NUM_KV_HEADS + kv_head)

    last_q = tl.minimum(q_first + BLOCK_Q, q_len) - 1
    k_end = ctx + last_q + 1
    k_start = tl.maximum(ctx + q_first - sliding_window + 1, 0)
    first_block = k_start // BLOCK_SIZE  # tiles start on a block boundary: whole-unit loads
    k_lo = first_block * BLOCK_SIZE
    num_units = tl.cdiv(k_end - k_lo, BLOCK_SIZE) * SUBS
    num_kv_tiles = tl.cdiv(num_units, BLOCK_N // PB)
    per_split = tl.cdiv(num_kv_tiles, num_splits)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, num_kv_tiles)
    table_row = block_table_ptr + req * stride_table_req
    head_base = buf_ptr + kv_head * HEAD_BYTES  # this KV head's segment of block 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for t in range(t_begin, t_end):
        keys, pos, key_ok, block = tile_keys(
            table_row, t, first_block, k_lo, k_end, BLOCK_SIZE, BLOCK_N, PB, SUBS
        )
        seg = head_base + block * (NUM_KV_HEADS * HEAD_BYTES)  # [BLOCK_N] uint8 pointers
        # ---- keys: scores in log2 units
        kb = load_codes(seg, pos, key_ok, 0, BLOCK_SIZE, HEAD_DIM, BITS, DATA_OFF)
        if KIND == 0:
            k = kb.to(tl.float8e4nv, bitcast=True).to(COMPUTE_DTYPE)
        elif KIND == 1:
            k = kb.to(tl.float8e5, bitcast=True).to(COMPUTE_DTYPE)
        elif KIND == 2:
            k = kb.to(tl.int8, bitcast=True).to(COMPUTE_DTYPE)
        elif KIND <= 4:
            k = group_dequant(
                unpack(kb, BITS), seg, pos, key_ok, KIND, MIN8, BLOCK_N, HEAD_DIM, K_GROUP,
                META0_OFF, META1_OFF, KCODE_EXP_BIAS,
            ).to(COMPUTE_DTYPE)  # fmt: skip
        else:
            units = t * (BLOCK_N // PB) + tl.arange(0, BLOCK_N // PB)  # [NB]
            unit_ok = units < num_units
            unit_block = tl.load(table_row + first_block + units // SUBS, mask=unit_ok, other=0)
            unit_seg = head_base + unit_block.to(tl.int64) * (NUM_KV_HEADS * HEAD_BYTES)
            kf = kivi_keys(
                unpack(kb, BITS), unit_seg, unit_ok, BLOCK_N, PB, HEAD_DIM, META0_OFF,
                META1_OFF, KCODE_EXP_BIAS,
            )  # fmt: skip
            stage = tl.load(stage_ptr + block, mask=key_ok, other=-1).to(tl.int64)
            staged = key_ok & (stage >= 0)
            any_staged = tl.max(staged.to(tl.int32), 0) > 0
            if any_staged:  # the partial last block (and a window): model-dtype rows
                res_k = residual_rows(
                    residual_ptr, stage, staged, pos, kv_head, stride_res_slot, stride_res_kv,
                    stride_res_pos, stride_res_head, 0, HEAD_DIM,
                )  # fmt: skip
                kf = tl.where(staged[:, None], res_k, kf)
            k = kf.to(COMPUTE_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if KIND == 2:  # int8: the per-token scale scales a score column
            s = s * (k_scale * token_meta(seg, pos, key_ok, 0, BLOCK_SIZE, META0_OFF))[None, :]
        else:
            s = s * k_scale
        # Every tile is masked: tiles start on a block boundary (below k_start with a window);
        # the plain kernel's unmasked path for full tiles is not written (nor measured) here.
        s = tile_scores(
            s, keys, key_ok, q_pos, slope, soft_cap, sliding_window, True, USE_SOFTCAP, USE_ALIBI
        )
        p, m_new, l_i, acc = online_softmax(s, m_i, l_i, acc)
        # ---- values
        vb = load_codes(seg, pos, key_ok, 1, BLOCK_SIZE, HEAD_DIM, BITS, DATA_OFF)
        if KIND <= 1:  # fp8: the head's value scale multiplies the output at the end
            if KIND == 0:
                v = vb.to(tl.float8e4nv, bitcast=True).to(COMPUTE_DTYPE)
            else:
                v = vb.to(tl.float8e5, bitcast=True).to(COMPUTE_DTYPE)
            acc += tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
        elif KIND == 2:  # int8: probabilities times the per-token scale, against the codes
            sv = token_meta(seg, pos, key_ok, 1, BLOCK_SIZE, META0_OFF)
            v = vb.to(tl.int8, bitcast=True).to(COMPUTE_DTYPE)
            acc += tl.dot((p * sv[None, :]).to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
        elif KIND <= 4:
            v = group_dequant(
                unpack(vb, BITS), seg, pos, key_ok, KIND, MIN8, BLOCK_N, HEAD_DIM, V_GROUP,
                META2_OFF, META3_OFF, KCODE_EXP_BIAS,
            ).to(COMPUTE_DTYPE)  # fmt: skip
            acc += tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
        else:  # kivi: sum_n p (c s + min) = (p s) @ c + sum_n p min
            vs = token_meta(seg, pos, key_ok, 0, BLOCK_SIZE, META2_OFF)
            vmin = token_meta(seg, pos, key_ok, 0, BLOCK_SIZE, META3_OFF)
            pq = tl.where(staged[None, :], 0.0, p)
            v = unpack(vb, BITS).to(COMPUTE_DTYPE)
            acc += tl.dot((pq * vs[None, :]).to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
            acc += tl.sum(pq * vmin[None, :], 1)[:, None]
            if any_staged:
                res_v = residual_rows(
                    residual_ptr, stage, staged, pos, kv_head, stride_res_slot, stride_res_kv,
                    stride_res_pos, stride_res_head, 1, HEAD_DIM,
                )  # fmt: skip
                pr = tl.where(staged[None, :], p, 0.0).to(COMPUTE_DTYPE)
                acc += tl.dot(pr, res_v.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc * v_scale

    if not SPLIT_KV:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr
            + tok[:, None] * stride_out_tok
            + head[:, None] * stride_out_head
            + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:
        part = (split * num_tokens + tok) * num_q_heads + head
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


def paged_attention_quant_triton(
    query: torch.Tensor,
    cache: QuantKVCache,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``paged_attention_quant`` (same contract as ``paged_attention_quant_torch``)."""
    shape = check_attention_args(
        query, shape_proxy(cache), meta, scale, sliding_window, soft_cap, alibi_slopes, out
    )
    check_triton_device(query, _paged_attention_quant_kernel)
    hq, hk, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    group = hq // hk
    if d not in SUPPORTED_HEAD_DIMS or group > MAX_QUERIES_PER_KV:
        raise KernelConfigError(
            f"Triton paged attention supports head_dim {SUPPORTED_HEAD_DIMS} and <= "
            f"{MAX_QUERIES_PER_KV} query heads per KV head, got {d} and {group}"
        )
    if out is None:
        out = torch.empty_like(query)
    if meta.num_tokens == 0:
        return out
    decode_only = meta.max_q_len == 1
    wide = d > 128 or query.dtype == torch.float32
    block_m = max(16, triton.next_power_of_2(group)) if decode_only else (64 if wide else 128)
    block_n = 32 if wide else 64
    block_q = block_m // group
    bs_pad = triton.next_power_of_2(shape.block_size)
    unit = min(bs_pad, block_n)
    tile_req, tile_start = work_tiles(meta, block_q)
    num_tiles = tile_req.shape[0]
    splits = choose_num_splits(num_tiles * hk, meta.max_seq_len, query.device, block_n)
    if splits > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        part_acc = torch.empty((splits, meta.num_tokens, hq, d), **f32)
        part_max = torch.empty((splits, meta.num_tokens, hq), **f32)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched
    res = cache.residual if cache.residual is not None else query[:1, None, None]  # unread
    stage = cache.residual_state.device_map if cache.residual_state is not None else meta.seq_lens
    offsets = region_offsets(cache.layout)
    _paged_attention_quant_kernel[(num_tiles, hk, splits)](
        query_ptr=query,
        buf_ptr=cache.buffer,
        fp8_scale_ptr=cache.fp8_scale if cache.fp8_scale is not None else meta.seq_lens,
        residual_ptr=res,
        stage_ptr=stage,
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
        qk_scale=float(scale) * LOG2E,
        soft_cap=float(soft_cap or 1.0) * LOG2E,
        sliding_window=int(sliding_window) if sliding_window is not None else NO_WINDOW,
        num_splits=splits,
        num_tokens=meta.num_tokens,
        num_q_heads=hq,
        stride_res_slot=res.stride(0),
        stride_res_kv=res.stride(1),
        stride_res_pos=res.stride(2),
        stride_res_head=res.stride(3),
        stride_query_tok=query.stride(0),
        stride_query_head=query.stride(1),
        stride_table_req=meta.block_table.stride(0),
        stride_out_tok=out.stride(0),
        stride_out_head=out.stride(1),
        KIND=kernel_kind(cache.fmt),
        BITS=cache.fmt.bits,
        K_GROUP=cache.fmt.groups[0],
        V_GROUP=cache.fmt.groups[1],
        MIN8=cache.fmt.min8,
        HEAD_BYTES=cache.layout.head_bytes,
        DATA_OFF=offsets[0],
        META0_OFF=offsets[1],
        META1_OFF=offsets[2],
        META2_OFF=offsets[3],
        META3_OFF=offsets[4],
        KCODE_EXP_BIAS=KCODE_EXP_BIAS,
        NUM_KV_HEADS=hk,
        BLOCK_SIZE=shape.block_size,
        HEAD_DIM=d,
        QUERIES_PER_KV=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PB=unit,
        SUBS=bs_pad // unit,
        SPLIT_KV=splits > 1,
        USE_SOFTCAP=soft_cap is not None,
        USE_ALIBI=alibi_slopes is not None,
        COMPUTE_DTYPE=compute_dtype(query.dtype, _paged_attention_quant_kernel),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4 if decode_only else 8,
    )
    if splits > 1:
        merge_splits_kernel[(meta.num_tokens, hq)](
            out_ptr=out,
            part_acc_ptr=part_acc,
            part_max_ptr=part_max,
            part_sum_ptr=part_sum,
            num_tokens=meta.num_tokens,
            num_q_heads=hq,
            num_splits=splits,
            stride_out_tok=out.stride(0),
            stride_out_head=out.stride(1),
            HEAD_DIM=d,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out
