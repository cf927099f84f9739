"""Deferred native calls (``kvcore_kernels.cpu_native.deferred``): a step's middle layers record
their native calls and run them in one crossing; the same bits as calling them one by one, bad
records refused before anything runs, and torch never reading an output not yet written."""

import numpy as np
import pytest
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import tiny_llama
from kvcore.params import SamplingParams
from kvcore_kernels import KernelConfigError, cpu_native, linear_cpu, ops_cpu
from test_engine import SMALL

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the native extension")

LAYERS = 5  # the first and last run call by call, the three between deferred
# head dim 32: every op of a layer native (rotary takes multiples of 32)
SHAPE = {**SMALL, "hidden_size": 128, "num_hidden_layers": LAYERS}


class _Counting:
    """The extension, with its ``run_calls`` crossings of more than one record (the deferred
    ones: a single call is a crossing of one) and their records counted."""

    def __init__(self, native):
        self.native, self.crossings, self.records = native, 0, 0

    def __getattr__(self, name):
        return getattr(self.native, name)

    def run_calls(self, calls):
        if len(calls) > 1:
            self.crossings += 1
            self.records += len(calls)
        return self.native.run_calls(calls)


def _generate(model, prompts, monkeypatch, defer: bool, threads: int = 1):
    monkeypatch.setattr(cpu_native, "_defer_on", lambda: defer)
    counting = _Counting(cpu_native._native)
    monkeypatch.setattr(cpu_native, "_native", counting)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(model, num_blocks=64, block_size=4, max_num_batched_tokens=32)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    return counting, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("threads", [1, 2])
def test_deferred_layers_give_the_bits_of_calls_one_by_one(monkeypatch, threads):
    model = tiny_llama(seed=3, dtype=torch.bfloat16, **SHAPE)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, int(n)).tolist() for n in rng.integers(3, 40, 6)]
    deferred, got = _generate(model, prompts, monkeypatch, True, threads)
    eager, want = _generate(model, prompts, monkeypatch, False, threads)
    assert deferred.crossings > 0 and deferred.records >= 8 * (LAYERS - 2) * deferred.crossings
    assert eager.crossings == 0
    assert got == want  # tokens and their log-probabilities, bit for bit


def test_a_step_above_the_row_limit_is_not_deferred(monkeypatch):
    monkeypatch.setattr(cpu_native, "DEFER_MAX_ROWS", 0)
    model = tiny_llama(seed=3, dtype=torch.bfloat16, **SHAPE)
    counting, _ = _generate(model, [[5, 6, 7, 8]], monkeypatch, True)
    assert counting.crossings == 0


def _packed(k=64, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(5, k, generator=g).bfloat16()
    return x, w, linear_cpu.pack_linear(w)


def test_a_torch_op_inside_reads_the_finished_outputs():
    """A fallback (here RMSNorm forced onto torch) runs the recorded calls before it reads."""
    x, _, packed = _packed()
    weight = torch.rand(32).bfloat16()
    want = ops_cpu.rms_norm(linear_cpu.linear(x, packed), None, weight, 1e-6, backend="torch")[0]
    with cpu_native.deferred():
        y = linear_cpu.linear(x, packed)
        assert cpu_native.recording() and len(cpu_native._RECORDING.calls) == 1
        got = ops_cpu.rms_norm(y, None, weight, 1e-6, backend="torch")[0]
        assert not cpu_native._RECORDING.calls  # flushed by the fallback
    assert torch.equal(got, want)


def test_a_bad_record_runs_nothing():
    """A store into a slot past the cache, recorded after a linear: the flush raises
    KernelConfigError and the linear's output is left as it was (nothing ran)."""
    x, _, packed = _packed()
    cache = torch.zeros(2, 2, 4, 1, 32, dtype=torch.bfloat16)  # 2 blocks of 4 slots
    key = torch.ones(1, 1, 32, dtype=torch.bfloat16)
    with pytest.raises(KernelConfigError, match="past the cache"):
        with cpu_native.deferred():
            y = linear_cpu.linear(x, packed)
            y.fill_(7)  # the linear has not run yet: its output still holds this
            assert cpu_native.store(key, key, cache, torch.tensor([8]))
    assert torch.all(y == 7)
    assert torch.all(cache == 0)
    assert not cpu_native.recording()


def test_an_exception_inside_drops_the_recorded_calls():
    x, _, packed = _packed()
    with pytest.raises(RuntimeError, match="boom"):
        with cpu_native.deferred():
            y = linear_cpu.linear(x, packed)
            y.fill_(3)
            raise RuntimeError("boom")
    assert torch.all(y == 3) and not cpu_native.recording()


def test_run_calls_refuses_malformed_records():
    native = cpu_native._native
    with pytest.raises(ValueError, match="unknown op"):
        native.run_calls([(9, [], [])])
    with pytest.raises(ValueError, match="expected 14 and 0"):
        native.run_calls([(0, [1, 2, 3], [])])
    with pytest.raises(ValueError, match="negative"):
        native.run_calls([(0, [-1] * 14, [])])
