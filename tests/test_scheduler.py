"""The Python face of the Rust scheduler: plan layout, outputs, forks, preemption, bad input."""

import kvcore
import numpy as np
import pytest
from kvcore import Scheduler


def fake_model(plan: kvcore.StepPlan) -> np.ndarray:
    """Next token from (last token, its position, sample index) only: schedule-independent."""
    last = plan.input_ids[plan.logits_indices]
    pos = plan.positions[plan.logits_indices]
    idx = plan.sample_seq_index.astype(np.int64)
    return ((last * 31 + pos * 7 + idx * 13) % 997 + 3).astype(np.int32)


def expected(prompt: list[int], index: int, length: int) -> list[int]:
    toks = list(prompt)
    for _ in range(length):
        toks.append((toks[-1] * 31 + (len(toks) - 1) * 7 + index * 13) % 997 + 3)
    return toks[len(prompt) :]


def drain(s: Scheduler, limit: int = 1000) -> dict[tuple[int, int], tuple[str, list[int]]]:
    out = {}
    for _ in range(limit):
        if not s.has_unfinished():
            return out
        plan = s.schedule()
        for rid, idx, reason, toks in s.update(plan.step_id, fake_model(plan)).outputs():
            out[(rid, idx)] = (reason, toks)
        s.check_invariants()
    raise AssertionError("not drained")


def test_plan_layout_and_dtypes():
    s = Scheduler(64, block_size=4, max_num_batched_tokens=8)
    s.add_requests(np.array([10, 11]), np.arange(1, 13, dtype=np.int32), np.array([0, 10, 12]), 3)
    plan = s.schedule()
    assert plan.step_id == 1 and s.outstanding_step == 1
    assert plan.req_ids.tolist() == [10]  # 8 of 10's prompt tokens fill the budget
    assert plan.input_ids.tolist() == list(range(1, 9))
    assert plan.positions.tolist() == list(range(8))
    assert plan.query_start_loc.tolist() == [0, 8]
    assert plan.seq_lens.tolist() == [8]
    assert plan.num_sampled == 0 and plan.num_prefill == 1
    assert plan.block_table.shape == (1, 2) and plan.copy_ops.shape == (0, 2)
    table = plan.block_table[0]
    assert plan.slot_mapping.tolist() == [table[p // 4] * 4 + p % 4 for p in range(8)]
    dtypes = {
        "req_ids": np.int64,
        "seq_index": np.int32,
        "input_ids": np.int64,
        "positions": np.int64,
        "slot_mapping": np.int64,
        "query_start_loc": np.int32,
        "seq_lens": np.int32,
        "block_table": np.int32,
        "copy_ops": np.int32,
        "logits_indices": np.int64,
        "sample_rows": np.int32,
        "sample_req_ids": np.int64,
        "sample_seq_index": np.int32,
    }
    for name, dt in dtypes.items():
        assert getattr(plan, name).dtype == dt, name
    assert s.update(plan.step_id, np.zeros(0, np.int64)).num_finished == 0
    plan = s.schedule()
    # 10's last 2 prompt tokens, then 11's whole prompt (2 tokens): both sample.
    assert plan.req_ids.tolist() == [10, 11]
    assert plan.query_start_loc.tolist() == [0, 2, 4]
    assert plan.logits_indices.tolist() == [1, 3]
    assert plan.sample_req_ids.tolist() == [10, 11]
    assert s.stats().num_scheduled_tokens == 4


def test_outputs_match_the_model_and_blocks_come_back():
    s = Scheduler(64, block_size=4, max_num_batched_tokens=16, eos_token_id=None)
    prompts = {1: [5, 6, 7], 2: list(range(20, 40)), 3: [9]}
    for rid, p in prompts.items():
        s.add_request(rid, p, 6, n=2 if rid == 2 else 1)
    out = drain(s)
    assert out[(1, 0)] == ("length", expected(prompts[1], 0, 6))
    assert out[(2, 0)] == ("length", expected(prompts[2], 0, 6))
    assert out[(2, 1)] == ("length", expected(prompts[2], 1, 6))
    assert out[(3, 0)] == ("length", expected(prompts[3], 0, 6))
    st = s.stats()
    assert (st.num_running, st.num_waiting, st.num_requests, st.kv_usage) == (0, 0, 0, 0.0)
    assert st.num_free_blocks == 63 and st.num_finished == 4


def test_fork_plan_samples_parent_n_times():
    s = Scheduler(64, block_size=4)
    s.add_request(7, [1, 2, 3, 4, 5, 6], 2, n=3)
    plan = s.schedule()
    assert plan.logits_indices.tolist() == [5, 5, 5]
    assert plan.sample_seq_index.tolist() == [0, 1, 2]
    assert plan.sample_rows.tolist() == [0, 0, 0]
    s.update(plan.step_id, np.array([11, 12, 13], np.int32))
    plan = s.schedule()
    assert plan.req_ids.tolist() == [7, 7, 7]
    assert plan.seq_index.tolist() == [0, 1, 2]
    assert plan.input_ids.tolist() == [11, 12, 13]
    assert plan.copy_ops.shape == (2, 2)  # two samples copy the shared partial block
    out = s.update(plan.step_id, np.array([1, 2, 3], np.int64))
    assert out.outputs() == [
        (7, 0, "length", [11, 1]),
        (7, 1, "length", [12, 2]),
        (7, 2, "length", [13, 3]),
    ]
    assert out.request_done.tolist() == [False, False, True]
    assert out.token_offsets.tolist() == [0, 2, 4, 6]


def test_stop_ids_and_eos():
    s = Scheduler(64, block_size=4, eos_token_id=99)
    s.add_requests(
        [1, 2, 3],
        [1, 2, 3],
        [0, 1, 2, 3],
        10,
        ignore_eos=[False, True, True],
        stop_token_ids=[7],
        stop_offsets=[0, 0, 0, 1],
    )
    plan = s.schedule()
    out = s.update(plan.step_id, np.array([99, 99, 7], np.int32))
    assert out.outputs() == [(1, 0, "stop", [99]), (3, 0, "stop", [7])]
    assert s.stats().num_running == 1


def preemption_run(num_blocks: int) -> tuple[dict, int]:
    s = Scheduler(num_blocks, block_size=4, max_num_batched_tokens=64, watermark=0.0)
    s.add_requests([1, 2, 3], np.arange(100, 118), [0, 6, 12, 18], 14)
    out = drain(s)
    return out, s.stats().num_preemptions


def test_preempted_run_equals_unpreempted_run():
    reference, n0 = preemption_run(64)
    tight, n1 = preemption_run(12)
    assert n0 == 0 and n1 > 0
    assert tight == reference


def test_priority_policy_and_repr():
    s = Scheduler(64, block_size=4, policy="priority")
    s.add_requests([1, 2], [1, 2], [0, 1, 2], 3, priorities=[3, -3])
    assert s.schedule().req_ids.tolist() == [2, 1]
    assert 'policy="priority"' in repr(s) and s.policy == "priority"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 1},
        {"num_blocks": 16, "block_size": 0},
        {"num_blocks": 16, "block_size": -4},
        {"num_blocks": 16, "max_num_batched_tokens": 0},
        {"num_blocks": 16, "max_num_seqs": 0},
        {"num_blocks": 16, "max_model_len": 1},
        {"num_blocks": 16, "prefix_mode": "lru"},
        {"num_blocks": 16, "policy": "sjf"},
        {"num_blocks": 16, "watermark": 1.5},
        {"num_blocks": 16, "eos_token_id": -1},
        {"num_blocks": 2**40},
    ],
)
def test_bad_config(kwargs):
    with pytest.raises(kvcore.InvalidArgumentError):
        Scheduler(**kwargs)


def refused_calls(s: Scheduler, plan: kvcore.StepPlan, sampled: np.ndarray) -> list:
    """(exception, function, args) of calls that must be refused during `plan`'s step."""
    step, upd, add, add1 = plan.step_id, s.update, s.add_requests, s.add_request
    calls = [
        (kvcore.StaleStepError, upd, (step + 1, sampled)),
        (kvcore.StaleStepError, upd, (step - 1, sampled)),
        (kvcore.InvalidArgumentError, upd, (step, np.append(sampled, 1))),
        (kvcore.InvalidArgumentError, upd, (step, sampled.astype(float))),
        (kvcore.InvalidArgumentError, upd, (step, sampled.tolist())),
        (kvcore.InvalidArgumentError, upd, (step, sampled.reshape(-1, 1))),
        (kvcore.InvalidArgumentError, upd, (-1, sampled)),
        (kvcore.InvalidArgumentError, s.schedule, ()),
        (kvcore.UnknownRequestError, s.abort_requests, ([1, 2, 404],)),
        (kvcore.DuplicateRequestError, add1, (2, [1], 1)),
        (kvcore.InvalidArgumentError, add, ([5], [1, 2], [0, 3], 1)),
        (kvcore.InvalidArgumentError, add, ([5, 6], [1, 2], [0, 2], 1)),
        (kvcore.InvalidArgumentError, add, ([5], [1.5], [0, 1], 1)),
        (kvcore.InvalidArgumentError, add, ([5], [1], [0, 1], [1, 2])),
        (kvcore.InvalidArgumentError, add1, (5, [1], 0)),
        (kvcore.InvalidArgumentError, add1, (5, [], 1)),
        (kvcore.InvalidArgumentError, add1, (-5, [1], 1)),
        (kvcore.InvalidArgumentError, add1, (5, [-1], 1)),
        (kvcore.TooLongError, add1, (5, list(range(600)), 1)),
    ]
    if plan.num_sampled > 0:  # with no token there is none to drop or to make negative
        calls.append((kvcore.InvalidArgumentError, upd, (step, sampled[:-1])))
        calls.append((kvcore.InvalidArgumentError, upd, (step, sampled - 10**4)))
    return calls


def scenario(s: Scheduler, bad: bool) -> dict:
    """A fixed workload; with `bad`, refused calls are interleaved and must change nothing."""
    s.add_requests([1, 2], np.arange(1, 30), [0, 20, 29], 5, n=[1, 2])
    out = {}
    while s.has_unfinished():
        plan = s.schedule()
        sampled = fake_model(plan)
        if bad:
            before = (s.stats().num_steps, s.stats().num_computed_tokens, s.outstanding_step)
            for exc, fn, args in refused_calls(s, plan, sampled):
                with pytest.raises(exc):
                    fn(*args)
            after = (s.stats().num_steps, s.stats().num_computed_tokens, s.outstanding_step)
            assert before == after
            s.check_invariants()
        for rid, idx, reason, toks in s.update(plan.step_id, sampled).outputs():
            out[(rid, idx)] = (reason, toks)
        if bad:
            with pytest.raises(kvcore.StaleStepError):
                s.update(plan.step_id, sampled)  # repeated
    return out


def test_bad_input_is_refused_and_changes_nothing():
    def make():
        return Scheduler(40, block_size=4, max_num_batched_tokens=8, max_model_len=512)

    assert scenario(make(), bad=True) == scenario(make(), bad=False)


def test_abort_batch_between_schedule_and_update():
    s = Scheduler(64, block_size=4)
    s.add_requests([1, 2, 3], np.arange(1, 10), [0, 3, 6, 9], 4, n=[1, 3, 1])
    plan = s.schedule()
    out = s.abort_requests(np.array([2, 3]))
    assert out.outputs() == [
        (2, 0, "abort", []),
        (2, 1, "abort", []),
        (2, 2, "abort", []),
        (3, 0, "abort", []),
    ]
    assert out.request_done.tolist() == [False, False, True, True]
    assert s.update(plan.step_id, fake_model(plan)).num_finished == 0
    assert list(drain(s)) == [(1, 0)]
    assert s.stats().num_free_blocks == 63


def test_stats_count_prefix_hits_and_preemptions():
    s = Scheduler(64, block_size=4, prefix_mode="hash")
    shared = list(range(50, 66))
    s.add_request(1, shared + [1], 1)
    drain(s)
    s.add_request(2, shared + [2], 1)
    plan = s.schedule()
    assert plan.positions.tolist() == [16]  # four cached blocks, one token computed
    st = s.stats()
    assert (st.prefix_queries, st.prefix_query_tokens, st.prefix_hit_tokens) == (2, 34, 16)
    assert "SchedulerStats(" in repr(st)
