"""Pure-torch twin of the MLA kernels: the test oracle's peer and the CPU path.

Backend layer: imports the layout and checks (``mla.cache``) and the metadata (``plan``), never
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
from kvcore_kernels.mla.cache import (
    FP8_DTYPE,
    FP8_MAX,
    absorb_query,
    check_mla_args,
    check_store_latent_args,
    fp8_views,
    unabsorb_output,
)
from kvcore_kernels.plan import AttentionMetadata

# Gathered latent bytes per chunk and thread (as in the plain twin: the chunk stays in cache).
CHUNK_BYTES_PER_THREAD = 4 << 20
# The expanded form builds per-head K and V for a chunk's keys; past this many values (256 MiB
# in fp32) the chunk stays absorbed, whatever it would save.
MAX_EXPANDED_VALUES = 1 << 26


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
    """Write ``[c_kv | k_pe]`` rows into their slots (padding slots < block_size skipped);
    into an FP8 cache quantized with the block's scale (``_store_fp8``)."""
    layout = check_store_latent_args(c_kv, k_pe, cache, slot_mapping)
    num_blocks, block_size = layout.num_blocks, layout.block_size
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise KernelConfigError(
            f"slot {int(slots.max())} is past the cache's {num_blocks * block_size} slots"
        )
    keep = torch.nonzero(slots >= block_size).squeeze(1)
    if keep.numel() == 0:
        return
    rows = torch.cat((c_kv.index_select(0, keep), k_pe.index_select(0, keep)), dim=1)
    if layout.fp8:
        store_fp8_rows(rows, slots[keep], cache, block_size)
        return
    cache.view(num_blocks * block_size, -1).index_copy_(0, slots[keep], rows)


def store_fp8_rows(rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, bs: int) -> None:
    """Quantize ``rows`` [K, W] into FP8 ``cache`` rows at ``slots`` (all real) in place.

    Per-block scale, amax / 448. A step that writes offset 0 of a block starts the block afresh
    (blocks fill from offset 0; a block continued past a prefix hit was copied with its scale).
    Otherwise the scale only grows: when this step's tokens exceed it, the block's earlier codes
    are re-quantized to the new scale (one more rounding for them, bounded by FP8's step)."""
    width = rows.shape[1]
    blocks = torch.div(slots, bs, rounding_mode="floor")
    offsets = slots - blocks * bs
    uniq, inv = torch.unique(blocks, return_inverse=True)
    vals = rows.float()
    amax = torch.zeros(len(uniq), dtype=torch.float32, device=rows.device)
    amax.scatter_reduce_(0, inv, vals.abs().amax(dim=1), "amax")
    fresh = torch.zeros(len(uniq), dtype=torch.bool, device=rows.device)
    fresh[inv[offsets == 0]] = True
    block_rows = cache.index_select(0, uniq)  # [U, row_bytes] copy
    old_scale, codes = fp8_views(block_rows, bs, width)
    old = torch.where(fresh, torch.zeros_like(old_scale), old_scale)
    new = torch.maximum(old, amax / FP8_MAX)
    new = torch.where(new > 0, new, torch.ones_like(new))  # an all-zero block: any scale
    grown = (new != old) & ~fresh & (old > 0)
    if bool(grown.any()):
        ratio = torch.where(grown, old / new, torch.ones_like(new))
        codes.copy_((codes.float() * ratio[:, None, None]).to(FP8_DTYPE))
    codes[inv, offsets] = (vals / new[inv, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    old_scale.copy_(new)
    cache.index_copy_(0, uniq, block_rows)


def load_latent_blocks(
    cache: torch.Tensor, blocks: torch.Tensor, bs: int, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """The latent rows of ``blocks``: [len(blocks), bs, width] in ``dtype`` (FP8 dequantized).

    The one part that differs between the latent layouts; the rest of the twin is shared."""
    if cache.dtype != torch.uint8:
        return cache.view(cache.shape[0], bs * width).index_select(0, blocks).view(-1, bs, width)
    scales, codes = fp8_views(cache.index_select(0, blocks), bs, width)
    return codes.to(dtype) * scales.to(dtype)[:, None, None]


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
        out = torch.empty((meta.num_tokens, h, v), dtype=s.dtype, device=cache.device)
    width, dtype = r + rope, s.dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    budget = max(1, CHUNK_BYTES_PER_THREAD * torch.get_num_threads() // (width * itemsize))
    key = ("mla_torch", budget)
    chunks = meta.cache.get(key)
    if chunks is None:
        chunks = meta.cache[key] = build_latent_chunks(meta, budget)
    if not cache.is_contiguous():
        raise KernelConfigError("the torch MLA backend needs a contiguous latent cache")
    w_uk_t = w_uv_t = None
    for c in chunks:
        n, qm, kl = c.num_reqs, c.q_max, c.key_len
        lat = load_latent_blocks(cache, c.blocks, bs, width, dtype).view(n, kl, width)
        if c.pad_rows is not None:
            lat.view(n * kl, width).index_fill_(0, c.pad_rows, 0)
        qn = q_nope.index_select(0, c.q_index)  # [n * q_max, H, nope]
        qp = q_pe.index_select(0, c.q_index)
        if force is None:  # decode is always absorbed: one query never pays for an up-projection
            expand = (
                qm > 1
                and n * kl * h * (nope + rope + v) <= MAX_EXPANDED_VALUES
                and expand_pays(r, nope, v, rope, qm, kl)
            )
        else:
            expand = force == "expanded"
        if expand:
            if w_uk_t is None:  # [r, H * nope] and [r, H * v]: one matmul up-projects
                w_uk_t = w_uk.reshape(h * nope, r).t()
                w_uv_t = w_uv.reshape(h * v, r).t()
            lat_c = lat[:, :, :r]
            k = torch.empty((n, kl, h, nope + rope), dtype=dtype, device=cache.device)
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
                attn_mask=None if c.is_causal else c.additive_mask(dtype, 1),
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
                attn_mask=c.additive_mask(dtype, h if qm > 1 else 1),
                is_causal=False,
                scale=float(scale),
            )  # [n, 1, q_max * H, width]
            rows = unabsorb_output(o[..., :r].reshape(n * qm, h, r), w_uv)
        if c.src_rows is not None:
            rows = rows.index_select(0, c.src_rows)
        out.index_copy_(0, c.out_index, rows)
    return out
