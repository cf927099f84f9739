"""Random add / abort / step sequences through the Python API (hypothesis): invariants after
every call, outputs equal to the fake model's, and the whole pool back at the end."""

import kvcore
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import expected, fake_model

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 30),  # prompt length
            st.integers(0, 2),  # shared prefix
            st.integers(1, 12),  # max tokens
            st.integers(1, 3),  # n
            st.integers(-1, 1),  # priority
        ),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.just(("step",)),
        st.just(("step",)),
        st.just(("step",)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(10, 40),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 32),
    mode=st.sampled_from(["off", "radix", "hash"]),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_sequences(ops, num_blocks, block_size, budget, mode, policy):
    s = kvcore.Scheduler(
        num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=6,
        max_model_len=64,
        prefix_mode=mode,
        policy=policy,
        watermark=0.0,
    )
    prefixes = [list(range(500 + 40 * p, 520 + 40 * p)) for p in range(3)]
    prompts, nsamples, done, next_id = {}, {}, {}, 0

    def record(out):
        for rid, idx, reason, toks in out.outputs():
            if reason != "abort":
                assert toks == expected(prompts[rid], idx, len(toks))
            assert (rid, idx) not in done
            done[(rid, idx)] = reason

    def step():
        plan = s.schedule()
        record(s.update(plan.step_id, fake_model(plan)))

    for op in ops:
        if op[0] == "add":
            _, length, prefix, max_tokens, n, prio = op
            prompt = (prefixes[prefix] + list(range(9000, 9000 + length)))[:length]
            try:
                s.add_request(next_id, prompt, max_tokens, n=n, priority=prio)
                prompts[next_id], nsamples[next_id] = prompt, n
            except kvcore.TooLongError:
                pass
            next_id += 1
        elif op[0] == "abort":
            live = [r for r, n in nsamples.items() if any((r, k) not in done for k in range(n))]
            if live:
                record(s.abort_requests(np.array([live[op[1] % len(live)]])))
        else:
            step()
        s.check_invariants()
    for _ in range(5000):
        if not s.has_unfinished():
            break
        step()
        s.check_invariants()
    assert not s.has_unfinished()
    assert len(done) == sum(nsamples.values())
    st_ = s.stats()
    assert (st_.num_free_blocks, st_.kv_usage, st_.num_running) == (num_blocks - 1, 0.0, 0)
