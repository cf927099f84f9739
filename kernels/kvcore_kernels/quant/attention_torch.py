"""Pure-torch twin of the dequantizing paged attention: the test oracle's peer and the CPU path.

The plain twin's chunked schedule (``kvcore_kernels.chunks_torch.build_chunks``): per chunk
only the blocks its requests read are gathered and decoded (codes times scales, KIVI residual
blocks taken from the model-dtype pool), into a chunk-sized buffer; then SDPA (or the explicit
soft-cap / ALiBi path). No dequantized copy of the whole cache is ever made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcore_kernels.checks import check_attention_args
from kvcore_kernels.chunks_torch import CHUNK_BYTES_PER_THREAD, attend_explicit, build_chunks
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.checks import shape_proxy
from kvcore_kernels.quant.read_torch import read_tokens


def paged_attention_quant_torch(
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
    """``paged_attention`` over a ``QuantKVCache`` (same contract, same result layout)."""
    shape = check_attention_args(
        query, shape_proxy(cache), meta, scale, sliding_window, soft_cap, alibi_slopes, out
    )
    scale = float(scale)
    sliding_window = None if sliding_window is None else int(sliding_window)
    soft_cap = None if soft_cap is None else float(soft_cap)
    hq, hk, d, bs = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    if out is None:
        out = torch.empty_like(query)
    # Budget in decoded (fp32) bytes: the chunk's decoded K/V stays in L2 while SDPA reads it.
    budget = max(1, CHUNK_BYTES_PER_THREAD * torch.get_num_threads() // (8 * hk * d))
    cache_key = ("torch", sliding_window, budget)
    chunks = meta.cache.get(cache_key)
    if chunks is None:
        chunks = meta.cache[cache_key] = build_chunks(meta, sliding_window, budget)
    explicit = soft_cap is not None or alibi_slopes is not None
    for c in chunks:
        n, key_len = c.num_reqs, c.num_blocks * bs
        kv = torch.stack(  # [n, 2, key_len, Hk, D]: the layout build_chunks' pad rows index
            (
                read_tokens(cache, c.blocks, 0).view(n, key_len, hk, d),
                read_tokens(cache, c.blocks, 1).view(n, key_len, hk, d),
            ),
            dim=1,
        ).to(query.dtype)
        if c.pad_rows is not None:
            kv.view(2 * n * key_len, hk * d).index_fill_(0, c.pad_rows, 0)
        k, v = kv[:, 0], kv[:, 1]
        q = query.index_select(0, c.q_index).view(n, c.q_max, hq, d)
        if explicit:
            o = attend_explicit(q, k, v, c, scale, soft_cap, alibi_slopes)
        else:
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=c.mask_as(query.dtype),
                is_causal=c.is_causal,
                scale=scale,
                enable_gqa=hq != hk,
            ).transpose(1, 2)  # [n, q_max, Hq, D]
        rows = o.reshape(n * c.q_max, hq, d)
        if c.src_rows is not None:
            rows = rows.index_select(0, c.src_rows)
        out.index_copy_(0, c.out_index, rows)
    return out
