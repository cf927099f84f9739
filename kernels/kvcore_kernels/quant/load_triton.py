"""The dequantizing K/V tile load of the Triton paged attention (one jit function per file).

``_load_tile`` reads a ``[BLOCK_N, HEAD_DIM]`` tile of keys or values of one KV head from the
block rows (byte offsets ``formats.region_offsets``, typed pointer casts) and returns it in
fp32, decoded in registers::

    fp8    code * s[kv, head]                       int8   code * s[token]
    int4   code * s[token, group] + min[...]        int2   the same (s: e5m3 code / fp16)
    kivi   K: code * s[block, channel] + min[...];  V: code * s[token] + min[token]
           rows of blocks still in the residual come from it, in the model dtype

Rows past ``key_ok`` are 0. Element ``(kv, slot, head)`` of a per-token region sits at index
``(kv * BLOCK_SIZE + slot) * NUM_KV_HEADS + head`` (times the groups per head).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_tile(
    buf_ptr,  # uint8 [num_blocks, block_bytes]
    fp8_scale_ptr,  # float32 [2, NUM_KV_HEADS]
    residual_ptr,  # [num_slots, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM] (kivi)
    stage_ptr,  # int32 [num_blocks]: residual slot of each block or -1 (kivi)
    block,  # [BLOCK_N] int64 block of each key
    pos,  # [BLOCK_N] offset of each key in its block
    key_ok,  # [BLOCK_N]
    kv_head,
    block_bytes,
    stride_res_slot,
    stride_res_kv,
    stride_res_pos,
    stride_res_head,
    KV: tl.constexpr,  # 0: keys, 1: values
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    DATA_OFF: tl.constexpr,
    META0_OFF: tl.constexpr,
    META1_OFF: tl.constexpr,
    META2_OFF: tl.constexpr,
    META3_OFF: tl.constexpr,
    KCODE_EXP_BIAS: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)
    row = buf_ptr + block * block_bytes  # [BLOCK_N] uint8 pointers
    sh = (KV * BLOCK_SIZE + pos) * NUM_KV_HEADS + kv_head  # [BLOCK_N] (kv, slot, head)
    m2 = key_ok[:, None]
    if KIND <= 2:  # one byte per element
        byte = tl.load(row[:, None] + DATA_OFF + sh[:, None] * HEAD_DIM + dims[None, :], mask=m2)
        if KIND == 0:
            x = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif KIND == 1:
            x = byte.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            x = byte.to(tl.int8, bitcast=True).to(tl.float32)
        if KIND <= 1:
            x = x * tl.load(fp8_scale_ptr + KV * NUM_KV_HEADS + kv_head)
        else:
            s = tl.load((row + META0_OFF).to(tl.pointer_type(tl.float16)) + sh, mask=key_ok)
            x = x * s.to(tl.float32)[:, None]
    else:
        per: tl.constexpr = 8 // BITS
        width: tl.constexpr = HEAD_DIM // per
        byte = tl.load(
            row[:, None] + DATA_OFF + sh[:, None] * width + (dims // per)[None, :], mask=m2
        )
        q = ((byte.to(tl.int32) >> ((dims % per) * BITS)[None, :]) & ((1 << BITS) - 1)).to(
            tl.float32
        )
        if KIND <= 4:  # int4 / int2: per token, groups along the head dim; fp16 min
            g = sh[:, None] * (HEAD_DIM // GROUP) + (dims // GROUP)[None, :]  # [BLOCK_N, D]
            if KIND == 3:
                code = tl.load(row[:, None] + META0_OFF + g, mask=m2).to(tl.int32)
                bits = (((code >> 3) - KCODE_EXP_BIAS + 127) << 23) | ((code & 7) << 20)
                s = bits.to(tl.float32, bitcast=True)
            else:
                s = tl.load((row[:, None] + META0_OFF).to(tl.pointer_type(tl.float16)) + g, mask=m2)
                s = s.to(tl.float32)
            lo = tl.load((row[:, None] + META1_OFF).to(tl.pointer_type(tl.float16)) + g, mask=m2)
            x = q * s + lo.to(tl.float32)
        else:  # kivi
            if KV == 0:  # per channel of the block
                ch = kv_head * HEAD_DIM + dims[None, :]
                lo = tl.load(
                    (row[:, None] + META0_OFF).to(tl.pointer_type(tl.float16)) + ch, mask=m2
                )
                code = tl.load(row[:, None] + META1_OFF + ch, mask=m2).to(tl.int32)
                bits = (((code >> 3) - KCODE_EXP_BIAS + 127) << 23) | ((code & 7) << 20)
                x = q * bits.to(tl.float32, bitcast=True) + lo.to(tl.float32)
            else:  # per token
                ph = pos * NUM_KV_HEADS + kv_head
                s = tl.load((row + META2_OFF).to(tl.pointer_type(tl.float16)) + ph, mask=key_ok)
                lo = tl.load((row + META3_OFF).to(tl.pointer_type(tl.float16)) + ph, mask=key_ok)
                x = q * s.to(tl.float32)[:, None] + lo.to(tl.float32)[:, None]
            stage = tl.load(stage_ptr + block, mask=key_ok, other=-1).to(tl.int64)
            staged = key_ok & (stage >= 0)
            res = tl.load(
                residual_ptr
                + stage[:, None] * stride_res_slot
                + KV * stride_res_kv
                + pos[:, None] * stride_res_pos
                + kv_head * stride_res_head
                + dims[None, :],
                mask=staged[:, None],
                other=0.0,
            )
            x = tl.where(staged[:, None], res.to(tl.float32), x)
    return tl.where(m2, x, 0.0)
