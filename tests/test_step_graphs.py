"""Step graphs (``kvcore.models.step_graphs``, ``cpu_native.captured`` / ``StepGraph``): a
decode step's middle layers replayed from an earlier step's recorded native calls give the bits
of recording them again, over batches that grow, shrink and mix prefill chunks, preemption and
1 or 2 threads; a block that a replay would not reproduce (a torch op, an early flush) is never
kept; a replay the native checks refuse runs nothing."""

import numpy as np
import pytest
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.models import step_graphs
from kvcore.models.loader import tiny_llama
from kvcore.params import SamplingParams
from kvcore_kernels import KernelConfigError, cpu_native, linear_cpu, ops_cpu
from test_deferred_calls import SHAPE

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the native extension")


def _generate(model, prompts, monkeypatch, replay: bool, threads: int = 1, **engine):
    monkeypatch.setenv("KVCORE_STEP_GRAPHS", "1" if replay else "0")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kw = {"num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 32, **engine}
        llm = LLM(model, **kw)
        graphs = llm.engine.runner.native.model.graphs
        outs = []
        for i, p in enumerate(prompts):  # lengths differ: the batch shrinks as they finish
            params = SamplingParams(
                temperature=0, max_tokens=12 + 8 * (i % 3), ignore_eos=True, logprobs=3
            )
            outs.append(({"prompt_token_ids": p}, params))
        res = llm.generate([o[0] for o in outs], [o[1] for o in outs], use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in res]
    return graphs, got, llm


def _prompts(n=7, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, int(k)).tolist() for k in rng.integers(3, 40, n)]


@pytest.mark.parametrize("threads", [1, 2])
def test_replayed_steps_give_the_bits_of_recorded_ones(monkeypatch, threads):
    model = tiny_llama(seed=3, dtype=torch.bfloat16, **SHAPE)
    graphs, got, _ = _generate(model, _prompts(), monkeypatch, True, threads)
    off, want, _ = _generate(model, _prompts(), monkeypatch, False, threads)
    assert graphs.captures >= 2 and graphs.replays >= 10  # several row counts replayed
    assert off.captures == off.replays == 0
    assert got == want  # tokens and their log-probabilities, bit for bit


def test_replay_under_preemption_and_prefix_hits(monkeypatch):
    model = tiny_llama(seed=5, dtype=torch.bfloat16, **SHAPE)
    shared = list(range(10, 34))
    prompts = [shared + p for p in _prompts(6, seed=1)]
    kw = {"num_blocks": 24}  # too few blocks for every request at once: preemption
    graphs, got, llm = _generate(model, prompts, monkeypatch, True, **kw)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert graphs.replays > 0
    _, want, _ = _generate(model, prompts, monkeypatch, False, **kw)
    assert got == want


def test_graphs_keep_to_their_caps(monkeypatch):
    monkeypatch.setattr(step_graphs, "MAX_GRAPHS", 2)
    model = tiny_llama(seed=3, dtype=torch.bfloat16, **SHAPE)
    graphs, got, _ = _generate(model, _prompts(), monkeypatch, True)
    assert graphs.replays > 0 and 0 < len(graphs._graphs) <= 2
    _, want, _ = _generate(model, _prompts(), monkeypatch, False)
    assert got == want
    monkeypatch.setattr(step_graphs, "MAX_ROWS", 0)  # no graph fits: every step records
    graphs, got, _ = _generate(model, _prompts(), monkeypatch, True)
    assert graphs.captures == graphs.replays == 0 and not graphs._graphs
    assert got == want


@pytest.mark.parametrize("case", ["splits", "cascade"])
def test_replay_patches_splits_merges_and_cascade_items(monkeypatch, case):
    """The step fields a replay patches beyond the work list: key ranges split into runs of
    16 keys (merges, their count, the partial buffer, its rows), and decode requests over a
    shared 64-token prefix (cascade items and their merges)."""
    if case == "splits":
        monkeypatch.setattr(cpu_native.OPTIONS, "split_keys", 16)
        prompts = _prompts()
    else:
        shared = list(range(10, 90))  # 80 tokens: cascade items (MIN_CASCADE_KEYS = 64)
        prompts = [shared + p[:6] for p in _prompts(6, seed=2)]
    replayed_merges = []
    replay = cpu_native.StepGraph.replay

    def counting(self, meta, slots):
        ran = replay(self, meta, slots)
        replayed_merges.extend(ints[30] for ints, *_ in self.attention if ran)
        return ran

    monkeypatch.setattr(cpu_native.StepGraph, "replay", counting)
    model = tiny_llama(seed=7, dtype=torch.bfloat16, **SHAPE)
    graphs, got, _ = _generate(model, prompts, monkeypatch, True, num_blocks=128)
    assert graphs.replays > 0 and max(replayed_merges) > 0  # replays that merged partials
    _, want, _ = _generate(model, prompts, monkeypatch, False, num_blocks=128)
    assert got == want


def _packed(k=64, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(5, k, generator=g).bfloat16()
    return x, linear_cpu.pack_linear(w)


NO_SLOTS = torch.empty(0, dtype=torch.int64)


def test_a_captured_block_replays_on_new_inputs():
    x, packed = _packed()
    weight = torch.rand(32).bfloat16()
    own = x.clone()
    with cpu_native.captured(None, NO_SLOTS) as cap:
        y, _ = ops_cpu.rms_norm(linear_cpu.linear(own, packed), None, weight, 1e-6)
    assert cap.graph is not None, cap.why
    assert torch.equal(y, ops_cpu.rms_norm(linear_cpu.linear(x, packed), None, weight, 1e-6)[0])
    x2 = torch.randn(5, 64).bfloat16()
    own.copy_(x2)
    assert cap.graph.replay(None, NO_SLOTS)
    want = ops_cpu.rms_norm(linear_cpu.linear(x2, packed), None, weight, 1e-6)[0]
    assert torch.equal(y, want) and not torch.equal(want, ops_cpu.rms_norm(
        linear_cpu.linear(x, packed), None, weight, 1e-6)[0])  # fmt: skip
    assert not cap.graph.replay(None, torch.zeros(1, dtype=torch.int64))  # another row count


def test_a_block_with_a_torch_op_or_a_flush_is_not_kept():
    x, packed = _packed()
    with cpu_native.captured(None, NO_SLOTS) as cap:
        y = linear_cpu.linear(x, packed)
        x.mul(2)  # torch computes: a replay would not
    assert cap.graph is None and "mul" in cap.why
    weight = torch.rand(32).bfloat16()
    with cpu_native.captured(None, NO_SLOTS) as cap:
        y = linear_cpu.linear(x, packed)
        z = ops_cpu.rms_norm(y, None, weight, 1e-6, backend="torch")[0]  # flushes, then reads
    assert cap.graph is None and "flush" in cap.why
    assert torch.equal(z, ops_cpu.rms_norm(linear_cpu.linear(x, packed), None, weight, 1e-6,
                                           backend="torch")[0])  # fmt: skip
    assert not cpu_native.recording()


def test_a_replay_the_checks_refuse_runs_nothing():
    x, packed = _packed()
    cache = torch.zeros(2, 2, 4, 1, 32, dtype=torch.bfloat16)  # 2 blocks of 4 slots
    key = torch.ones(1, 1, 32, dtype=torch.bfloat16)
    slots = torch.tensor([3])
    with cpu_native.captured(None, slots) as cap:
        y = linear_cpu.linear(x, packed)
        assert cpu_native.store(key, key, cache, slots)
    assert cap.graph is not None, cap.why
    y.fill_(7)
    cache.zero_()
    with pytest.raises(KernelConfigError, match="past the cache"):
        cap.graph.replay(None, torch.tensor([8]))
    assert torch.all(y == 7) and torch.all(cache == 0)
    assert cap.graph.replay(None, torch.tensor([5]))  # slot 5: block 1, offset 1
    assert torch.all(cache[1, :, 1] == 1) and cache.sum() == 2 * 32 and not torch.all(y == 7)


class _Step:
    """The two methods ``StepGraphs`` asks of a step (``kvcore.runner.native.NativeStep``'s):
    here no attention and no store, so no metadata and no slots."""

    def replay_key(self):
        return ("caches",)

    def replay_args(self):
        return None, NO_SLOTS


def test_graphs_replay_only_the_body_they_captured(monkeypatch):
    monkeypatch.setenv("KVCORE_STEP_GRAPHS", "1")
    x, a = _packed(seed=1)
    _, b = _packed(seed=2)
    graphs, step = step_graphs.StepGraphs(), _Step()
    want_a, want_b = linear_cpu.linear(x, a), linear_cpu.linear(x, b)
    for _ in range(3):  # recorded, captured, replayed
        (got,) = graphs.run(step, (x,), lambda x: (linear_cpu.linear(x, a),), tag="a")
        assert torch.equal(got, want_a)
    assert (graphs.captures, graphs.replays) == (1, 1)
    for _ in range(3):  # another body, the same inputs: its own key
        (got,) = graphs.run(step, (x,), lambda x: (linear_cpu.linear(x, b),), tag="b")
        assert torch.equal(got, want_b)
    assert (graphs.captures, graphs.replays) == (2, 2)
    x2 = torch.randn(5, 64).bfloat16()
    (got,) = graphs.run(step, (x2,), lambda x: (linear_cpu.linear(x, a),), tag="a")
    assert torch.equal(got, linear_cpu.linear(x2, a)) and graphs.replays == 3
