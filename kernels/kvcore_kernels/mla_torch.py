"""Pure-torch twin of the MLA kernels: the test oracle's peer and the CPU path.

Backend layer: imports the layout and checks (``mla_cache``) and the metadata (``plan``), never
the dispatcher. Requests are sorted (decode first, then by query length and blocks needed) and cut
into chunks of about ``budget`` gathered latent rows. Per chunk and layer: one ``index_select``
of whole blocks, zeroing of the rows past each sequence's end (free slots may hold anything, NaN
included), then one of two forms, picked per chunk by counting multiply-adds:

* absorbed (decode, short chunks): the chunk's queries ``[q_nope W_uk | q_pe]`` attend over the
  latent rows as ONE key/value head (MQA with ``q_len * H`` query rows); the value is the row
  itself, so SDPA's fused kernel runs (its output's ``k_pe`` columns are dropped), then ``W_uv``.
* expanded (long prefill chunks): the chunk's latents are up-projected to per-head K and V and
  attended as usual; cheaper once a chunk has more than about ``r (nope + v) / (2r - nope - v)``
  queries per key (DeepSeek-V3: ~170; the tiny test models: ~64).

Gather indices and masks are built once per step and cached in the metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.mla_cache import (
    absorb_query,
    check_mla_args,
    check_store_latent_args,
    unabsorb_output,
)
from kvcore_kernels.plan import AttentionMetadata

# Gathered latent bytes per chunk and thread (as in the plain twin: the chunk stays in cache).
CHUNK_BYTES_PER_THREAD = 4 << 20


@dataclass(eq=False)
class LatentChunk:
    """Requests attended together, padded to common query and key lengths."""

    num_reqs: int
    q_max: int
    key_len: int  # gathered keys per request (whole blocks)
    blocks: torch.Tensor  # int64 [num_reqs * num_blocks] (0 past a request's end)
    q_index: torch.Tensor  # int64 [num_reqs * q_max] packed token of each padded query row
    out_index: torch.Tensor  # int64 [num_rows] destination token of each real query row
    src_rows: torch.Tensor | None  # int64 [num_rows] its padded row; None when all are real
    pad_rows: torch.Tensor | None  # int64 [P] gathered rows past seq_len (zeroed)
    mask: torch.Tensor | None  # bool [num_reqs, 1, q_max, key_len] True = may attend
    is_causal: bool  # one fresh prefill: SDPA's (top-left) causal mask is exact for the
    #   expanded form (the absorbed form's rows are (token, head) pairs and use ``mask``)
    masks: dict = field(default_factory=dict)  # (dtype, heads) -> additive mask

    def additive_mask(self, dtype: torch.dtype, heads: int) -> torch.Tensor | None:
        """The mask as 0 / -inf in ``dtype``; ``heads`` > 1 repeats each query row per head."""
        if self.mask is None:
            return None
        key = (dtype, heads)
        if key not in self.masks:
            m = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            m.masked_fill_(~self.mask, float("-inf"))
            if heads > 1:  # rows (token, head), token-major
                n, _, q, k = m.shape
                m = m[:, :, :, None, :].expand(n, 1, q, heads, k).reshape(n, 1, q * heads, k)
            self.masks[key] = m
        return self.masks[key]


def build_latent_chunks(meta: AttentionMetadata, budget: int) -> list[LatentChunk]:
    """Cut the step's requests into chunks of about ``budget`` gathered rows each."""
    bs = meta.block_size
    qsl, lens, table = meta.host_query_start_loc, meta.host_seq_lens, meta.host_block_table
    q_lens = np.diff(qsl)
    ctx = lens - q_lens
    num_blk = (lens + bs - 1) // bs
    active = np.flatnonzero(q_lens > 0)
    if len(active) == 0:
        return []
    extend = q_lens[active] > 1
    order = active[np.lexsort((num_blk[active], q_lens[active], extend))]
    extend = q_lens[order] > 1
    cost = num_blk[order] * bs
    cum = np.cumsum(cost) - cost
    n_dec = int((~extend).sum())
    if n_dec < len(order):
        cum[n_dec:] -= cum[n_dec]
    key = cum // max(1, budget)
    cut = (key[1:] != key[:-1]) | (extend[1:] != extend[:-1])
    starts = np.flatnonzero(np.r_[True, cut])
    device = meta.device

    def dev(a: np.ndarray, dtype: type = np.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device)

    chunks = []
    for lo, hi in zip(starts, np.r_[starts[1:], len(order)], strict=True):
        rs = order[lo:hi]
        n = len(rs)
        q_max = int(q_lens[rs].max())
        nb = int(num_blk[rs].max())
        cols = np.arange(nb)
        blocks = np.where(
            cols < num_blk[rs, None], table[rs[:, None], np.minimum(cols, table.shape[1] - 1)], 0
        )
        key_len = nb * bs
        k_pos = np.arange(key_len)
        q_pos = ctx[rs, None] + np.arange(q_max)  # [n, q_max]
        q_real = np.arange(q_max) < q_lens[rs, None]
        ok = k_pos[None, None, :] <= q_pos[:, :, None]  # [n, q_max, key_len]
        ok |= ~q_real[:, :, None]  # padded query rows: anything finite, they are dropped
        fresh = bool(n == 1 and q_max > 1 and ctx[rs[0]] == 0)
        mask = None if ok.all() else dev(ok[:, None], np.bool_)
        pad_req, pad_pos = np.nonzero(k_pos[None, :] >= lens[rs, None])
        rows = np.flatnonzero(q_real)
        q_index = (qsl[rs, None] + np.minimum(np.arange(q_max), q_lens[rs, None] - 1)).reshape(-1)
        out_index = (qsl[rs, None] + np.arange(q_max)).reshape(-1)[rows]
        chunks.append(
            LatentChunk(
                num_reqs=n,
                q_max=q_max,
                key_len=key_len,
                blocks=dev(blocks.reshape(-1)),
                q_index=dev(q_index),
                out_index=dev(out_index),
                src_rows=None if len(rows) == n * q_max else dev(rows),
                pad_rows=dev(pad_req * key_len + pad_pos) if len(pad_req) else None,
                mask=mask,
                is_causal=fresh,
            )
        )
    return chunks


def expand_pays(shape_r: int, nope: int, v: int, rope: int, q_len: int, key_len: int) -> bool:
    """Whether up-projecting a chunk's keys costs fewer multiply-adds than the absorbed form."""
    absorbed = q_len * key_len * (2 * shape_r + rope) + q_len * shape_r * (nope + v)
    expanded = key_len * shape_r * (nope + v) + q_len * key_len * (2 * (nope + rope))
    return expanded < absorbed


def store_latent_torch(
    c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``[c_kv | k_pe]`` rows into their slots (padding slots < block_size skipped)."""
    num_blocks, block_size, r = check_store_latent_args(c_kv, k_pe, cache, slot_mapping)
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise KernelConfigError(
            f"slot {int(slots.max())} is past the cache's {num_blocks * block_size} slots"
        )
    keep = torch.nonzero(slots >= block_size).squeeze(1)
    if keep.numel() == 0:
        return
    flat = cache.view(num_blocks * block_size, -1)
    rows = torch.cat((c_kv.index_select(0, keep), k_pe.index_select(0, keep)), dim=1)
    flat.index_copy_(0, slots[keep], rows)


def mla_attention_torch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    force: str | None = None,
) -> torch.Tensor:
    """Pure-torch ``mla_attention`` (same contract as the Triton one); returns [T, H, v].

    ``force``: "absorbed" or "expanded" for every chunk (tests, measurements); None picks per
    chunk by cost."""
    s = check_mla_args(q_nope, q_pe, cache, meta, w_uk, w_uv, scale, out)
    if force not in (None, "absorbed", "expanded"):
        raise KernelConfigError(f"force must be None, 'absorbed' or 'expanded', got {force!r}")
    h, r, rope, nope, v, bs = (
        s.num_heads, s.kv_lora_rank, s.rope_dim, s.nope_dim, s.v_dim, s.block_size,
    )  # fmt: skip
    if out is None:
        out = torch.empty((meta.num_tokens, h, v), dtype=cache.dtype, device=cache.device)
    width = r + rope
    budget = max(
        1, CHUNK_BYTES_PER_THREAD * torch.get_num_threads() // (width * cache.element_size())
    )
    key = ("mla_torch", budget)
    chunks = meta.cache.get(key)
    if chunks is None:
        chunks = meta.cache[key] = build_latent_chunks(meta, budget)
    if not cache.is_contiguous():
        raise KernelConfigError("the torch MLA backend needs a contiguous latent cache")
    flat = cache.view(cache.shape[0], bs * width)  # one row per block
    w_uk_t = w_uv_t = None
    for c in chunks:
        n, qm, kl = c.num_reqs, c.q_max, c.key_len
        lat = flat.index_select(0, c.blocks).view(n, kl, width)
        if c.pad_rows is not None:
            lat.view(n * kl, width).index_fill_(0, c.pad_rows, 0)
        qn = q_nope.index_select(0, c.q_index)  # [n * q_max, H, nope]
        qp = q_pe.index_select(0, c.q_index)
        if force is None:  # decode is always absorbed: one query never pays for an up-projection
            expand = qm > 1 and expand_pays(r, nope, v, rope, qm, kl)
        else:
            expand = force == "expanded"
        if expand:
            if w_uk_t is None:  # [r, H * nope] and [r, H * v]: one matmul up-projects
                w_uk_t = w_uk.reshape(h * nope, r).t()
                w_uv_t = w_uv.reshape(h * v, r).t()
            lat_c = lat[:, :, :r]
            k = torch.empty((n, kl, h, nope + rope), dtype=cache.dtype, device=cache.device)
            k[:, :, :, :nope] = torch.matmul(lat_c, w_uk_t).view(n, kl, h, nope)
            k[:, :, :, nope:] = lat[:, :, None, r:]
            vals = torch.matmul(lat_c, w_uv_t).view(n, kl, h, v)
            if v != nope + rope:  # SDPA's fused kernel wants one head dim: pad V with zeros
                vals = F.pad(vals, (0, nope + rope - v))
            q = torch.cat((qn, qp), dim=-1).view(n, qm, h, nope + rope)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                vals.transpose(1, 2),
                attn_mask=None if c.is_causal else c.additive_mask(cache.dtype, 1),
                is_causal=c.is_causal,
                scale=float(scale),
            )  # [n, H, q_max, nope + rope]
            rows = o[..., :v].transpose(1, 2).reshape(n * qm, h, v)
        else:
            q = absorb_query(qn, qp, w_uk).reshape(n, 1, qm * h, width)
            kv = lat[:, None]  # [n, 1, key_len, width]: K and (its first r columns) V
            o = F.scaled_dot_product_attention(
                q,
                kv,
                kv,
                attn_mask=c.additive_mask(cache.dtype, h if qm > 1 else 1),
                is_causal=False,
                scale=float(scale),
            )  # [n, 1, q_max * H, width]
            rows = unabsorb_output(o[..., :r].reshape(n * qm, h, r), w_uv)
        if c.src_rows is not None:
            rows = rows.index_select(0, c.src_rows)
        out.index_copy_(0, c.out_index, rows)
    return out
