"""LLMEngine / LLM on a tiny random Llama, token for token against transformers' generate.

Covers mixed lengths in one batch, chunked prefill, prefix hits, preemption forced by a small
cache, n > 1, all blocks back after each run, seeds, logprobs, penalties, abort and bad input.
"""

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy
from kvcore import InvalidArgumentError, KvCoreError, TooLongError
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import tiny_llama
from kvcore.params import SamplingParams

VOCAB = 128
SMALL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3, **SMALL)


def _prompts(lengths, seed=0, prefix=()):
    rng = np.random.default_rng(seed)
    return [list(prefix) + rng.integers(3, VOCAB, n).tolist() for n in lengths]


def _hf_greedy(model, prompt, max_tokens, **kwargs):
    return hf_greedy(model, prompt, max_tokens, pad_token_id=0, **kwargs)


def _check(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    assert engine.all_blocks_free()
    assert engine.sampler.num_active == 0


def _llm(model, **kw):
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(model, **kw)


def _greedy(n_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True, **kw)


def test_mixed_lengths_chunked_prefill_match_generate(model):
    prompts = _prompts([3, 17, 40, 9, 64, 1])
    max_tokens = [12, 5, 20, 1, 9, 15]
    # A 24-token budget splits the long prompts over several steps, beside running decodes.
    llm = _llm(model, max_num_batched_tokens=24)
    outs = llm.generate(prompts, [_greedy(m) for m in max_tokens], use_tqdm=False)
    for o, p, m in zip(outs, prompts, max_tokens, strict=True):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == _hf_greedy(model, p, m)
        assert o.outputs[0].finish_reason == "length"
        m_ = o.metrics
        assert 0 <= m_.queue_time <= m_.time_to_first_token <= m_.e2e_latency
        assert len(o.metrics.inter_token_latencies) == m - 1
    _check(llm)


def test_prefix_hits_match_generate(model):
    shared = _prompts([30], seed=1)[0]
    first = _prompts([5, 9], seed=2, prefix=shared)
    second = _prompts([7, 3, 12], seed=3, prefix=shared)
    llm = _llm(model, prefix_caching="radix")
    llm.generate(first, _greedy(6), use_tqdm=False)
    outs = llm.generate(second, _greedy(6), use_tqdm=False)
    assert llm.engine.scheduler.stats().prefix_hit_tokens >= 3 * 28  # 7 blocks of 4, per request
    for o, p in zip(outs, second, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(model, p, 6)
    _check(llm)


def test_forced_preemption_matches_generate(model):
    prompts = _prompts([20, 25, 30, 18, 22], seed=4)
    # 24 usable blocks of 4 tokens: each request needs up to 12, so they cannot all run.
    llm = _llm(model, num_blocks=25, max_num_batched_tokens=64)
    outs = llm.generate(prompts, _greedy(24), use_tqdm=False)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    for o, p in zip(outs, prompts, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(model, p, 24)
    _check(llm)


class _PlanSpy:
    """Wraps the engine's scheduler and keeps (query lengths, seq lens) of every plan."""

    def __init__(self, scheduler):
        self._inner, self.rows = scheduler, []

    def schedule(self):
        plan = self._inner.schedule()
        self.rows.append((np.diff(np.asarray(plan.query_start_loc)), np.asarray(plan.seq_lens)))
        return plan

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_without_chunked_prefill_prompts_run_whole_and_match_generate(model):
    prompts = _prompts([30, 12, 25, 7], seed=8)
    llm = _llm(model, max_num_batched_tokens=48, max_model_len=48, enable_chunked_prefill=False)
    spy = llm.engine.scheduler = _PlanSpy(llm.engine.scheduler)
    outs = llm.generate(prompts, _greedy(10), use_tqdm=False)
    # A multi-token row is a whole prompt (it ends where its sequence ends and starts at 0: no
    # prefix hits here), never a chunk; and the 48-token budget forced some prompt to wait.
    assert all(n == 1 or n == s for q, seq in spy.rows for n, s in zip(q, seq, strict=True))
    assert len(spy.rows[0][0]) < len(prompts)
    for o, p in zip(outs, prompts, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(model, p, 10)
    llm.engine.scheduler = spy._inner
    _check(llm)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        _llm(model, max_num_batched_tokens=32, max_model_len=48, enable_chunked_prefill=False)
    with pytest.raises(InvalidArgumentError, match="needs enable_chunked_prefill"):
        _llm(model, long_prefill_token_threshold=8, enable_chunked_prefill=False)


def test_n_samples_fork_greedy(model):
    prompts = _prompts([10, 14], seed=5)
    llm = _llm(model)
    outs = llm.generate(prompts, _greedy(9, n=3), use_tqdm=False)
    for o, p in zip(outs, prompts, strict=True):
        ref = _hf_greedy(model, p, 9)
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(c.token_ids == ref for c in o.outputs)
    _check(llm)


def test_seeded_sampling_reproducible_whatever_the_batch(model):
    target = _prompts([12], seed=6)[0]
    others = _prompts([5, 30, 8], seed=7)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=77, ignore_eos=True)
    alone = _llm(model).generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    llm = _llm(model, seed=123)
    mixed = llm.generate(
        others[:2] + [target] + others[2:], [noise, noise, params, noise], use_tqdm=False
    )
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=78, ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    _check(llm)


def test_logprobs_and_penalties_match_generate(model):
    prompt = _prompts([15], seed=8)[0]
    llm = _llm(model)
    out = llm.generate([prompt], _greedy(8, logprobs=2), use_tqdm=False)[0].outputs[0]
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    ref = torch.log_softmax(full.float(), -1)
    np.testing.assert_allclose(
        out.logprobs, ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-4
    )
    assert list(out.top_logprobs[0]) == ref[0].topk(2).indices.tolist()
    assert out.cumulative_logprob == pytest.approx(sum(out.logprobs), abs=1e-5)
    pen = llm.generate([prompt], _greedy(12, repetition_penalty=1.5), use_tqdm=False)[0]
    assert pen.outputs[0].token_ids == _hf_greedy(model, prompt, 12, repetition_penalty=1.5)
    _check(llm)


def test_stop_token_ids_and_eos(model):
    prompt = _prompts([11], seed=9)[0]
    free = _hf_greedy(model, prompt, 20)
    stop_tok = free[6]
    llm = _llm(model)
    out = llm.generate([prompt], _greedy(20, stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == free[: free.index(stop_tok) + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_tok)
    _check(llm)


def test_abort_mid_flight_frees_blocks(model):
    llm = _llm(model)
    engine = llm.engine
    keep, drop = engine.add_requests(_prompts([20, 40], seed=10), _greedy(30))
    for _ in range(4):
        engine.step()
    before = engine.scheduler.stats().num_free_blocks
    (aborted,) = engine.abort_request(drop)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.scheduler.stats().num_free_blocks > before
    with pytest.raises(KvCoreError):
        engine.abort_request(drop)
    outs = list(engine.run())
    assert [o.request_id for o in outs] == [keep] and len(outs[0].outputs[0].token_ids) == 30
    _check(llm)


def test_bad_input_is_refused_before_scheduling_and_serving_goes_on(model):
    llm = _llm(model, num_blocks=40)
    engine = llm.engine
    good = engine.add_request(_prompts([8])[0], _greedy(5))
    bad = [
        ([], _greedy(5), InvalidArgumentError),
        ([1, 2, VOCAB], _greedy(5), InvalidArgumentError),
        ([-1, 2], _greedy(5), InvalidArgumentError),
        (_prompts([300])[0], _greedy(5), TooLongError),  # beyond max_position_embeddings
        (_prompts([100])[0], _greedy(100), TooLongError),  # more than the whole cache
        ("text without a tokenizer", _greedy(5), InvalidArgumentError),
        ([[1, 2]], _greedy(5), InvalidArgumentError),
    ]
    for prompt, params, err in bad:
        with pytest.raises(err):
            engine.add_request(prompt, params)
    with pytest.raises(InvalidArgumentError):
        engine.add_requests([[1, 2], [3, 4]], [_greedy(2)])
    with pytest.raises(KvCoreError):
        engine.add_request([1, 2], _greedy(2), request_id=good)
    assert engine.get_num_unfinished_requests() == 1
    outs = list(engine.run())
    assert [o.request_id for o in outs] == [good]
    _check(llm)
    with pytest.raises(InvalidArgumentError):
        LLM(model, block_size=3)
    with pytest.raises(InvalidArgumentError):
        LLM(model, max_num_seqs=0)


def test_streaming_yields_growing_outputs(model):
    llm = _llm(model)
    prompt = _prompts([6])[0]
    seen = [len(o.outputs[0].token_ids) for o in llm.engine.stream(prompt, _greedy(5))]
    assert seen == [1, 2, 3, 4, 5]
    _check(llm)
