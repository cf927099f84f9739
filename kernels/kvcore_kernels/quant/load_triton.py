"""Device functions of the quantized paged attention: the tile walk and the K/V tile loads.

A key tile is ``NB`` units of ``PB`` consecutive slots of one block (``PB = min(bs_pad,
BLOCK_N)``, ``NB = BLOCK_N / PB``), so its codes are ``NB`` contiguous runs of one head segment
(``formats`` docstring) read with wide loads, and every per-block quantity (KIVI's per-channel
key statistics) is one ``[NB, D]`` load broadcast over the unit's rows. Decoding, per format::

    fp8    bitcast the bytes; the per-head scale multiplies the scores (K) / the output (V)
    int8   int8 -> compute dtype; per-token scales multiply score columns (K) / probabilities (V)
    int4   one byte load per two codes, shifts in registers, [N, G, g] * s[N, G, 1] + min
           (K and V each with their own group size g and [bs, G] scale / min regions)
    int2   the same, four codes per byte
    kivi   K: [NB, PB, D] * s[NB, 1, D] + min[NB, 1, D]  (per block and head: a broadcast)
           V: codes against probabilities times the per-token scale, plus sum(p * min)
           rows of blocks still in the residual come from it, in the model dtype

Codes and scales move as whole tiles; only the scores' columns or the probabilities are scaled
where the algebra allows (``fold``), so most formats do no per-element multiply at all.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_keys(
    block_table_row,  # int32 pointer: this request's block table row
    t,  # tile index from the request's aligned key start
    first_block,  # block-table column of the first (aligned) key
    k_lo,  # first key position of tile 0 (a multiple of BLOCK_SIZE)
    k_end,  # one past the last key to read
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PB: tl.constexpr,  # slots per unit (<= the padded block size)
    SUBS: tl.constexpr,  # units per block
):
    """(keys, pos, key_ok, block) of the ``BLOCK_N`` rows of tile ``t``, each ``[BLOCK_N]``.

    ``key_ok`` is off for padding slots, keys past ``k_end`` and keys of released blocks (a
    null block-table entry inside the sequence: nothing of the null block is read)."""
    r = tl.arange(0, BLOCK_N)
    unit = t * (BLOCK_N // PB) + r // PB
    pos = (unit % SUBS) * PB + r % PB  # slot within its block
    rel = unit // SUBS  # block, counted from k_lo's
    keys = k_lo + rel * BLOCK_SIZE + pos
    key_ok = (pos < BLOCK_SIZE) & (keys < k_end)
    block = tl.load(block_table_row + first_block + rel, mask=key_ok, other=0).to(tl.int64)
    return keys, pos, key_ok & (block != 0), block


@triton.jit
def unpack(byte, BITS: tl.constexpr):
    """uint8 ``[N, D * BITS / 8]`` -> int32 codes ``[N, D]`` (element d in byte d // (8 / BITS) at
    bit (d % (8 / BITS)) * BITS): shifts and masks in registers after one wide load."""
    b = byte.to(tl.int32)
    # One return: Triton 3.9 compares the types of every return of a function, constexpr
    # branches included, and two returns of different widths do not compile.
    if BITS == 4:
        codes = tl.interleave(b & 15, b >> 4)
    else:
        lo = tl.interleave(b & 3, (b >> 4) & 3)
        codes = tl.interleave(lo, tl.interleave((b >> 2) & 3, b >> 6))
    return codes


@triton.jit
def load_codes(
    seg,  # [N] uint8 pointers: each row's head segment
    pos,  # [N] slot in the block
    key_ok,  # [N]
    KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    DATA_OFF: tl.constexpr,
):
    """The raw code bytes ``[N, HEAD_DIM * BITS / 8]`` of K (KV=0) or V (KV=1)."""
    width: tl.constexpr = HEAD_DIM * BITS // 8
    cols = tl.arange(0, width)
    row = (KV * BLOCK_SIZE + pos).to(tl.int64) * width  # [N] byte offset in the segment
    ptr = seg[:, None] + DATA_OFF + row[:, None] + cols[None, :]
    return tl.load(ptr, mask=key_ok[:, None], other=0)  # 0: a finite value in every format


@triton.jit
def group_dequant(
    codes,  # int32 [N, HEAD_DIM]
    seg,
    pos,
    key_ok,
    KIND: tl.constexpr,  # 3: int4 (e5m3 scale code), 4: int2 (fp16 scale)
    MIN8: tl.constexpr,  # minima as int8 zero points (codecs.zp_encode), else fp16
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # this K or V's group size
    SCALE_OFF: tl.constexpr,  # this K or V's [bs, G] scale region
    MIN_OFF: tl.constexpr,  # ... and min region
    KCODE_EXP_BIAS: tl.constexpr,
):
    """Per-token groupwise codes -> fp32 ``[N, HEAD_DIM]``: one ``[N, G]`` load of scales and
    of minima, broadcast over each group's elements. Masked rows read 0 (finite: their
    probabilities are 0, and 0 * NaN would poison the P.V dot)."""
    ng: tl.constexpr = HEAD_DIM // GROUP
    g = pos[:, None] * ng + tl.arange(0, ng)[None, :]  # [N, G]
    if KIND == 3:
        code = tl.load(seg[:, None] + SCALE_OFF + g, mask=key_ok[:, None], other=0).to(tl.int32)
        s = ((((code >> 3) - KCODE_EXP_BIAS + 127) << 23) | ((code & 7) << 20)).to(
            tl.float32, bitcast=True
        )
    else:
        s = tl.load(
            (seg[:, None] + SCALE_OFF).to(tl.pointer_type(tl.float16)) + g,
            mask=key_ok[:, None],
            other=0.0,
        )
        s = s.to(tl.float32)
    if MIN8:  # int8 zero point: the grid starts at z * s / 8
        z = tl.load(seg[:, None] + MIN_OFF + g, mask=key_ok[:, None], other=0)
        lo = z.to(tl.int8, bitcast=True).to(tl.float32) * s / 8.0
    else:
        lo = tl.load(
            (seg[:, None] + MIN_OFF).to(tl.pointer_type(tl.float16)) + g,
            mask=key_ok[:, None],
            other=0.0,
        )
        lo = lo.to(tl.float32)
    x = tl.reshape(codes.to(tl.float32), (BLOCK_N, ng, GROUP))
    x = x * s[:, :, None] + lo[:, :, None]
    return tl.reshape(x, (BLOCK_N, HEAD_DIM))


@triton.jit
def kivi_keys(
    codes,  # int32 [BLOCK_N, HEAD_DIM]
    unit_seg,  # [NB] uint8 pointers: the head segment of each unit's block
    unit_ok,  # [NB]
    BLOCK_N: tl.constexpr,
    PB: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KMIN_OFF: tl.constexpr,
    KCODE_OFF: tl.constexpr,
    KCODE_EXP_BIAS: tl.constexpr,
):
    """KIVI keys -> fp32 ``[BLOCK_N, HEAD_DIM]``: per-channel statistics of each unit's block
    and head (``[NB, D]``, contiguous) broadcast over the unit's ``PB`` rows."""
    nb: tl.constexpr = BLOCK_N // PB
    dims = tl.arange(0, HEAD_DIM)
    m = unit_ok[:, None]
    lo = tl.load(
        (unit_seg[:, None] + KMIN_OFF).to(tl.pointer_type(tl.float16)) + dims[None, :],
        mask=m,
        other=0.0,
    )
    code = tl.load(unit_seg[:, None] + KCODE_OFF + dims[None, :], mask=m, other=0).to(tl.int32)
    s = ((((code >> 3) - KCODE_EXP_BIAS + 127) << 23) | ((code & 7) << 20)).to(
        tl.float32, bitcast=True
    )
    x = tl.reshape(codes.to(tl.float32), (nb, PB, HEAD_DIM))
    x = x * s[:, None, :] + lo.to(tl.float32)[:, None, :]
    return tl.reshape(x, (BLOCK_N, HEAD_DIM))


@triton.jit
def token_meta(seg, pos, key_ok, KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, OFF: tl.constexpr):
    """One fp16 per token of K (KV=0) or V (KV=1) at region offset ``OFF``, as fp32 ``[N]``
    (int8's scale; KIVI's value scale and minimum use KV=0 over their ``[bs]`` regions)."""
    p = (seg + OFF).to(tl.pointer_type(tl.float16)) + KV * BLOCK_SIZE + pos
    return tl.load(p, mask=key_ok, other=0.0).to(tl.float32)


@triton.jit
def residual_rows(
    residual_ptr,  # [num_slots, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM] model dtype
    stage,  # [N] int64 residual slot of each row's block (valid where staged)
    staged,  # [N]
    pos,
    kv_head,
    stride_res_slot,
    stride_res_kv,
    stride_res_pos,
    stride_res_head,
    KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """KIVI rows still in the model-dtype residual, fp32 ``[N, HEAD_DIM]`` (0 elsewhere)."""
    dims = tl.arange(0, HEAD_DIM)
    ptr = (
        residual_ptr
        + stage[:, None] * stride_res_slot
        + KV * stride_res_kv
        + pos[:, None] * stride_res_pos
        + kv_head * stride_res_head
        + dims[None, :]
    )
    return tl.load(ptr, mask=staged[:, None], other=0.0).to(tl.float32)
