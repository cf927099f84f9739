"""The engine under failure and misuse: tenant isolation (cache_salt), num_cached_tokens,
failures inside a step, abandoned streams and typed errors for bad input (issue 17)."""

import pytest
from kvcore.llm import LLM
from kvcore.models import tiny_llama
from kvcore.requests import salt_namespace
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
