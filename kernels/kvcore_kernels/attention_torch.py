"""Pure-torch twin of the Triton paged attention: the test oracle's peer and the CPU path.

Requests are sorted (decode first, then by query length and blocks needed) and cut into
chunks whose gathered K and V fit in the CPU's L2 caches (``chunks_torch``). Per chunk and
layer: one ``index_select`` of whole blocks into a small buffer that stays in cache, then
``chunks_torch.attend_chunk`` (pad rows zeroed, one fused SDPA or the explicit soft-cap /
ALiBi / attention-mass path, one ``index_copy_`` into the output). The loop is over chunks,
never over requests or blocks; the gather indices and masks of every chunk are built once per
step (per sliding window) and cached in the metadata.
"""

from __future__ import annotations

import torch

from kvcore_kernels.checks import check_attention_call
from kvcore_kernels.chunks_torch import attend_chunk, twin_chunks
from kvcore_kernels.plan import AttentionMetadata


def paged_attention_torch(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, **options
) -> torch.Tensor:
    """Pure-torch ``paged_attention`` over a plain cache: ``options`` are that function's
    keywords (``scale``, ``sliding_window``, ``soft_cap``, ``alibi_slopes``, ``out``,
    ``block_mass``); same contract as ``paged_attention_triton``."""
    call = check_attention_call(query, kv_cache, meta, options)
    hk, d, bs = call.shape.num_kv_heads, call.shape.head_dim, call.shape.block_size
    chunks = twin_chunks(meta, call.sliding_window, 2 * hk * d * kv_cache.element_size())
    # [num_blocks * 2, bs * Hk * D]: row 2b is block b's K, row 2b + 1 its V.
    flat = kv_cache.view(-1, bs * hk * d) if kv_cache.is_contiguous() else None
    # One gather buffer per call, reused by every chunk (it stays in cache between them).
    most = max((c.num_reqs * c.num_blocks for c in chunks), default=0)
    buf = torch.empty((2 * most, bs * hk * d), dtype=query.dtype, device=query.device)
    for c in chunks:
        n, nb = c.num_reqs, c.num_blocks
        kv = buf[: 2 * n * nb]
        if flat is not None:
            torch.index_select(flat, 0, c.kv_rows, out=kv)
        else:  # a strided cache view: two advanced-index copies instead of one gather
            kv6 = kv.view(n, 2, nb, bs, hk, d)
            kv6[:, 0] = kv_cache[c.blocks, 0].view(n, nb, bs, hk, d)
            kv6[:, 1] = kv_cache[c.blocks, 1].view(n, nb, bs, hk, d)
        attend_chunk(query, c, kv.view(n, 2, nb * bs, hk, d), call)
    return call.out
