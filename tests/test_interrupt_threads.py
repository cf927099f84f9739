"""Ctrl-C or a failure in one thread's ``LLM.generate`` while that thread runs the shared step
(issue 28, item 2): only that caller's requests are aborted; the other thread's requests run
again in the next step and finish with their normal outputs."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from kvcore import StepFailedError
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import tiny_llama
from test_engine import SMALL, _check, _greedy, _prompts


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5, **SMALL)


def _run_two(llm, fault):
    """Thread B generates; the main thread A generates too and, on its first step that also
    carries B's requests, suffers ``fault`` inside the forward. Returns (A's exception, B's
    outputs)."""
    engine = llm.engine
    b_prompts, a_prompts = _prompts([7, 12, 20], seed=1), _prompts([9, 5], seed=2)
    b_ids: set[str] = set()
    main = threading.get_ident()
    real_execute, real_step = engine.runner.execute, engine.step
    fired = []

    def execute(plan, *args, **kwargs):
        rows = {
            engine._requests[i].request_id for i in plan.req_ids.tolist() if i in engine._requests
        }
        if threading.get_ident() == main and not fired and rows & b_ids and rows - b_ids:
            fired.append(plan.step_id)
            fault()
        return real_execute(plan, *args, **kwargs)

    def step(**kwargs):
        out = real_step(**kwargs)
        if threading.get_ident() != main:
            time.sleep(0.002)  # let the main thread take steps too
        return out

    engine.runner.execute, engine.step = execute, step
    result: dict = {}

    def thread_b():
        result["b"] = llm.generate(b_prompts, _greedy(24), use_tqdm=False)

    orig_add = engine.add_requests

    def add_requests(prompts, *a, **kw):
        ids = orig_add(prompts, *a, **kw)
        if threading.get_ident() != main:
            b_ids.update(ids)
        return ids

    engine.add_requests = add_requests
    t = threading.Thread(target=thread_b)
    t.start()
    while not b_ids:
        time.sleep(0.001)
    error = None
    try:
        llm.generate(a_prompts, _greedy(24), use_tqdm=False)
    except BaseException as e:  # noqa: BLE001 - the fault under test
        error = e
    t.join(60)
    assert not t.is_alive()
    engine.runner.execute, engine.step, engine.add_requests = real_execute, real_step, orig_add
    assert fired, "the fault never hit a step shared by both threads"
    return error, result.get("b"), b_prompts


def _ctrl_c():
    signal.raise_signal(signal.SIGINT)  # a real Ctrl-C: Python raises it in the main thread
    time.sleep(0.05)  # the handler runs here at the latest


def _boom():
    raise RuntimeError("device lost")


@pytest.mark.parametrize("fault", [_ctrl_c, _boom], ids=["ctrl-c", "error"])
def test_fault_in_one_threads_step_aborts_only_its_requests(model, fault):
    llm = LLM(model, num_blocks=128, block_size=4)
    ref_prompts = _prompts([7, 12, 20], seed=1)
    expected = [
        o.outputs[0].token_ids for o in llm.generate(ref_prompts, _greedy(24), use_tqdm=False)
    ]
    error, b_outputs, _ = _run_two(llm, fault)
    expected_exc = KeyboardInterrupt if fault is _ctrl_c else StepFailedError
    assert isinstance(error, expected_exc), repr(error)
    assert b_outputs is not None, "the other thread's generate failed"
    assert [o.outputs[0].token_ids for o in b_outputs] == expected
    assert all(o.error is None for o in b_outputs)
    _check(llm)
    assert llm.engine.scheduler.outstanding_step is None


def test_a_step_that_keeps_failing_aborts_everyone_in_it(model, monkeypatch):
    """An error (not an interrupt) that repeats on the re-run aborts the step's requests."""
    llm = LLM(model, num_blocks=128, block_size=4)
    engine = llm.engine
    rid = engine.add_request(_prompts([6])[0], _greedy(8))
    engine.step()
    real = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda *a, **k: _boom())
    for _ in range(2):
        with pytest.raises(StepFailedError):
            engine.step(owner_ids=["someone-else"])
    assert not engine.has_unfinished_requests()
    monkeypatch.setattr(engine.runner, "execute", real)
    assert rid not in engine._ids
    _check(llm)
