"""The attention backend and ModelRunner on hand-built step plans, against plain transformers."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvcore.models.loader import tiny_llama
from kvcore.runner.attention import CTX_KWARG, AttentionContext, register
from kvcore.runner.model_runner import ModelRunner
from test_engine import SMALL


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
