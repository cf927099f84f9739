"""kvcore's attention custom op and the compiled forward (issue 15), on the CPU."""

import kvcore_kernels
import numpy as np
import pytest
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import tiny_llama
from kvcore.params import SamplingParams
from kvcore.runner.attention_op import PLAN_STATS, attach_plan, paged_attention, plan_for
from kvcore.runner.compile import compiled_graph_count
from kvcore.runner.model_runner import ModelRunner
from test_engine import SMALL

BS, HK, HQ, D = 4, 2, 4, 16


def _step(seed=0):
    """Two requests (a 3-token prefill chunk after 2 cached tokens; a decode at position 5)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(8, 2, BS, HK, D, generator=g)
    cache[0] = 0  # the null block
    meta = kvcore_kernels.plan_attention(
        np.array([0, 3, 4]), np.array([5, 6]), np.array([[2, 5], [3, 7]]), BS
    )
    slots = torch.tensor([5 * BS + 0, 5 * BS + 1, 5 * BS + 2, 7 * BS + 1])
    q = torch.randn(1, HQ, 4, D, generator=g)[0].transpose(0, 1)  # a strided view, as the model's
    k = torch.randn(1, HK, 4, D, generator=g)[0].transpose(0, 1)
    v = torch.randn(1, HK, 4, D, generator=g)[0].transpose(0, 1)
    return q, k, v, cache, slots, meta


def test_op_equals_the_kernels_and_writes_the_cache():
    q, k, v, cache, slots, meta = _step()
    want_cache = cache.clone()
    kvcore_kernels.store_kv(k, v, want_cache, slots)
    want = kvcore_kernels.paged_attention(q, want_cache, meta, scale=0.25)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_table)
    out = paged_attention(q, k, v, cache, slots, *args, scale=0.25)
    torch.testing.assert_close(out, want)
    assert out.is_contiguous() and out.shape == q.shape
    assert torch.equal(cache, want_cache)
    # sliding window and soft cap go through (0 means off inside the op)
    want = kvcore_kernels.paged_attention(q, want_cache, meta, scale=0.25, sliding_window=2)
    got = paged_attention(q, k, v, cache, slots, *args, scale=0.25, sliding_window=2)
    torch.testing.assert_close(got, want)


def test_op_passes_opcheck():
    """Schema (the cache is declared mutated), the fake implementation and dynamic shapes."""
    q, k, v, cache, slots, meta = _step()
    args = (q.contiguous(), k.contiguous(), v.contiguous(), cache, slots, meta.query_start_loc)
    args += (meta.seq_lens, meta.block_table, 0.25, 0, 0.0, "torch")
    torch.library.opcheck(torch.ops.kvcore.paged_attention.default, args)


def test_attached_plan_is_reused_only_while_unchanged():
    q, k, v, cache, slots, meta = _step()
    seq_lens = meta.seq_lens.clone()  # a normal (versioned) tensor, like the static buffers
    attach_plan(seq_lens, meta)
    hits = PLAN_STATS["hits"]
    assert plan_for(meta.query_start_loc, seq_lens, meta.block_table, BS) is meta
    assert PLAN_STATS["hits"] == hits + 1
    seq_lens[1] = 7  # written since: the old plan is stale and is not used
    misses = PLAN_STATS["misses"]
    fresh = plan_for(meta.query_start_loc, seq_lens, meta.block_table, BS)
    assert fresh is not meta and PLAN_STATS["misses"] == misses + 1
    assert fresh.host_seq_lens.tolist() == [5, 7]
    # Unknown tensors are planned from their values (checked like any plan).
    with pytest.raises(kvcore_kernels.KernelConfigError):
        plan_for(meta.query_start_loc, torch.tensor([5, 6]), torch.tensor([[2, 0], [3, 7]]), BS)


def test_runner_devices_are_normalised_and_eager_turns_fast_paths_off():
    model = tiny_llama(seed=0, **SMALL)
    runner = ModelRunner(model, num_blocks=8, block_size=4, enforce_eager=True, compile=True)
    assert runner.device == torch.device("cpu") and runner.kv_caches[0].device == runner.device
    assert runner.compiled is None and not runner.use_op and runner.graphs is None
    quant = ModelRunner(model, num_blocks=8, block_size=4, kv_formats=["int8"] * 2, compile=True)
    assert quant.compiled is None and not quant.use_op  # quantized caches stay eager
    with pytest.raises(Exception, match="CUDA"):
        ModelRunner(model, num_blocks=8, block_size=4, cuda_graphs=True)


@pytest.mark.slow
def test_compiled_greedy_equals_eager_with_few_compiles():
    """inductor over the whole model (fused RMSNorm, RoPE, SiLU-mul) around the op: the same
    greedy tokens as the eager path on a mixed workload (prefill chunks, decodes of 1..4
    requests), compiling one graph per shape family (a size-1 dimension specialises)."""
    model = tiny_llama(seed=3, **SMALL)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, SMALL["vocab_size"], n).tolist() for n in (3, 17, 9, 30)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 3, 9, 5)]
    kw = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16, seed=0)
    eager = LLM(model, enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)
    before = compiled_graph_count()
    llm = LLM(model, compile=True, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager]
    runner = llm.engine.runner
    assert runner.compiled is not None and runner.use_op
    graphs = compiled_graph_count() - before
    assert 1 <= graphs <= 3, graphs  # not one per step size
    assert runner.compile_stats.graphs == graphs
    assert llm.engine.all_blocks_free()
