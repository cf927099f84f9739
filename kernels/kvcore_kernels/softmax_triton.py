"""The online-softmax step the paged-attention Triton kernels share (plain, quantized, latent).

Per ``BLOCK_N``-key tile a kernel loads its K tile (the part each cache layout does its own
way), computes ``s = q . k`` times its scale, and then calls ``tile_scores`` (soft-cap, ALiBi,
causal / window / bounds mask) and ``online_softmax`` (running max and sum in log2 units,
rescaled accumulator, the tile's probabilities). The K load and the V side stay with the
layout: the quantized kernel folds per-token scales into the probabilities (int8, KIVI) and
the fp8 value scale into the output, so its V step is not one shared ``acc += p @ v``. The
latent (MLA) kernel calls only ``online_softmax``: its mask is causal only.
Both functions are inlined, so each kernel runs the ops it ran before, in the same order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_scores(
    s,  # [BLOCK_M, BLOCK_N] fp32 scaled scores (log2 units)
    keys,  # [BLOCK_N] key positions
    key_ok,  # [BLOCK_N] key within the request's range (read only if MASKED)
    q_pos,  # [BLOCK_M] query positions
    slope,  # [BLOCK_M] ALiBi slope * log2(e) (read only if USE_ALIBI)
    soft_cap,
    sliding_window,
    MASKED: tl.constexpr,  # False: every key of the tile is visible to every row
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
):
    """Soft-cap, ALiBi bias and the mask, in that order (``attention`` docstring)."""
    if USE_SOFTCAP:
        s = soft_cap * (2.0 * tl.sigmoid(2.0 * s / soft_cap) - 1.0)  # cap * tanh(s / cap)
    if USE_ALIBI:
        s += slope[:, None] * (keys[None, :] - q_pos[:, None]).to(tl.float32)
    if MASKED:
        ok = (keys[None, :] <= q_pos[:, None]) & (q_pos[:, None] - keys[None, :] < sliding_window)
        s = tl.where(ok & key_ok[None, :], s, float("-inf"))
    return s


@triton.jit
def online_softmax(s, m_i, l_i, acc):
    """Fold one tile's scores in: returns (p, new max, new sum, acc rescaled to the new max);
    the caller adds ``p``'s contribution of V to the returned ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key seen yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, m_new, l_i, acc * alpha[:, None]
