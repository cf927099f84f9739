"""Pure-torch twin of the Triton paged attention: the test oracle's peer and the CPU path.

Requests are sorted (decode first, then by query length and blocks needed) and cut into
chunks whose gathered K and V fit in the CPU's L2 caches. Per chunk and layer: one
``index_select`` of whole blocks into a small buffer that stays in cache, zeroing of the few
rows past each sequence's end (the cache may hold anything there, NaN included), one fused
``scaled_dot_product_attention`` (GQA without repeating K/V), one ``index_copy_`` into the
output. The loop is over chunks, never over requests or blocks; the gather indices and masks
of every chunk are built once per step (per sliding window) and cached in the metadata.

Soft-capping and ALiBi do not fit SDPA (a non-linearity on the scores; a bias that needs fp32),
so they take an explicit fp32 path, sliced over query rows to bound the score tensor. So does
a call that asks for ``block_mass`` (SDPA does not return its probabilities): per chunk the
probabilities are summed over heads and query rows into a per-key vector, folded into blocks
and added to ``block_mass`` with one ``index_add_``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcore_kernels.checks import check_attention_args, check_block_mass
from kvcore_kernels.chunks_torch import CHUNK_BYTES_PER_THREAD, attend_explicit, build_chunks
from kvcore_kernels.plan import AttentionMetadata


def paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch ``paged_attention`` (same contract as ``paged_attention_triton``)."""
    shape = check_attention_args(
        query, kv_cache, meta, scale, sliding_window, soft_cap, alibi_slopes, out
    )
    check_block_mass(block_mass, meta, query.device)
    scale = float(scale)
    sliding_window = None if sliding_window is None else int(sliding_window)
    soft_cap = None if soft_cap is None else float(soft_cap)
    hq, hk, d, bs = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.block_size
    if out is None:
        out = torch.empty_like(query)
    bytes_per_token = 2 * hk * d * kv_cache.element_size()
    budget = max(1, CHUNK_BYTES_PER_THREAD * torch.get_num_threads() // bytes_per_token)
    cache_key = ("torch", sliding_window, budget)
    chunks = meta.cache.get(cache_key)
    if chunks is None:
        chunks = meta.cache[cache_key] = build_chunks(meta, sliding_window, budget)
    explicit = soft_cap is not None or alibi_slopes is not None or block_mass is not None
    # [num_blocks * 2, bs * Hk * D]: row 2b is block b's K, row 2b + 1 its V.
    flat = kv_cache.view(-1, bs * hk * d) if kv_cache.is_contiguous() else None
    # One gather buffer per call, reused by every chunk (it stays in cache between them).
    most = max((c.num_reqs * c.num_blocks for c in chunks), default=0)
    buf = torch.empty((2 * most, bs * hk * d), dtype=query.dtype, device=query.device)
    for c in chunks:
        n, nb, key_len = c.num_reqs, c.num_blocks, c.num_blocks * bs
        kv = buf[: 2 * n * nb]
        if flat is not None:
            torch.index_select(flat, 0, c.kv_rows, out=kv)
        else:  # a strided cache view: two advanced-index copies instead of one gather
            kv6 = kv.view(n, 2, nb, bs, hk, d)
            kv6[:, 0] = kv_cache[c.blocks, 0].view(n, nb, bs, hk, d)
            kv6[:, 1] = kv_cache[c.blocks, 1].view(n, nb, bs, hk, d)
        if c.pad_rows is not None:
            kv.view(2 * n * key_len, hk * d).index_fill_(0, c.pad_rows, 0)
        kv = kv.view(n, 2, key_len, hk, d)
        k, v = kv[:, 0], kv[:, 1]  # [n, key_len, Hk, D] each
        if c.q_range is not None:
            q = query[c.q_range[0] : c.q_range[1]].unflatten(0, (n, c.q_max))  # a view
        else:
            q = query.index_select(0, c.q_index).view(n, c.q_max, hq, d)
        if explicit:
            key_mass = None
            if block_mass is not None:
                key_mass = torch.zeros(n, key_len, dtype=torch.float32, device=query.device)
            o = attend_explicit(q, k, v, c, scale, soft_cap, alibi_slopes, key_mass)
            if key_mass is not None:
                _add_block_mass(block_mass, key_mass, c, bs)
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
        if c.out_range is not None:
            out[c.out_range[0] : c.out_range[1]] = rows
            continue
        if c.src_rows is not None:
            rows = rows.index_select(0, c.src_rows)
        out.index_copy_(0, c.out_index, rows)
    return out


def _add_block_mass(block_mass: torch.Tensor, key_mass: torch.Tensor, c, bs: int) -> None:
    """Fold a chunk's per-key mass [n, key_len] into blocks and add it at (request, column)."""
    per_block = key_mass.view(c.num_reqs, c.num_blocks, bs).sum(-1).reshape(-1)
    index = c.req_index[:, None] * block_mass.shape[1] + c.block_cols  # [n, nb]
    index = torch.from_numpy(index.reshape(-1)).to(block_mass.device)
    block_mass.view(-1).index_add_(0, index, per_block)
