"""The engine under failure and misuse: tenant isolation (cache_salt), num_cached_tokens,
failures inside a step, abandoned streams and typed errors for bad input (issue 17)."""

import gc
import threading

import pytest
import torch
from kvcore import (
    InvalidArgumentError,
    KvCoreError,
    StepFailedError,
    UnknownRequestError,
)
from kvcore.engine.request import salt_namespace
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import tiny_llama
from kvcore.params import SamplingParams
from test_engine import SMALL, _check, _greedy, _prompts


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, **SMALL)


def _llm(model, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLM(model, **kw)


def test_num_cached_tokens_counts_prefix_hits(model):
    llm = _llm(model)
    shared = _prompts([32], seed=1)[0]
    (first,) = llm.generate([shared + [5, 6]], _greedy(3), use_tqdm=False)
    assert first.num_cached_tokens == 0
    (second,) = llm.generate([shared + [7, 8, 9]], _greedy(3), use_tqdm=False)
    assert second.num_cached_tokens == 32  # block size 4: the whole shared prefix
    _check(llm)


def test_cache_salt_isolates_prefix_hits(model):
    llm = _llm(model)
    engine = llm.engine
    shared = _prompts([32], seed=2)[0]
    outs = {}
    for salt, tail in (("a", [5]), ("b", [6]), ("a", [7]), (None, [8]), (None, [9])):
        rid = engine.add_request(shared + tail, _greedy(2), cache_salt=salt)
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs.setdefault(o.request_id, o)
        outs[(salt, tail[0])] = outs.pop(rid)
    assert outs[("a", 5)].num_cached_tokens == 0
    assert outs[("b", 6)].num_cached_tokens == 0  # another tenant: no hit
    assert outs[("a", 7)].num_cached_tokens == 32  # same tenant: hit
    assert outs[(None, 8)].num_cached_tokens == 0
    assert outs[(None, 9)].num_cached_tokens == 32
    _check(llm)


def test_salt_namespace_is_stable_and_refuses_bad_salts():
    assert salt_namespace(None) == 0
    assert salt_namespace("tenant") == salt_namespace("tenant") != salt_namespace("other")
    assert 0 < salt_namespace("tenant") < 2**63
    from kvcore import InvalidArgumentError

    for bad in ("", 5, b"x"):
        with pytest.raises(InvalidArgumentError):
            salt_namespace(bad)


# ---- failures inside a step ----------------------------------------------------------------


def _fail_once(monkeypatch, obj, name, exc):
    real = getattr(obj, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second call: requests are mid-flight
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, flaky)
    return calls


@pytest.mark.parametrize(
    "where",
    ["after_schedule", "forward", "sampler", "after_update"],
    ids=["after-schedule", "forward", "sampler", "after-update"],
)
@pytest.mark.parametrize(
    "exc", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "ctrl-c"]
)
def test_failed_step_aborts_its_requests_and_the_engine_keeps_serving(
    model, monkeypatch, where, exc
):
    llm = _llm(model)
    engine = llm.engine
    prompts = _prompts([5, 9, 14])
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(6), use_tqdm=False)]
    if where == "after_schedule":  # the step's bookkeeping, before the forward
        _fail_once(monkeypatch, engine.stats, "observe_plan", exc)
    elif where == "forward":
        _fail_once(monkeypatch, engine.runner, "execute", exc)
    elif where == "sampler":
        _fail_once(monkeypatch, engine.sampler, "sample", exc)
    else:
        import kvcore.engine.llm_engine

        _fail_once(monkeypatch, kvcore.engine.llm_engine.Request, "record", exc)
    expected_exc = KeyboardInterrupt if isinstance(exc, KeyboardInterrupt) else StepFailedError
    with pytest.raises(expected_exc):
        llm.generate(prompts, _greedy(6), use_tqdm=False)
    # Nothing is left running or holding blocks, the scheduler is consistent ...
    _check(llm)
    assert engine.scheduler.outstanding_step is None
    # ... and the engine serves the same prompts again, with the same outputs.
    monkeypatch.undo()
    again = llm.generate(prompts, _greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    _check(llm)


def test_failed_step_reports_the_error_on_outputs(model, monkeypatch):
    llm = _llm(model)
    engine = llm.engine
    rid = engine.add_request(_prompts([6])[0], _greedy(4))
    _fail_once(monkeypatch, engine.runner, "execute", RuntimeError("device lost"))
    engine.step()
    with pytest.raises(StepFailedError, match="device lost") as info:
        engine.step()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not engine.has_unfinished_requests()
    with pytest.raises(UnknownRequestError):
        engine.abort_request(rid)
    _check(llm)


def test_bad_kernel_backend_is_refused_at_construction(model):
    with pytest.raises(InvalidArgumentError, match="backend"):
        _llm(model, kernel_backend="bogus")


# ---- abandoned streams -------------------------------------------------------------------


def test_closing_a_stream_aborts_its_request(model):
    llm = _llm(model)
    engine = llm.engine
    it = engine.stream(_prompts([6])[0], _greedy(200))
    first = next(it)
    assert not first.finished and engine.has_unfinished_requests()
    it.close()
    assert not engine.has_unfinished_requests()
    _check(llm)


def test_an_abandoned_stream_is_aborted_when_collected(model):
    llm = _llm(model)
    engine = llm.engine
    for out in engine.stream(_prompts([6])[0], _greedy(200)):
        if len(out.outputs[0].token_ids) >= 2:
            break  # the generator is now garbage: CPython closes it at once
    gc.collect()
    steps = engine.stats.num_steps
    (short,) = llm.generate(_prompts([4], seed=5), _greedy(3), use_tqdm=False)
    assert len(short.outputs[0].token_ids) == 3
    assert engine.stats.num_steps - steps <= 4  # not the 199 steps of the abandoned stream
    _check(llm)


# ---- typed errors for bad input ----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"stop": 5}, {"stop_token_ids": 5}, {"stop": [3]}, {"seed": "x"}, {"ignore_eos": "no"}],
)
def test_bad_sampling_params_raise_invalid_argument(kwargs):
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"device": "tpu"}, {"device": "not a device"}, {"device": 3.5}, {"seed": "x"}, {"seed": -1}],
)
def test_bad_engine_arguments_raise_invalid_argument(model, kwargs):
    with pytest.raises(InvalidArgumentError):
        _llm(model, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_gpu_is_refused(model):
    with pytest.raises(InvalidArgumentError, match="CUDA"):
        _llm(model, device="cuda")


def test_bad_request_arguments_raise_typed_errors_and_change_nothing(model):
    llm = _llm(model)
    engine = llm.engine
    p = _prompts([5])[0]
    bad = [
        lambda: engine.add_request(p, _greedy(2), priority="hi"),
        lambda: engine.add_request(p, _greedy(2), priority=2**70),
        lambda: engine.add_request(p, _greedy(2), request_id=5),
        lambda: engine.add_request(p, "greedy"),
        lambda: engine.add_request(3.5, _greedy(2)),
        lambda: engine.add_request(p, _greedy(2), cache_salt=7),
        lambda: engine.add_request(p, _greedy(2, stop_token_ids=[10**6])),
        lambda: engine.add_requests("abc"),
        lambda: engine.abort_request(5),
        lambda: engine.abort_request([None]),
        lambda: engine.abort_request("nope"),
    ]
    for call in bad:
        with pytest.raises(KvCoreError):
            call()
        assert not engine.has_unfinished_requests()
    _check(llm)


def test_stop_strings_need_a_tokenizer(model):
    llm = _llm(model)  # a model given as an object: no tokenizer
    assert llm.get_tokenizer() is None
    with pytest.raises(InvalidArgumentError, match="tokenizer"):
        llm.generate([_prompts([5])[0]], _greedy(3, stop=["x"]), use_tqdm=False)
    _check(llm)


# ---- two threads on one LLM ----------------------------------------------------------------


def test_concurrent_generate_calls_both_complete(model):
    llm = _llm(model, num_blocks=256)
    a, b = _prompts([5, 12, 7], seed=11), _prompts([9, 3, 16, 4], seed=12)
    want_a = [o.outputs[0].token_ids for o in llm.generate(a, _greedy(8), use_tqdm=False)]
    want_b = [o.outputs[0].token_ids for o in llm.generate(b, _greedy(5), use_tqdm=False)]
    got = {}

    def run(name, prompts, n):
        got[name] = llm.generate(prompts, _greedy(n), use_tqdm=False)

    for _ in range(3):
        threads = [
            threading.Thread(target=run, args=("a", a, 8)),
            threading.Thread(target=run, args=("b", b, 5)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [o.outputs[0].token_ids for o in got["a"]] == want_a
        assert [o.outputs[0].token_ids for o in got["b"]] == want_b
        _check(llm)


def test_default_sampling_params_come_from_the_generation_config(model):
    llm = _llm(model)
    model.generation_config.temperature = 0.6
    model.generation_config.top_p = 0.9
    try:
        p = llm.get_default_sampling_params(max_tokens=7)
        assert (p.temperature, p.top_p, p.max_tokens) == (0.6, 0.9, 7)
        assert llm.get_default_sampling_params(temperature=0).greedy
    finally:
        model.generation_config.temperature = 1.0
        model.generation_config.top_p = 1.0
