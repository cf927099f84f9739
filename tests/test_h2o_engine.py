"""H2O in the engine: the tracker drops the lightest middle blocks by accumulated attention mass,
the engine runs an h2o policy within its budget, and the drops never break the cache."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.retention.h2o import H2OTracker
from kvcore.retention.spec import parse_retention
from test_engine import _check, _greedy, _prompts
from test_retention_engine import llama  # noqa: F401  (fixture)


def _plan(req_ids, seq_lens, q_lens, width):
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return SimpleNamespace(
        req_ids=np.asarray(req_ids, np.int64),
        seq_index=np.zeros(len(req_ids), np.int32),
        seq_lens=np.asarray(seq_lens, np.int32),
        query_start_loc=qsl,
        block_table=np.ones((len(req_ids), width), np.int32),
    )


def test_tracker_keeps_the_heavy_blocks_and_accumulates_over_steps():
    # 4-token blocks: 1 sink block, 1 window block, budget 4 -> 2 heavy hitters in the middle.
    t = H2OTracker(block_size=4)
    t.add(7, parse_retention("h2o:budget=16+sink=4+window=4"))
    t.add(8, parse_retention("full"))  # not tracked
    assert t.policies.keys() == {7}
    plan = _plan([7, 8], [29, 29], [1, 1], 8)  # 28 computed before: blocks 0..6 full
    mass = t.mass_tensor(plan, torch.device("cpu"))
    assert mass is not None and mass.shape == (2, 8)
    mass[0] = torch.tensor([9.0, 1.0, 5.0, 0.5, 7.0, 2.0, 3.0, 1.0])
    mass[1] = 100.0  # a full-retention row: ignored
    drops = t.drops(plan, mass).reshape(-1, 2)
    # middle = blocks 1..5 (0 is the sink, 6 the window, 7 is being written): keep 4 and 2
    assert drops[:, 0].tolist() == [0, 0, 0] and drops[:, 1].tolist() == [1, 3, 5]
    # Next step: mass accumulates; blocks already dropped never come back.
    plan = _plan([7], [33], [1], 9)
    mass = t.mass_tensor(plan, torch.device("cpu"))
    mass[0, 2] = 10.0  # block 2: 5 + 10; block 6 left the window (block 7 is in it now)
    drops = t.drops(plan, mass).reshape(-1, 2)
    assert drops[:, 1].tolist() == [6]  # live middle 2 (15), 4 (7), 6 (3): keep the two heaviest
    t.forget(7)
    assert not t.policies and t.mass_tensor(plan, torch.device("cpu")) is None


def test_tracker_restarts_a_recomputed_sample():
    t = H2OTracker(block_size=4)
    t.add(1, parse_retention("h2o:budget=12+sink=4+window=4"))
    plan = _plan([1], [25], [1], 7)
    m = t.mass_tensor(plan, torch.device("cpu"))
    assert len(t.drops(plan, m)) > 0
    plan = _plan([1], [8], [8], 7)  # preempted, recomputing from the start: fresh state
    m = t.mass_tensor(plan, torch.device("cpu"))
    assert len(t.drops(plan, m)) == 0


def test_h2o_policy_runs_within_its_budget(llama):  # noqa: F811
    prompts = _prompts([24, 30], seed=21)
    llm = LLM(llama, block_size=4, num_blocks=256, max_num_batched_tokens=24)
    spec = "h2o:budget=32+sink=4+window=8"  # 8 blocks: 1 sink + 2 window + 5 heavy
    outs = llm.generate(prompts, _greedy(48), use_tqdm=False, retention=spec)
    assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
    assert llm.engine.scheduler.stats().num_released_blocks > 0
    # budget + the block being written + one prefill chunk's blocks (24 / 4)
    assert all(o.peak_kv_blocks <= 8 + 1 + 6 for o in outs)
    _check(llm)
    # The same prompts without a policy hold every block: more than the budget.
    full = llm.generate(prompts, _greedy(48), use_tqdm=False)
    assert all(o.peak_kv_blocks > 8 + 1 + 6 for o in full)
    _check(llm)


@pytest.mark.parametrize("n", [2])
def test_h2o_with_parallel_samples_and_a_small_pool(llama, n):  # noqa: F811
    from kvcore.params import SamplingParams

    llm = LLM(llama, block_size=4, num_blocks=40, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.8, n=n, max_tokens=40, seed=3, ignore_eos=True)
    outs = llm.generate(_prompts([20, 26, 22], seed=4), params, use_tqdm=False,
                        retention="h2o:budget=24")  # fmt: skip
    assert all(len(c.token_ids) == 40 for o in outs for c in o.outputs)
    _check(llm)
