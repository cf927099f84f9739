"""Triton quantizing store: per-token encoding into slots (KIVI's block encoder: kivi_triton).

One launch per layer per step writes every token's K and V codes and their scales (one program
per token, all KV heads). A block row of the ``uint8 [num_blocks, block_bytes]`` buffer is
``H`` head segments of ``HEAD_BYTES`` (``formats`` docstring); within a segment, element
``(kv, slot)`` of a per-token region sits at index ``kv * BLOCK_SIZE + slot`` (times ``G`` groups),
reached through byte offsets (``formats.region_offsets``) and typed pointer casts.
Rounding is ``floor(x + 0.5)`` and scales are rounded to fp16 before use, as in ``codecs``
(whose ``FP16_TINY`` = 2**-14 and ``FP16_MAX`` = 65504 bound every fp16 scale here too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.checks import check_quant_store_args
from kvcore_kernels.quant.encode_triton import pack_rows, scale_code
from kvcore_kernels.quant.formats import (
    KIND_FP8_E4M3,
    KIND_FP8_E5M2,
    kernel_kind,
    region_offsets,
)
from kvcore_kernels.triton_util import check_triton_device


@triton.jit
def _fp8_round(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """``codecs.fp8_round``: fp32 rounded to the FP8 grid (ties to even) before the cast."""
    drop: tl.constexpr = 23 - MANT
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> drop) & 1
    normal = ((bits + (1 << (drop - 1)) - 1 + lsb) >> drop << drop).to(tl.float32, bitcast=True)
    step: tl.constexpr = 2.0 ** (MIN_EXP - MANT)
    sub = ((y / step + 12582912.0) - 12582912.0) * step
    return tl.where(tl.abs(y) >= 2.0**MIN_EXP, normal, sub)


@triton.jit
def _zp_code(lo, hi, levels: tl.constexpr):
    """``codecs.zp_encode``: (e5m3 scale code, scale, int8 zero point, grid start) of groups."""
    need = (hi - lo) / (levels - 0.125)
    need = tl.maximum(need, tl.where(lo < 0, -lo / 16.0, lo / 15.875))
    code, s = scale_code(need)
    z = tl.minimum(tl.maximum(tl.floor(lo * 8.0 / s), -128.0), 127.0)
    return code, s, z.to(tl.int8), z * s / 8.0


@triton.jit
def _encode_token(
    x,  # [HEADS_PAD, HEAD_DIM] fp32
    ok,  # [HEADS_PAD] heads to write
    seg,  # [HEADS_PAD] uint8 pointers to each head's segment of the block row
    r,  # index of (kv, slot) in the segment's [2, bs] grid
    slot,  # the token's slot in its block (row of the per-K/V [bs, G] regions)
    fp8_scale_ptr,  # float32 [2, H]
    heads,
    KV: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,  # intg: this K or V's group size
    MIN8: tl.constexpr,  # intg: int8 zero points (codecs.zp_encode), else fp16 minima
    DATA_OFF: tl.constexpr,
    META0_OFF: tl.constexpr,  # int8: scale [2, bs]; intg: this K or V's scale region
    META1_OFF: tl.constexpr,  # intg: this K or V's min region
    FP8_MAX: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)
    if KIND <= 1:  # fp8: x / s_head, saturated, stored as the format's bytes
        s = tl.load(fp8_scale_ptr + KV * NUM_KV_HEADS + heads, mask=ok, other=1.0)
        y = tl.minimum(tl.maximum(x / s[:, None], -FP8_MAX), FP8_MAX)
        if KIND == 0:
            code = _fp8_round(y, 3, -6).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = _fp8_round(y, 2, -14).to(tl.float8e5).to(tl.uint8, bitcast=True)
        tl.store(seg[:, None] + DATA_OFF + r * HEAD_DIM + dims[None, :], code, mask=ok[:, None])
    elif KIND == 2:  # int8 symmetric, fp16 scale per token per head
        s16 = tl.minimum(tl.maximum(tl.max(tl.abs(x), 1) / 127.0, 6.103515625e-05), 65504.0)
        s16 = s16.to(tl.float16)
        q = tl.floor(x / s16.to(tl.float32)[:, None] + 0.5)
        q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
        tl.store(seg[:, None] + DATA_OFF + r * HEAD_DIM + dims[None, :], q, mask=ok[:, None])
        tl.store((seg + META0_OFF).to(tl.pointer_type(tl.float16)) + r, s16, mask=ok)
    else:  # int4 (e5m3 scale code) / int2 (fp16 scale), fp16 min, groups along the head dim
        ng: tl.constexpr = HEAD_DIM // GROUP
        levels: tl.constexpr = (1 << BITS) - 1
        xg = tl.reshape(x, (HEADS_PAD, ng, GROUP))
        if MIN8:  # int8 zero point in eighths of the scale
            code, s, lo, lof = _zp_code(tl.min(xg, 2), tl.max(xg, 2), levels)
        elif KIND == 3:
            lo = tl.minimum(tl.maximum(tl.min(xg, 2), -65504.0), 65504.0).to(tl.float16)
            lof = lo.to(tl.float32)
            code, s = scale_code((tl.max(xg, 2) - lof) / levels)
        else:
            lo = tl.minimum(tl.maximum(tl.min(xg, 2), -65504.0), 65504.0).to(tl.float16)
            lof = lo.to(tl.float32)
            code = tl.minimum(tl.maximum((tl.max(xg, 2) - lof) / levels, 6.103515625e-05), 65504.0)
            code = code.to(tl.float16)
            s = code.to(tl.float32)
        q = tl.floor((xg - lof[:, :, None]) / s[:, :, None] + 0.5)
        q = tl.minimum(tl.maximum(q, 0.0), levels).to(tl.int32)
        packed = pack_rows(tl.reshape(q, (HEADS_PAD, HEAD_DIM)), HEADS_PAD, HEAD_DIM, BITS)
        cols = tl.arange(0, HEAD_DIM * BITS // 8)
        width: tl.constexpr = HEAD_DIM * BITS // 8
        tl.store(seg[:, None] + DATA_OFF + r * width + cols[None, :], packed, mask=ok[:, None])
        g = slot * ng + tl.arange(0, ng)[None, :]  # [1, ng] in this K or V's [bs, ng]
        if KIND == 3:
            tl.store(seg[:, None] + META0_OFF + g, code, mask=ok[:, None])
        else:
            meta0 = (seg[:, None] + META0_OFF).to(tl.pointer_type(tl.float16))
            tl.store(meta0 + g, code, mask=ok[:, None])
        if MIN8:
            tl.store(seg[:, None] + META1_OFF + g, lo.to(tl.uint8, bitcast=True), mask=ok[:, None])
        else:
            meta1 = (seg[:, None] + META1_OFF).to(tl.pointer_type(tl.float16))
            tl.store(meta1 + g, lo, mask=ok[:, None])


@triton.jit
def _store_tokens_kernel(
    key_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    value_ptr,  # [num_tokens, NUM_KV_HEADS, HEAD_DIM]
    slot_mapping_ptr,  # [num_tokens] int32 or int64
    buf_ptr,  # uint8 [num_blocks, block_bytes]
    fp8_scale_ptr,  # float32 [2, NUM_KV_HEADS] (fp8 only)
    num_slots,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_BYTES: tl.constexpr,  # bytes of one head segment (block row = NUM_KV_HEADS of them)
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
    MIN8: tl.constexpr,
    DATA_OFF: tl.constexpr,
    META0_OFF: tl.constexpr,
    META1_OFF: tl.constexpr,
    V_META0_OFF: tl.constexpr,  # intg: V's scale / min regions (int8: META0_OFF again)
    V_META1_OFF: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    keep = (slot >= BLOCK_SIZE) & (slot < num_slots)
    block = tl.where(keep, slot // BLOCK_SIZE, 0)
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    dims = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    # The slot is broadcast before comparing: the interpreter rejects scalar-bool & block masks.
    slots = tl.zeros([HEADS_PAD], dtype=tl.int64) + slot
    ok = (slots >= BLOCK_SIZE) & (slots < num_slots) & (heads < NUM_KV_HEADS)
    seg = buf_ptr + block * (NUM_KV_HEADS * HEAD_BYTES) + heads * HEAD_BYTES  # [HEADS_PAD]
    k = tl.load(
        key_ptr + tok * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :],
        mask=ok[:, None],
        other=0.0,
    ).to(tl.float32)
    v = tl.load(
        value_ptr + tok * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :],
        mask=ok[:, None],
        other=0.0,
    ).to(tl.float32)
    _encode_token(
        k,
        ok,
        seg,
        offset,
        offset,
        fp8_scale_ptr,
        heads,
        0,
        NUM_KV_HEADS,
        HEAD_DIM,
        HEADS_PAD,
        KIND,
        BITS,
        K_GROUP,
        MIN8,
        DATA_OFF,
        META0_OFF,
        META1_OFF,
        FP8_MAX,
    )
    _encode_token(
        v,
        ok,
        seg,
        BLOCK_SIZE + offset,
        offset,
        fp8_scale_ptr,
        heads,
        1,
        NUM_KV_HEADS,
        HEAD_DIM,
        HEADS_PAD,
        KIND,
        BITS,
        V_GROUP,
        MIN8,
        DATA_OFF,
        V_META0_OFF,
        V_META1_OFF,
        FP8_MAX,
    )


def store_tokens_triton(
    key: torch.Tensor, value: torch.Tensor, cache: QuantKVCache, slot_mapping: torch.Tensor
) -> None:
    """Triton per-token quantizing store (fp8, int8, int4, int2); skips out-of-range slots."""
    check_quant_store_args(key, value, cache, slot_mapping)
    check_triton_device(cache.buffer, _store_tokens_kernel)
    if key.shape[0] == 0:
        return
    kind = kernel_kind(cache.fmt)
    data_off, meta0, meta1, meta2, meta3 = region_offsets(cache.layout)
    if cache.fmt.kind != "intg":  # int8: one [2, bs] scale region for K and V
        meta2, meta3 = meta0, meta1
    fp8_max = 448.0 if kind == KIND_FP8_E4M3 else 57344.0 if kind == KIND_FP8_E5M2 else 0.0
    _store_tokens_kernel[(key.shape[0],)](
        key_ptr=key,
        value_ptr=value,
        slot_mapping_ptr=slot_mapping,
        buf_ptr=cache.buffer,
        fp8_scale_ptr=cache.fp8_scale if cache.fp8_scale is not None else key,
        num_slots=cache.num_blocks * cache.block_size,
        stride_key_tok=key.stride(0),
        stride_key_head=key.stride(1),
        stride_value_tok=value.stride(0),
        stride_value_head=value.stride(1),
        BLOCK_SIZE=cache.block_size,
        NUM_KV_HEADS=cache.num_kv_heads,
        HEAD_DIM=cache.head_dim,
        HEADS_PAD=triton.next_power_of_2(cache.num_kv_heads),
        HEAD_BYTES=cache.layout.head_bytes,
        KIND=kind,
        BITS=cache.fmt.bits,
        K_GROUP=cache.fmt.groups[0],
        V_GROUP=cache.fmt.groups[1],
        MIN8=cache.fmt.min8,
        DATA_OFF=data_off,
        META0_OFF=meta0,
        META1_OFF=meta1,
        V_META0_OFF=meta2,
        V_META1_OFF=meta3,
        FP8_MAX=fp8_max,
    )
