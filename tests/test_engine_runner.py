"""The attention backend and ModelRunner on hand-built step plans, against plain transformers.

Until kvcore_kernels lands its kernels, a small local reference of the contract (store_kv,
plan_attention, paged_attention on ``[num_blocks, 2, block_size, kv_heads, head_dim]``) stands in.
"""

from types import SimpleNamespace

import kvcore_kernels
import numpy as np
import pytest
import torch
from kvcore.attention import CTX_KWARG, AttentionContext, register
from kvcore.model_runner import ModelRunner
from kvcore.models import tiny_llama


def _ref_allocate(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def _ref_store(key, value, cache, slot_mapping, *, backend="auto"):
    bs = cache.shape[2]
    keep = slot_mapping >= 0
    s = slot_mapping[keep]
    cache[s // bs, 0, s % bs] = key[keep]
    cache[s // bs, 1, s % bs] = value[keep]


def _ref_plan(query_start_loc, seq_lens, block_table, block_size, *, device=None):
    qsl, lens, bt = (torch.as_tensor(x) for x in (query_start_loc, seq_lens, block_table))
    return SimpleNamespace(qsl=qsl, seq_lens=lens, bt=bt, bs=block_size)


def _ref_attention(query, cache, meta, *, scale, sliding_window=None, soft_cap=None, **_):
    out = torch.empty_like(query)
    groups = query.shape[1] // cache.shape[3]
    for r in range(len(meta.seq_lens)):
        a, b = int(meta.qsl[r]), int(meta.qsl[r + 1])
        n = int(meta.seq_lens[r])
        blocks = meta.bt[r, : (n + meta.bs - 1) // meta.bs].long()
        k = cache[blocks, 0].reshape(-1, *cache.shape[3:])[:n].repeat_interleave(groups, 1)
        v = cache[blocks, 1].reshape(-1, *cache.shape[3:])[:n].repeat_interleave(groups, 1)
        q = query[a:b]
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        qpos = torch.arange(n - (b - a), n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(out.dtype)
    return out


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """Use the real kernels when present, else the local reference."""
    if not hasattr(kvcore_kernels, "paged_attention"):
        monkeypatch.setattr(kvcore_kernels, "allocate_kv_cache", _ref_allocate, raising=False)
        monkeypatch.setattr(kvcore_kernels, "store_kv", _ref_store, raising=False)
        monkeypatch.setattr(kvcore_kernels, "plan_attention", _ref_plan, raising=False)
        monkeypatch.setattr(kvcore_kernels, "paged_attention", _ref_attention, raising=False)


SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=97,
)


def _model():
    return tiny_llama(seed=0, **SMALL)


def test_kwarg_reaches_backend_and_missing_context_is_an_error():
    model = _model()
    register()
    model.set_attn_implementation("kvcore")
    with pytest.raises(Exception, match="step metadata"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    seen = {}

    def spy(module, q, k, v, mask, **kwargs):
        seen["ctx"], seen["mask"] = kwargs.get(CTX_KWARG), mask
        return q.transpose(1, 2), None

    from transformers import AttentionInterface

    AttentionInterface.register("kvcore-spy", spy)
    model.set_attn_implementation("kvcore-spy")
    ctx = AttentionContext([], torch.zeros(3, dtype=torch.long), None)
    model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False, **{CTX_KWARG: ctx})
    assert seen["ctx"] is ctx


def _plan(chunks, tables, block_size, computed):
    """A StepPlan for requests r running tokens chunks[r] after computed[r] cached tokens."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for toks, table, done in zip(chunks, tables, computed, strict=True):
        p = np.arange(done, done + len(toks))
        ids += toks
        pos += p.tolist()
        slots += (np.asarray(table)[p // block_size] * block_size + p % block_size).tolist()
        qsl.append(qsl[-1] + len(toks))
        lens.append(done + len(toks))
    width = max(len(t) for t in tables)
    bt = np.zeros((len(tables), width), np.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = t
    return SimpleNamespace(
        input_ids=np.array(ids, np.int64),
        positions=np.array(pos, np.int64),
        slot_mapping=np.array(slots, np.int64),
        query_start_loc=np.array(qsl, np.int32),
        seq_lens=np.array(lens, np.int32),
        block_table=bt,
        copy_ops=np.zeros((0, 2), np.int32),
    )


def test_packed_chunked_decode_matches_dense_forward():
    torch.manual_seed(0)
    model = _model()
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (5, 11, 3)]
    with torch.no_grad():
        dense = [model(torch.tensor([p]), use_cache=False).logits[0] for p in prompts]
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    tables = [[3, 7], [1, 9, 2], [5]]
    # Step 1: request 1 only partly (chunked prefill), the others whole.
    plan = _plan([prompts[0], prompts[1][:6], prompts[2]], tables, 4, [0, 0, 0])
    qsl = plan.query_start_loc
    logits = runner.execute(plan, qsl[1:] - 1)
    for r, done in ((0, 5), (1, 6), (2, 3)):
        torch.testing.assert_close(logits[r], dense[r][done - 1], rtol=1e-4, atol=1e-4)
    # Step 2: the rest of request 1, and one token of request 0 (a decode) sharing the row.
    plan = _plan([prompts[1][6:], [prompts[0][-1]]], [tables[1], tables[0]], 4, [6, 4])
    # Re-writing position 4 of request 0 with the same token must not change anything.
    logits = runner.execute(plan, plan.query_start_loc[1:] - 1)
    torch.testing.assert_close(logits[0], dense[1][-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], dense[0][-1], rtol=1e-4, atol=1e-4)


def test_copy_ops_copy_blocks_in_every_layer():
    runner = ModelRunner(_model(), num_blocks=8, block_size=4)
    for i, cache in enumerate(runner.kv_caches):
        cache.copy_(torch.randn_like(cache) + i)
    before = [c.clone() for c in runner.kv_caches]
    runner.apply_copy_ops(np.array([[2, 5], [3, 6]], np.int32))
    for b, c in zip(before, runner.kv_caches, strict=True):
        torch.testing.assert_close(c[5], b[2])
        torch.testing.assert_close(c[6], b[3])
        torch.testing.assert_close(c[:5], b[:5])
