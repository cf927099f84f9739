"""LLMEngine on quantized KV caches (``kv_format``): the engine's paths (chunked prefill, prefix
hits, copy-on-write forks, preemption, abort) over every quantized format, schedule invariance of
the per-token formats, the memory budget, and bad formats refused before anything is allocated.
Quality against the model-dtype cache on the embedded model is in test_engine_smollm2.py.
"""

import numpy as np
import pytest
from kvcore import CacheConfig, InvalidArgumentError
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import tiny_llama
from test_engine import SMALL, VOCAB, _check, _greedy, _prompts

QCFG = {**SMALL, "hidden_size": 128}  # head_dim 32: the smallest int4 / int2 pack (groups of 32)
FORMATS = ["fp8_e4m3", "int8", "int4", "int2", "kivi2", "kivi4", ["int8", "kivi2"]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5, **QCFG)


@pytest.mark.parametrize(
    "fmt, window", [(f, 0) for f in FORMATS] + [("kivi2", 2)], ids=lambda x: str(x)
)
def test_every_format_serves_prefix_fork_chunked_and_preempted(model, fmt, window):
    shared = _prompts([21], seed=1)[0]
    prompts = _prompts([3, 30, 11], seed=2, prefix=shared) + _prompts([17], seed=3)
    # 4-token blocks, a 16-token budget (chunked prefill) and 23 usable blocks, fewer than the
    # requests need at once (the n=2 request forks, copy-on-write): preemption happens.
    llm = LLM(
        model,
        kv_format=fmt,
        kivi_window=window,
        block_size=4,
        num_blocks=24,
        max_num_batched_tokens=16,
        seed=0,
    )
    if window:
        assert llm.engine.runner.kv_caches[0].residual_state.window == window
    params = [_greedy(20), _greedy(20, n=2), _greedy(12), _greedy(20)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.scheduler.stats()
    assert stats.prefix_hit_tokens > 0
    assert stats.num_preemptions > 0
    for o, p in zip(outs, params, strict=True):
        assert [len(c.token_ids) for c in o.outputs] == [p.max_tokens] * p.n
        assert all(0 <= t < VOCAB for c in o.outputs for t in c.token_ids)
    # Greedy samples of one prompt share its blocks; they stay equal through copy-on-write.
    assert outs[1].outputs[0].token_ids == outs[1].outputs[1].token_ids
    _check(llm)
    # Same engine again, now with prefix hits on the first run's blocks: a per-token format
    # stores each token alone, so the tokens are the same (stale codes or scales would show).
    # KIVI quantizes a block once it is full, so what a hit reads depends on the schedule.
    again = llm.generate(prompts, params, use_tqdm=False)
    if "kivi" not in str(fmt):
        assert [c.token_ids for o in again for c in o.outputs] == [
            c.token_ids for o in outs for c in o.outputs
        ]
    _check(llm)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8", "int4"])
def test_per_token_formats_are_schedule_invariant(model, fmt):
    """A per-token format encodes each token alone, so chunking, prefix hits and preemption do
    not change what is stored: greedy tokens equal one unconstrained run's."""
    shared = _prompts([26], seed=4)[0]
    prompts = _prompts([9, 4, 14, 6], seed=5, prefix=shared)
    kw = dict(kv_format=fmt, kv_scale=0.25 if fmt.startswith("fp8") else None, block_size=4)
    roomy = LLM(model, num_blocks=256, max_num_batched_tokens=512, prefix_caching="off", **kw)
    tight = LLM(model, num_blocks=36, max_num_batched_tokens=12, prefix_caching="radix", **kw)
    want = roomy.generate(prompts, _greedy(24), use_tqdm=False)
    got = tight.generate(prompts, _greedy(24), use_tqdm=False)
    stats = tight.engine.scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    _check(tight)


def test_quantized_format_changes_tokens_but_stays_close(model):
    """The format is really used: int2's noise changes greedy tokens, int8's mostly does not."""
    prompts = _prompts([40, 25, 33], seed=6)

    def run(fmt):
        llm = LLM(model, kv_format=fmt, block_size=4, num_blocks=128)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(16), use_tqdm=False)]

    ref, int8, int2 = run("auto"), run("int8"), run("int2")

    def agree(a, b):
        return np.mean(
            [x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
        )

    assert agree(ref, int8) >= 0.75
    assert agree(ref, int2) < agree(ref, int8)


def test_abort_mid_flight_frees_quantized_blocks(model):
    llm = LLM(model, kv_format="kivi2", block_size=4, num_blocks=64)
    engine = llm.engine
    ids = engine.add_requests(_prompts([13, 22], seed=7), _greedy(30))
    for _ in range(4):
        engine.step()
    engine.abort_request(ids[0])
    while engine.has_unfinished_requests():
        engine.step()
    _check(llm)


def test_memory_budget_buys_more_blocks_in_smaller_formats(model):
    budget = 8 << 20
    blocks = {
        fmt: LLM(model, kv_format=fmt, kv_memory_bytes=budget).engine.runner.num_blocks
        for fmt in ("auto", "int8", "int4")
    }
    # fp32 K/V at head_dim 32: 256 bytes per token per head; int8 66, int4 about 40.
    assert blocks["int8"] > 3.5 * blocks["auto"]
    assert blocks["int4"] > 1.5 * blocks["int8"]
    kivi = LLM(model, kv_format="kivi2", kv_memory_bytes=budget, max_num_seqs=8).engine.runner
    assert kivi.kv_cache_bytes <= budget  # the residual pool is counted in the budget


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kv_format="int5"), "kv_format must be one of"),
        (dict(kv_format=[]), "non-empty list"),
        (dict(kv_format=["int8"]), "one entry per layer"),
        (dict(kv_format=["int8", "float16"]), "per-layer kv_format list"),
        (dict(kv_format="fp8_e4m3", kv_scale=-1.0), "kv_scale"),
        (dict(kv_format="fp8_e4m3", kv_scale=float("nan")), "kv_scale"),
        (dict(kv_format="kivi2", kivi_window=-1), "kivi_window"),
    ],
)
def test_bad_formats_are_refused(model, kw, match):
    with pytest.raises(InvalidArgumentError, match=match):
        LLM(model, num_blocks=16, **kw)


def test_format_the_geometry_cannot_pack_is_refused():
    small = tiny_llama(seed=0, **{**QCFG, "hidden_size": 64})  # head_dim 16
    with pytest.raises(InvalidArgumentError, match="kv_format 'int4'"):
        LLM(small, kv_format="int4", num_blocks=16)
    LLM(small, kv_format="int8", num_blocks=16)  # per-token int8 packs any head dim


def test_cache_config_validates_up_front():
    assert CacheConfig(kv_format=("int8", "auto")).kv_format == ["int8", "auto"]
    assert CacheConfig(kv_format="kivi2").quantized
    assert not CacheConfig(kv_format="float16").quantized
    with pytest.raises(InvalidArgumentError):
        CacheConfig(kv_format=3)  # type: ignore[arg-type]
