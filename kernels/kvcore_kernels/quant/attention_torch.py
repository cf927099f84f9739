"""Pure-torch twin of the dequantizing paged attention: the test oracle's peer and the CPU path.

The plain twin's chunked schedule and chunk attention (``kvcore_kernels.chunks_torch``): per
chunk only the blocks its requests read are gathered and decoded (codes times scales, KIVI
residual blocks taken from the model-dtype pool) into a chunk-sized buffer, then
``attend_chunk``. No dequantized copy of the whole cache is ever made. Released blocks are
never gathered (``chunks_torch`` packs a request's live blocks first).
"""

from __future__ import annotations

import torch

from kvcore_kernels.checks import check_attention_call
from kvcore_kernels.chunks_torch import attend_chunk, twin_chunks
from kvcore_kernels.plan import AttentionMetadata
from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.checks import shape_proxy
from kvcore_kernels.quant.read_torch import read_tokens


def paged_attention_quant_torch(
    query: torch.Tensor, cache: QuantKVCache, meta: AttentionMetadata, **options
) -> torch.Tensor:
    """``paged_attention`` over a ``QuantKVCache`` (``options``: that function's keywords; same
    contract, same result layout)."""
    call = check_attention_call(query, shape_proxy(cache), meta, options)
    hk, d = call.shape.num_kv_heads, call.shape.head_dim
    # Budget in decoded (fp32) bytes: the chunk's decoded K/V stays in L2 while SDPA reads it.
    for c in twin_chunks(meta, call.sliding_window, 8 * hk * d):
        key_len = c.num_blocks * call.shape.block_size
        kv = torch.stack(  # [n, 2, key_len, Hk, D]: the layout build_chunks' pad rows index
            [read_tokens(cache, c.blocks, i).view(c.num_reqs, key_len, hk, d) for i in (0, 1)],
            dim=1,
        ).to(query.dtype)
        attend_chunk(query, c, kv, call)
    return call.out
