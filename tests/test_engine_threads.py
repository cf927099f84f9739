"""LLMEngine fed from many threads while one thread steps (issue 17's stress test).

One stepper loops ``step()``; four submitters add 10,000 short requests in small batches; one
aborter aborts a random sample of them (some already finished: ``UnknownRequestError`` is the
expected answer then). Every request must be accounted for exactly once (one final output, from
a step or from its abort), every block must come back, and the run is bounded in time.
"""

import random
import threading
import time

import numpy as np
import pytest
from kvcore import UnknownRequestError
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import tiny_llama
from kvcore.params import SamplingParams
from test_engine import SMALL

NUM_REQUESTS = 10_000
SUBMITTERS = 4
DEADLINE_S = 240


def test_one_stepper_four_submitters_one_aborter():
    llm = LLM(tiny_llama(seed=3, **SMALL), num_blocks=2048, block_size=4, max_num_seqs=256)
    engine = llm.engine
    finals: dict[str, int] = {}  # request id -> number of final outputs seen
    finals_lock = threading.Lock()
    submitted: list[str] = []
    errors: list[BaseException] = []
    submitters_done = threading.Event()
    deadline = time.monotonic() + DEADLINE_S

    def record(outs):
        with finals_lock:
            for o in outs:
                if o.finished:
                    finals[o.request_id] = finals.get(o.request_id, 0) + 1

    def guard(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        return run

    @guard
    def submitter(k):
        rng = np.random.default_rng(k)
        per = NUM_REQUESTS // SUBMITTERS
        for start in range(0, per, 25):
            n = min(25, per - start)
            prompts = [rng.integers(3, 128, rng.integers(2, 9)).tolist() for _ in range(n)]
            params = [
                SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
                for m in rng.integers(1, 4, n)
            ]
            ids = [f"s{k}-{start + i}" for i in range(n)]
            engine.add_requests(prompts, params, request_ids=ids)
            with finals_lock:
                submitted.extend(ids)
            if time.monotonic() > deadline:
                return

    @guard
    def aborter():
        rng = random.Random(7)
        while not submitters_done.is_set() and time.monotonic() < deadline:
            with finals_lock:
                pick = rng.choice(submitted) if submitted else None
            if pick is None:
                time.sleep(0.001)
                continue
            try:
                record(engine.abort_request(pick))
            except UnknownRequestError:
                pass  # finished (or aborted) already
            time.sleep(0.0005)

    @guard
    def stepper():
        while time.monotonic() < deadline:
            record(engine.step())
            if submitters_done.is_set() and not engine.has_unfinished_requests():
                return

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(SUBMITTERS)]
    helpers = [threading.Thread(target=aborter), threading.Thread(target=stepper)]
    for t in threads + helpers:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    submitters_done.set()
    for t in helpers:
        t.join(DEADLINE_S)
    if errors:
        raise errors[0]
    assert time.monotonic() < deadline, "the stress run did not finish in time"
    assert len(submitted) == NUM_REQUESTS == len(set(submitted))
    assert set(finals) == set(submitted)  # nobody lost ...
    assert all(v == 1 for v in finals.values())  # ... and nobody reported twice
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    assert engine.all_blocks_free()
    assert engine.sampler.num_active == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_aborts_during_a_running_forward_are_safe(seed):
    """Abort requests from another thread while the stepper is inside the forward."""
    llm = LLM(tiny_llama(seed=3, **SMALL), num_blocks=512, block_size=4)
    engine = llm.engine
    real = engine.runner.execute
    rng = random.Random(seed)

    def slow_execute(*args, **kwargs):
        alive = list(engine._ids)
        victims = rng.sample(alive, k=min(len(alive), 3))
        t = threading.Thread(target=lambda: [_quiet_abort(engine, v) for v in victims])
        t.start()
        t.join()  # the aborts land while this forward is in flight
        return real(*args, **kwargs)

    engine.runner.execute = slow_execute
    ids = engine.add_requests(
        [[5 + i, 6, 7, 8] for i in range(24)],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )
    seen = set()
    while engine.has_unfinished_requests():
        seen.update(o.request_id for o in engine.step() if o.finished)
    assert seen <= set(ids)
    engine.scheduler.check_invariants()
    assert engine.all_blocks_free()
    assert engine.sampler.num_active == 0


def _quiet_abort(engine, rid):
    try:
        engine.abort_request(rid)
    except UnknownRequestError:
        pass
