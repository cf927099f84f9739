"""Pure-torch twin of the Triton paged attention: the test oracle's peer and the CPU path.

Requests are sorted (decode first, then by query length and blocks needed) and cut into
chunks whose gathered K and V fit in the CPU's L2 caches. Per chunk and layer: one
``index_select`` of whole blocks into a small buffer that stays in cache, zeroing of the few
rows past each sequence's end (the cache may hold anything there, NaN included), one fused
``scaled_dot_product_attention`` (GQA without repeating K/V), one ``index_copy_`` into the
output. The loop is over chunks, never over requests or blocks; the gather indices and masks
of every chunk are built once per step (per sliding window) and cached in the metadata.

Soft-capping and ALiBi do not fit SDPA (a non-linearity on the scores; a bias that needs fp32),
so they take an explicit fp32 path, sliced over query rows to bound the score tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvcore_kernels.attention import check_attention_args
from kvcore_kernels.plan import AttentionMetadata

# Gathered K+V bytes per chunk and per thread: the chunk is read back while still in cache.
# On a 2-core Xeon (2 MiB L2 per core) 1.5 to 6 MiB ran alike when idle and 24 MiB twice as
# slow; the larger sizes make fewer parallel regions, which is what a loaded machine punishes.
CHUNK_BYTES_PER_THREAD = 4 << 20
# Score elements per slice of the explicit (soft-cap / ALiBi) path.
MAX_SCORE_ELEMENTS = 1 << 24


@dataclass(eq=False)
class TwinChunk:
    """A set of requests attended together, padded to common query and key lengths."""

    num_reqs: int
    q_max: int
    num_blocks: int  # blocks gathered per request (key length = num_blocks * block_size)
    blocks: torch.Tensor  # int64 [num_reqs * num_blocks] block ids (0 past a request's end)
    kv_rows: torch.Tensor  # int64 [num_reqs * 2 * num_blocks] rows of the cache seen as
    #   [num_blocks * 2, block_size * Hk * D], ordered (request, K/V, block): one gather then
    #   leaves each request's K (and V) as one contiguous [key_len, Hk, D] run
    q_index: torch.Tensor  # int64 [num_reqs * q_max] packed token of each padded query row
    out_index: torch.Tensor  # int64 [num_rows] destination token of each real query row
    src_rows: torch.Tensor | None  # int64 [num_rows] its padded row; None when all rows are real
    pad_rows: torch.Tensor | None  # int64 [P] gathered K and V rows past seq_len (zeroed)
    q_range: tuple[int, int] | None  # the query rows are packed tokens lo..hi-1 (no gather)
    out_range: tuple[int, int] | None  # the real rows go to packed tokens lo..hi-1 (no scatter)
    q_pos: torch.Tensor  # int64 [num_reqs, q_max] position of each query row
    k_pos: torch.Tensor  # int64 [num_reqs, key_len] position of each gathered key
    window: int | None
    mask: torch.Tensor | None  # float32 [num_reqs, 1, q_max, key_len] 0 / -inf; None: no mask
    is_causal: bool  # one fresh prefill: SDPA's own (top-left) causal mask is exact
    masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive mask in ``dtype`` (SDPA wants the query's), converted once."""
        if self.mask is None or dtype == torch.float32:
            return self.mask
        if dtype not in self.masks:
            self.masks[dtype] = self.mask.to(dtype)
        return self.masks[dtype]

    def allowed(self, lo: int, hi: int) -> torch.Tensor:
        """bool [num_reqs, 1, hi - lo, key_len]: which keys query rows lo..hi-1 may see."""
        q = self.q_pos[:, lo:hi, None]
        ok = self.k_pos[:, None, :] <= q
        if self.window is not None:
            ok &= q - self.k_pos[:, None, :] < self.window
        return ok[:, None]


def build_chunks(
    meta: AttentionMetadata, window: int | None, budget_tokens: int
) -> list[TwinChunk]:
    """Cut the step's requests into chunks of about ``budget_tokens`` gathered keys each."""
    bs = meta.block_size
    qsl, lens, table = meta.host_query_start_loc, meta.host_seq_lens, meta.host_block_table
    q_lens = np.diff(qsl)
    ctx = lens - q_lens
    first_key = np.maximum(ctx - window + 1, 0) if window is not None else np.zeros_like(ctx)
    first_blk = first_key // bs
    last_blk = (lens - 1) // bs
    num_blk = last_blk - first_blk + 1
    active = np.flatnonzero(q_lens > 0)
    if len(active) == 0:
        return []
    extend = q_lens[active] > 1
    order = active[np.lexsort((num_blk[active], q_lens[active], extend))]
    extend = q_lens[order] > 1
    cost = num_blk[order] * bs
    # Exclusive running cost within each group (decode, extend), cut every budget_tokens.
    cum = np.cumsum(cost) - cost
    n_dec = int((~extend).sum())
    if n_dec < len(order):
        cum[n_dec:] -= cum[n_dec]
    key = cum // budget_tokens
    cut = (key[1:] != key[:-1]) | (extend[1:] != extend[:-1])
    starts = np.flatnonzero(np.r_[True, cut])
    bounds = zip(starts, np.r_[starts[1:], len(order)], strict=True)
    device = meta.device

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    chunks = []
    for lo, hi in bounds:
        rs = order[lo:hi]
        n = len(rs)
        q_max = int(q_lens[rs].max())
        nb = int(num_blk[rs].max())
        cols = first_blk[rs, None] + np.arange(nb)  # [n, nb]
        in_seq = cols <= last_blk[rs, None]
        blocks = np.where(in_seq, table[rs[:, None], np.minimum(cols, table.shape[1] - 1)], 0)
        k_pos = first_blk[rs, None] * bs + np.arange(nb * bs)  # [n, key_len]
        q_pos = ctx[rs, None] + np.arange(q_max)  # [n, q_max]
        q_real = np.arange(q_max) < q_lens[rs, None]  # [n, q_max]
        ok = k_pos[:, None, :] <= q_pos[:, :, None]  # [n, q_max, key_len]
        if window is not None:
            ok &= q_pos[:, :, None] - k_pos[:, None, :] < window
        ok |= ~q_real[:, :, None]  # padded query rows: anything finite, they are dropped
        fresh = bool(n == 1 and q_max > 1 and ctx[rs[0]] == 0 and window is None)
        mask = None
        if not fresh and not ok.all():
            mask = torch.from_numpy(np.where(ok, 0.0, -np.inf).astype(np.float32))
            mask = mask[:, None].to(device)
        kv_rows = blocks[:, None, :] * 2 + np.arange(2)[None, :, None]  # [n, 2, nb]
        pad_req, pad_pos = np.nonzero(k_pos >= lens[rs, None])
        pad = np.r_[2 * pad_req * nb * bs + pad_pos, (2 * pad_req + 1) * nb * bs + pad_pos]
        rows = np.flatnonzero(q_real)
        q_index = (qsl[rs, None] + np.minimum(np.arange(q_max), q_lens[rs, None] - 1)).reshape(-1)
        out_index = (qsl[rs, None] + np.arange(q_max)).reshape(-1)[rows]
        chunks.append(
            TwinChunk(
                num_reqs=n,
                q_max=q_max,
                num_blocks=nb,
                blocks=dev(blocks.reshape(-1)),
                kv_rows=dev(kv_rows.reshape(-1)),
                q_index=dev(q_index),
                out_index=dev(out_index),
                src_rows=None if len(rows) == n * q_max else dev(rows),
                q_range=_as_range(q_index),
                out_range=_as_range(out_index) if len(rows) == n * q_max else None,
                pad_rows=dev(pad) if len(pad) else None,
                q_pos=dev(q_pos),
                k_pos=dev(k_pos),
                window=window,
                mask=mask,
                is_causal=fresh,
            )
        )
    return chunks


def _as_range(index: np.ndarray) -> tuple[int, int] | None:
    """(lo, hi) if ``index`` is lo, lo+1, ..., hi-1: a slice then replaces gather / scatter."""
    lo = int(index[0])
    if np.array_equal(index, np.arange(lo, lo + len(index))):
        return lo, lo + len(index)
    return None


def _attend_explicit(
    q: torch.Tensor,  # [n, q_max, Hq, D]
    k: torch.Tensor,  # [n, key_len, Hk, D]
    v: torch.Tensor,  # [n, key_len, Hk, D]
    chunk: TwinChunk,
    scale: float,
    soft_cap: float | None,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 attention with soft-cap / ALiBi; returns [n, q_max, Hq, D] in q's dtype."""
    n, q_max, hq, d = q.shape
    key_len, hk = k.shape[1], k.shape[2]
    r = hq // hk
    kt = k.float().permute(0, 2, 3, 1)  # [n, Hk, D, key_len]
    vt = v.float().permute(0, 2, 1, 3)  # [n, Hk, key_len, D]
    out = torch.empty(n, q_max, hq, d, dtype=q.dtype, device=q.device)
    step = max(1, MAX_SCORE_ELEMENTS // max(1, n * hq * key_len))
    for lo in range(0, q_max, step):
        hi = min(q_max, lo + step)
        m = hi - lo
        qs = q[:, lo:hi].float().view(n, m, hk, r, d).permute(0, 2, 3, 1, 4)  # [n,Hk,R,m,D]
        s = torch.matmul(qs.reshape(n, hk, r * m, d), kt).view(n, hq, m, key_len) * scale
        if soft_cap is not None:
            s = torch.tanh(s / soft_cap) * soft_cap
        if alibi_slopes is not None:
            rel = chunk.k_pos[:, None, None, :] - chunk.q_pos[:, None, lo:hi, None]
            s = s + alibi_slopes.view(1, hq, 1, 1) * rel.float()
        s = s.masked_fill(~chunk.allowed(lo, hi), float("-inf"))
        p = torch.softmax(s, dim=-1).view(n, hk, r * m, key_len)
        o = torch.matmul(p, vt).view(n, hk, r, m, d)  # [n, Hk, R, m, D]
        out[:, lo:hi] = o.permute(0, 3, 1, 2, 4).reshape(n, m, hq, d)
    return out


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
) -> torch.Tensor:
    """Pure-torch ``paged_attention`` (same contract as ``paged_attention_triton``)."""
    shape = check_attention_args(
        query, kv_cache, meta, scale, sliding_window, soft_cap, alibi_slopes, out
    )
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
    explicit = soft_cap is not None or alibi_slopes is not None
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
            o = _attend_explicit(q, k, v, c, scale, soft_cap, alibi_slopes)
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
