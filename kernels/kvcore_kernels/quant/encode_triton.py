"""Device functions both quantizing Triton encoders share (per-token store, KIVI blocks).

``pack_rows`` packs int codes into bytes (the ``codecs.pack_codes`` order); ``scale_code``
is ``codecs.kcode_encode``, the KIVI key scale's e5m3 code.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pack_rows(q, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """int32 codes [ROWS, HEAD_DIM] -> uint8 [ROWS, HEAD_DIM * BITS // 8] (element d at byte
    d // (8 // BITS), bit (d % (8 // BITS)) * BITS)."""
    per: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, per) * BITS
    q3 = tl.reshape(q, (ROWS, HEAD_DIM // per, per))
    return tl.sum(q3 << shifts[None, None, :], 2).to(tl.uint8)


@triton.jit
def scale_code(exact):
    """``codecs.kcode_encode``: (uint8 e5m3 code rounded up, its fp32 scale) of scales >= 0."""
    e = tl.minimum(tl.maximum(exact, 1.52587890625e-05), 61440.0).to(tl.int32, bitcast=True)
    e = (e + 1048575) & -1048576  # round the mantissa up to 3 bits
    code = (((e >> 23) - 127 + 16) << 3) | ((e >> 20) & 7)
    return code.to(tl.uint8), e.to(tl.float32, bitcast=True)
