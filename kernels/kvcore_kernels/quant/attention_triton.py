"""Triton paged attention over a quantized cache: decoding happens in the K/V tile loads.

The kernel is ``paged_triton.paged_attention_kernel`` (query tiles, splits, output: the plain
cache's schedule, launcher and split merge); this module gives it ``quant_kv_loop``, which walks
the keys in tiles of whole block units (``load_triton``) and decodes them from the block rows
(codes times scales) in registers. Released blocks (null block-table entries) are dropped by
the tile's key mask (``load_triton.tile_keys``): never read, weight 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_kernels.checks import check_attention_call
from kvcore_kernels.paged_triton import plan_launch, split_tiles
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
from kvcore_kernels.softmax_triton import online_softmax, tile_scores


@triton.jit
def quant_kv_loop(
    acc, m_i, l_i, q, q_pos, slope, row_ok, req, kv_head, split, num_splits, ctx, q_first,
    k_start, k_end, table_row, qk_scale, soft_cap, sliding_window, num_released,
    cache,  # (buffer, fp8 scales, KIVI residual, residual stage map, 4 residual strides)
    CACHE: tl.constexpr,  # the format's constants (paged_attention_quant_triton: consts)
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_ALIBI: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The quantized cache's ``KV_LOOP`` (``paged_triton``): returns (acc, m_i, l_i)."""
    (
        buf_ptr,  # uint8 [num_blocks, NUM_KV_HEADS * HEAD_BYTES]
        fp8_scale_ptr,  # float32 [2, NUM_KV_HEADS]
        residual_ptr,  # [num_slots, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
        stage_ptr,  # int32 [num_blocks]
        stride_res_slot,
        stride_res_kv,
        stride_res_pos,
        stride_res_head,
    ) = cache
    # The format's constants (in the order of paged_attention_quant_triton's consts), indexed
    # one by one: each stays a compile-time constant (unpacked, they compile as runtime values).
    KIND: tl.constexpr = CACHE[0]
    BITS: tl.constexpr = CACHE[1]
    K_GROUP: tl.constexpr = CACHE[2]  # intg: group sizes of K and V along the head dim
    V_GROUP: tl.constexpr = CACHE[3]
    MIN8: tl.constexpr = CACHE[4]  # intg: int8 zero points
    HEAD_BYTES: tl.constexpr = CACHE[5]  # one head segment of a block row
    DATA_OFF: tl.constexpr = CACHE[6]
    META0_OFF: tl.constexpr = CACHE[7]
    META1_OFF: tl.constexpr = CACHE[8]
    META2_OFF: tl.constexpr = CACHE[9]
    META3_OFF: tl.constexpr = CACHE[10]
    KCODE_EXP_BIAS: tl.constexpr = CACHE[11]
    NUM_KV_HEADS: tl.constexpr = CACHE[12]
    PB: tl.constexpr = CACHE[13]  # slots per unit of a key tile (load_triton docstring)
    SUBS: tl.constexpr = CACHE[14]  # units per block
    # fp8: the per-head scales fold into the scores (K) and the output (V), one multiply each.
    k_scale = qk_scale
    v_scale = 1.0
    if KIND <= 1:
        k_scale = qk_scale * tl.load(fp8_scale_ptr + kv_head)
        v_scale = tl.load(fp8_scale_ptr + NUM_KV_HEADS + kv_head)

    first_block = k_start // BLOCK_SIZE  # tiles start on a block boundary: whole-unit loads
    k_lo = first_block * BLOCK_SIZE
    num_units = tl.cdiv(k_end - k_lo, BLOCK_SIZE) * SUBS
    num_kv_tiles = tl.cdiv(num_units, BLOCK_N // PB)
    t_begin, t_end = split_tiles(num_kv_tiles, split, num_splits)
    head_base = buf_ptr + kv_head * HEAD_BYTES  # this KV head's segment of block 0
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
            unit_ok = unit_ok & (unit_block != 0)  # released blocks: statistics never read
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
        # Every tile is masked: tiles start on a block boundary (below k_start with a window),
        # and key_ok drops released blocks; the plain loop's unmasked path for full tiles is not
        # written (nor measured) here, so num_released changes nothing.
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
    return acc, m_i, l_i


def paged_attention_quant_triton(
    query: torch.Tensor, cache: QuantKVCache, meta: AttentionMetadata, **options
) -> torch.Tensor:
    """Triton ``paged_attention_quant`` (``options``: ``paged_attention``'s keywords but
    ``block_mass``; same contract as ``paged_attention_quant_torch``)."""
    call = check_attention_call(query, shape_proxy(cache), meta, options)
    launch = plan_launch(query, meta, call, key_slack=cache.block_size)
    bs_pad = triton.next_power_of_2(cache.block_size)
    unit = min(bs_pad, launch.block_n)
    res = cache.residual if cache.residual is not None else query[:1, None, None]  # unread
    stage = cache.residual_state.device_map if cache.residual_state is not None else meta.seq_lens
    fp8_scale = cache.fp8_scale if cache.fp8_scale is not None else meta.seq_lens
    fmt = cache.fmt
    consts = (
        kernel_kind(fmt), fmt.bits, fmt.groups[0], fmt.groups[1], fmt.min8,
        cache.layout.head_bytes, *region_offsets(cache.layout), KCODE_EXP_BIAS,
        cache.num_kv_heads, unit, bs_pad // unit,
    )  # fmt: skip
    tensors = (cache.buffer, fp8_scale, res, stage, *res.stride()[:4])
    return launch.run(quant_kv_loop, tensors, consts)
