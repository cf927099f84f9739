"""The torch twins' chunked schedule and chunk attention, shared by the plain and quantized twin.

``twin_chunks`` cuts a step's requests into chunks of about a byte budget of gathered K and V
(``build_chunks``; built once per step and window, cached in the metadata). A twin loads each
chunk's K and V its own way (a gather of model-dtype blocks, or a decode of quantized ones)
and ``attend_chunk`` does the rest: zeroing of the rows past each sequence's end (the cache may
hold anything there, NaN included), one fused ``scaled_dot_product_attention`` (GQA without
repeating K/V) or the explicit path, and the write into the output. ``attend_explicit`` is the
fp32 soft-cap / ALiBi path (and the one that measures attention mass: SDPA does not return its
probabilities): per chunk the probabilities are summed over heads and query rows into a
per-key vector, folded into blocks and added to ``block_mass`` with one ``index_add_``.

Released blocks (null entries inside a sequence's range, ``plan`` module doc) are not gathered:
each request's live blocks are packed to the front of its key range, with their logical
positions in ``k_pos``, so a policy that keeps 1K of 8K tokens gathers about 1K keys. A table
without null entries takes the contiguous layout, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvcore_kernels.checks import AttentionCall
from kvcore_kernels.plan import AttentionMetadata

# Gathered K+V bytes per chunk and per thread: the chunk is read back while still in cache.
# On a 2-core Xeon (2 MiB L2 per core) 1.5 to 6 MiB ran alike when idle and 24 MiB twice as
# slow; the larger sizes make fewer parallel regions, which is what a loaded machine punishes.
CHUNK_BYTES_PER_THREAD = 4 << 20
# A chunk's padded work (requests x longest query x longest key) stays under this many times
# its real work: a new chunk starts before a request that would pad it further.
MAX_PAD_RATIO = 1.5
# Score elements per slice of the explicit (soft-cap / ALiBi) path.
MAX_SCORE_ELEMENTS = 1 << 24


@dataclass(eq=False)
class TwinChunk:
    """A set of requests attended together, padded to common query and key lengths."""

    num_reqs: int
    q_max: int
    num_blocks: int  # blocks gathered per request (key length = num_blocks * block_size)
    blocks: torch.Tensor  # int64 [num_reqs * num_blocks] block ids (0 past a request's end)
    block_cols: np.ndarray  # int64 [num_reqs, num_blocks] logical block (table column) of each
    req_index: np.ndarray  # int64 [num_reqs] the chunk's requests (rows of the block table)
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
    q_real: torch.Tensor | None  # bool [num_reqs, q_max] real query rows; None: all are real
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


def twin_chunks(meta: AttentionMetadata, window: int | None, bytes_per_key: int) -> list[TwinChunk]:
    """The step's chunks for ``window``, each of about ``CHUNK_BYTES_PER_THREAD`` per thread
    of loaded K and V (``bytes_per_key``: one key's K and V as the twin holds them); built once
    per step, window and budget, cached in the metadata."""
    budget = max(1, CHUNK_BYTES_PER_THREAD * torch.get_num_threads() // bytes_per_key)
    key = ("torch", window, budget)
    if key not in meta.cache:
        meta.cache[key] = build_chunks(meta, window, budget)
    return meta.cache[key]


def attend_chunk(query: torch.Tensor, c: TwinChunk, kv: torch.Tensor, call: AttentionCall) -> None:
    """Attend chunk ``c``'s queries over its loaded ``kv`` (``[n, 2, key_len, Hk, D]`` in the
    query's dtype, K then V; the rows past each sequence's end are zeroed here) and write the
    real rows into ``call.out`` (and add their mass to ``call.block_mass``)."""
    n, hq, d = c.num_reqs, query.shape[1], query.shape[2]
    key_len = kv.shape[2]
    if c.pad_rows is not None:
        kv.view(2 * n * key_len, -1).index_fill_(0, c.pad_rows, 0)
    k, v = kv[:, 0], kv[:, 1]  # [n, key_len, Hk, D] each
    if c.q_range is not None:
        q = query[c.q_range[0] : c.q_range[1]].unflatten(0, (n, c.q_max))  # a view
    else:
        q = query.index_select(0, c.q_index).view(n, c.q_max, hq, d)
    mass = call.block_mass
    if call.soft_cap is not None or call.alibi_slopes is not None or mass is not None:
        key_mass = None
        if mass is not None:
            key_mass = torch.zeros(n, key_len, dtype=torch.float32, device=query.device)
        o = attend_explicit(q, k, v, c, call.scale, call.soft_cap, call.alibi_slopes, key_mass)
        if key_mass is not None:
            _add_block_mass(mass, key_mass, c, key_len // c.num_blocks)
    else:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=c.mask_as(query.dtype),
            is_causal=c.is_causal,
            scale=call.scale,
            enable_gqa=hq != k.shape[2],
        ).transpose(1, 2)  # [n, q_max, Hq, D]
    rows = o.reshape(n * c.q_max, hq, d)
    if c.out_range is not None:
        call.out[c.out_range[0] : c.out_range[1]] = rows
        return
    if c.src_rows is not None:
        rows = rows.index_select(0, c.src_rows)
    call.out.index_copy_(0, c.out_index, rows)


def _add_block_mass(block_mass: torch.Tensor, key_mass: torch.Tensor, c, bs: int) -> None:
    """Fold a chunk's per-key mass [n, key_len] into blocks and add it at (request, column)."""
    per_block = key_mass.view(c.num_reqs, c.num_blocks, bs).sum(-1).reshape(-1)
    index = c.req_index[:, None] * block_mass.shape[1] + c.block_cols  # [n, nb]
    index = torch.from_numpy(index.reshape(-1)).to(block_mass.device)
    block_mass.view(-1).index_add_(0, index, per_block)


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
    live = None  # bool [num_reqs, max_blocks]: the blocks a request reads (released ones not)
    if meta.num_released:
        col = np.arange(table.shape[1])[None, :]
        live = (col >= first_blk[:, None]) & (col <= last_blk[:, None]) & (table != 0)
        num_blk = live.sum(1)
    else:
        num_blk = last_blk - first_blk + 1
    active = np.flatnonzero(q_lens > 0)
    if len(active) == 0:
        return []
    extend = q_lens[active] > 1
    order = active[np.lexsort((num_blk[active], q_lens[active], extend))]
    budget_blocks = max(1, -(-budget_tokens // bs))
    starts = _cuts(q_lens[order].tolist(), num_blk[order].tolist(), budget_blocks)
    bounds = zip(starts, starts[1:] + [len(order)], strict=True)
    device = meta.device

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    chunks = []
    for lo, hi in bounds:
        rs = order[lo:hi]
        n = len(rs)
        q_max = int(q_lens[rs].max())
        nb = int(num_blk[rs].max())
        if live is None:
            cols = first_blk[rs, None] + np.arange(nb)  # [n, nb]
            in_seq = cols <= last_blk[rs, None]
            cols = np.minimum(cols, table.shape[1] - 1)
            k_pos = first_blk[rs, None] * bs + np.arange(nb * bs)  # [n, key_len]
        else:  # live blocks first, in order; padding keys after every position (masked)
            cols = np.argsort(~live[rs], axis=1, kind="stable")[:, :nb]  # [n, nb]
            in_seq = np.take_along_axis(live[rs], cols, 1)
            k_pos = (cols[:, :, None] * bs + np.arange(bs)).reshape(n, nb * bs)
            pad_pos = lens[rs, None] + np.arange(nb * bs)
            k_pos = np.where(np.repeat(in_seq, bs, axis=1), k_pos, pad_pos)
        blocks = np.where(in_seq, table[rs[:, None], cols], 0)
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
                block_cols=np.where(in_seq, cols, 0),
                req_index=rs,
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
                q_real=None if len(rows) == n * q_max else dev(q_real).bool(),
            )
        )
    return chunks


def _cuts(q_lens: list[int], num_blk: list[int], budget_blocks: int) -> list[int]:
    """First row of each chunk over rows sorted (decodes, then extends; by query length, then
    blocks). A chunk ends at the decode/extend boundary, once its blocks reach the budget, or
    when the next row would pad it past ``MAX_PAD_RATIO`` times its real work: every request
    of a chunk is padded to its longest query and key, so decodes of 100 and 600 tokens in one
    chunk would gather, zero and attend 600 keys for each (the step profile in
    docs/serving.md). Bounding the padding is length bucketing (as in batching sequences of
    similar lengths for training), at the price of a few more chunks per step."""
    starts = [0]
    q_max = real = blocks = 0
    nb_max = 0
    for j, (q, nb) in enumerate(zip(q_lens, num_blk, strict=True)):
        n = j - starts[-1]
        if n:
            padded = (n + 1) * max(q_max, q) * max(nb_max, nb)
            if (
                (q > 1) != (q_lens[j - 1] > 1)
                or blocks >= budget_blocks
                or padded > MAX_PAD_RATIO * (real + q * nb)
            ):
                starts.append(j)
                q_max = real = blocks = nb_max = 0
        q_max, nb_max = max(q_max, q), max(nb_max, nb)
        real += q * nb
        blocks += nb
    return starts


def _as_range(index: np.ndarray) -> tuple[int, int] | None:
    """(lo, hi) if ``index`` is lo, lo+1, ..., hi-1: a slice then replaces gather / scatter."""
    lo = int(index[0])
    if np.array_equal(index, np.arange(lo, lo + len(index))):
        return lo, lo + len(index)
    return None


def attend_explicit(
    q: torch.Tensor,  # [n, q_max, Hq, D]
    k: torch.Tensor,  # [n, key_len, Hk, D]
    v: torch.Tensor,  # [n, key_len, Hk, D]
    chunk: TwinChunk,
    scale: float,
    soft_cap: float | None,
    alibi_slopes: torch.Tensor | None,
    key_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 attention with soft-cap / ALiBi; returns [n, q_max, Hq, D] in q's dtype.

    ``key_mass`` (fp32 [n, key_len]), if given, gets each key's attention probability added,
    summed over the query heads and the real query rows (H2O's accumulated attention)."""
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
        p = torch.softmax(s, dim=-1)  # [n, Hq, m, key_len]
        if key_mass is not None:
            rows_p = p if chunk.q_real is None else p * chunk.q_real[:, None, lo:hi, None]
            key_mass += rows_p.sum(dim=(1, 2))
        p = p.view(n, hk, r * m, key_len)
        o = torch.matmul(p, vt).view(n, hk, r, m, d)  # [n, Hk, R, m, D]
        out[:, lo:hi] = o.permute(0, 3, 1, 2, 4).reshape(n, m, hq, d)
    return out
