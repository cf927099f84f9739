"""The Rust bindings shared between threads (issue 17): no "Already borrowed", no lost update.

One thread steps a Scheduler while others add and abort requests; threads hammer one
KvCacheManager with admissions, frees and reads. Every call must succeed or raise a
KvCoreError it was meant to, and the invariants must hold at the end. Bounded: ~2 s.
"""

from __future__ import annotations

import threading

import kvcore
import numpy as np


def run_threads(*targets) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrap(f):
        def go():
            try:
                f()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        return go

    threads = [threading.Thread(target=wrap(f)) for f in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_scheduler_fed_and_aborted_while_another_thread_steps():
    s = kvcore.Scheduler(256, 4, max_num_batched_tokens=128, max_model_len=64)
    n_req = 400
    done = threading.Event()
    finished: list[int] = []
    aborted: list[int] = []

    def stepper():
        while not done.is_set() or s.has_unfinished():
            plan = s.schedule()
            out = s.update(plan.step_id, np.full(plan.num_sampled, 3, np.int64))
            finished.extend(out.req_ids[out.request_done].tolist())

    def submitter(base):
        def go():
            for i in range(base, n_req, 2):
                s.add_request(i, [1 + i % 7, 2, 3, 4, 5], 6)

        return go

    def aborter():
        for i in range(0, n_req, 5):
            try:
                out = s.abort_requests([i])
                aborted.extend(out.req_ids[out.request_done].tolist())
            except kvcore.UnknownRequestError:
                pass  # not added yet or already finished

    feeders = [submitter(0), submitter(1), aborter]
    left = [len(feeders)]
    lock = threading.Lock()

    def feeding(f):
        def go():
            try:
                f()
            finally:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return go

    errors = run_threads(stepper, *map(feeding, feeders))
    assert not errors, errors
    assert sorted(finished + aborted) == list(range(n_req))  # each exactly once
    s.check_invariants()


def test_scheduler_calls_race_a_stepping_thread():
    s = kvcore.Scheduler(256, 4, max_num_batched_tokens=64, max_model_len=64)
    stop = threading.Event()

    def stepper():
        while not stop.is_set():
            plan = s.schedule()
            s.update(plan.step_id, np.full(plan.num_sampled, 3, np.int64))

    def caller():
        for i in range(300):
            s.add_requests([10_000 + i], [1, 2, 3], [0, 3], 4)
            s.stats()
            s.check_invariants()
        stop.set()

    assert not run_threads(stepper, caller)
    s.check_invariants()


def test_manager_shared_by_threads():
    m = kvcore.KvCacheManager(4096, 4, "radix")

    def worker(base):
        def go():
            for i in range(300):
                r = base + i
                toks = np.arange(r % 13, r % 13 + 20, dtype=np.uint32)
                if len(m.admit([r], [24], toks, [0, 20])):
                    m.cache_computed([r], toks, [0, 20])
                    m.block_tables([r])
                    m.free([r], toks, [0, 20])

        return go

    def reader():
        for _ in range(300):
            m.stats()
            m.check_invariants()
            m.drain_copy_ops()

    assert not run_threads(worker(0), worker(100_000), reader)
    m.drain_copy_ops()
    m.check_invariants()
    assert len(m) == 0 and m.num_free_blocks == 4095
