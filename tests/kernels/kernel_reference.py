"""Test support: random paged batches with NaN-poisoned free slots, and a float64 dense oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One step's inputs plus the dense per-request K/V the oracle reads."""

    query: torch.Tensor  # [num_tokens, Hq, D]
    kv_cache: torch.Tensor  # [num_blocks, 2, block_size, Hk, D]; unused slots NaN
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    block_size: int
    keys: list[torch.Tensor]  # per request [seq_len, Hk, D]
    values: list[torch.Tensor]


def make_batch(
    gen: torch.Generator,
    reqs: list[tuple[int, int]],  # (cached tokens before this step, query tokens)
    *,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
    extra_blocks: int = 3,
    extra_columns: int = 1,
) -> Batch:
    """Random batch: blocks shuffled over the pool, free slots and the null block NaN."""
    seq_lens = [c + q for c, q in reqs]
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = 1 + sum(need) + extra_blocks
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(need, default=0) + extra_columns
    table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    cache = torch.full(
        (num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    keys, values = [], []
    for r, s in enumerate(seq_lens):
        blocks = [ids.pop() for _ in range(need[r])]
        table[r, : need[r]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(s)
        where = (torch.tensor(blocks, dtype=torch.int64)[pos // block_size], pos % block_size)
        cache[:, 0].index_put_(where, k)
        cache[:, 1].index_put_(where, v)
        keys.append(k)
        values.append(v)
    q_lens = torch.tensor([q for _, q in reqs], dtype=torch.int32)
    qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(qsl[-1]), num_q_heads, head_dim, generator=gen).to(dtype)
    return Batch(
        query=query.to(device),
        kv_cache=cache.to(device),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        block_size=block_size,
        keys=keys,
        values=values,
    )


def reference_attention(
    batch: Batch,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 softmax attention of each request's queries over its dense K/V (causal)."""
    q_all = batch.query.cpu().double()
    num_q_heads = q_all.shape[1]
    out = torch.full_like(q_all, float("nan"))
    qsl = batch.query_start_loc.tolist()
    for r, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        lo, hi = qsl[r], qsl[r + 1]
        if hi == lo:
            continue
        seq_len = k.shape[0]
        group = num_q_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # [seq, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        q = q_all[lo:hi]  # [q_len, Hq, D]
        q_pos = torch.arange(seq_len - (hi - lo), seq_len)[:, None]  # [q_len, 1]
        k_pos = torch.arange(seq_len)[None, :]  # [1, seq]
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        if alibi_slopes is not None:
            s = s + alibi_slopes.cpu().double()[:, None, None] * (k_pos - q_pos)[None]
        ok = k_pos <= q_pos
        if sliding_window is not None:
            ok &= q_pos - k_pos < sliding_window
        s = s.masked_fill(~ok[None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out


def triton_interpreted() -> bool:
    """Whether the Triton kernels run here on CPU tensors (built under TRITON_INTERPRET=1)."""
    try:
        from kvcore_kernels.paged_triton import paged_attention_kernel
        from kvcore_kernels.triton_util import is_interpreted
    except ImportError:
        return False
    return is_interpreted(paged_attention_kernel)
