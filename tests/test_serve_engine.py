"""The asynchronous engine in-process: shared steps, aborts, a failing step, shutdown; and the
protocol's parsing and the bench's figures, without a server."""

from __future__ import annotations

import asyncio
import types

import pytest
from kvcore import LLM, SamplingParams
from kvcore.engine.async_engine import AsyncEngine, EngineError
from kvcore.entrypoints.openai.metrics import ServerMetrics
from kvcore.entrypoints.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from kvcore.errors import InvalidArgumentError
from kvcore.tools.bench_data import knee, make_dataset, rate_seed
from kvcore.tools.bench_serve import Result, summarize

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=512, max_position_embeddings=256)  # fmt: skip


@pytest.fixture(scope="module")
def llm():
    from kvcore.models.loader import tiny_llama

    return LLM(tiny_llama(seed=1, **SMALL), num_blocks=128, max_model_len=256)


async def _collect(eng, rid, prompt, params, **kw):
    stream = await eng.submit(rid, prompt, params, **kw)
    last = None
    async for out in stream:
        last = out
    return last


def test_concurrent_requests_share_steps_and_match_generate(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    ref = llm.generate(prompts, params, use_tqdm=False)
    metrics = ServerMetrics("tiny", "vllm")
    eng = AsyncEngine(llm.engine, metrics=metrics)
    try:
        steps0 = eng.snapshot["num_steps"]

        async def main():
            return await asyncio.gather(
                *(_collect(eng, f"r{i}", p, params) for i, p in enumerate(prompts))
            )

        outs = asyncio.run(main())
        assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
        assert eng.snapshot["num_steps"] - steps0 < 6 * 8  # batched, not one after the other
        assert eng.snapshot["all_blocks_free"]
        text = metrics.render().decode()
        assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"} 6.0' in text
    finally:
        eng.stop()


def test_bad_request_raises_and_abort_frees_blocks(llm):
    eng = AsyncEngine(llm.engine)
    try:

        async def main():
            with pytest.raises(InvalidArgumentError):
                await eng.submit("bad", [1, 2, 10**6], SamplingParams(max_tokens=2))
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            stream = await eng.submit("long", [3, 4, 5], params)
            async for _ in stream:
                break  # the consumer leaves: the request is aborted at the next step
            await stream.aclose()
            for _ in range(200):
                await asyncio.sleep(0.02)
                if eng.snapshot["num_unfinished"] == 0:
                    break

        asyncio.run(main())
        assert eng.snapshot["num_unfinished"] == 0 and eng.snapshot["all_blocks_free"]
    finally:
        eng.stop()


def test_failing_step_fails_its_requests_and_the_loop_keeps_serving(llm, monkeypatch):
    eng = AsyncEngine(llm.engine)
    real_step = llm.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", flaky_step)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

        async def main():
            with pytest.raises(EngineError, match="injected failure"):
                await _collect(eng, "x", [7, 8, 9], params)
            return await _collect(eng, "y", [7, 8, 9], params)

        out = asyncio.run(main())
        assert out.finished and len(out.outputs[0].token_ids) == 4
        assert eng.running
    finally:
        eng.stop()
    assert not eng.running


def test_stop_aborts_in_flight_requests(llm):
    eng = AsyncEngine(llm.engine)

    async def main():
        stream = await eng.submit("s", [3, 4], SamplingParams(max_tokens=250, ignore_eos=True))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(eng.stop)
        last = None
        async for out in stream:
            last = out
        return last

    out = asyncio.run(main())
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert llm.engine.all_blocks_free()


def test_parse_body_errors_name_the_parameter():
    ok = parse_body(CompletionRequest, b'{"model": "m", "prompt": [1, 2], "temperature": 0}')
    assert ok.prompt == [1, 2] and ok.temperature == 0.0 and ok.max_tokens == 16
    cases = {
        b"{": None,
        b'{"model": "m"}': "prompt",
        b'{"model": "m", "prompt": "a", "n": "2"}': "n",
        b'{"model": "m", "prompt": "a", "best_of": 0}': "best_of",
        b'{"model": "m", "prompt": "a", "x": 0}': "x",
        b'{"model": "m", "prompt": "a", "stream": 1}': "stream",
    }
    for raw, param in cases.items():
        with pytest.raises(ApiError) as e:
            parse_body(CompletionRequest, raw)
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(ApiError) as e:
        parse_body(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user"}], "n": 0}')
    assert e.value.param == "n"


def test_bench_summary_goodput_and_knee():
    args = types.SimpleNamespace(slo_ttft_ms=100.0, slo_itl_ms=20.0, cost_per_hour=3.6)
    fast = Result(ok=True, start=0.0, end=0.15, events=[0.05, 0.06, 0.07], output_tokens=11)
    slow = Result(ok=True, start=0.0, end=0.5, events=[0.3, 0.4], output_tokens=2)
    failed = Result(ok=False, status=503, error="busy", start=0.0, end=0.01)
    fig = summarize(args, 2.0, [fast, slow, failed], 1.0, {}, {})
    assert fig["requests_completed"] == 2 and fig["requests_failed"] == 1
    assert fig["requests_refused_503"] == 1
    assert fig["goodput_req_per_s"] == 1.0  # only `fast` meets TTFT <= 100 ms, TPOT <= 20 ms
    assert fig["output_tok_per_s"] == 13.0
    assert fig["ttft_p50_ms"] == pytest.approx(175.0)
    assert fig["cost_per_m_useful_tok_usd"] == pytest.approx(0.001 / 11e-6)

    def row(rate, goodput, sent, duration, failed=0):
        return {
            "request_rate": rate,
            "goodput_req_per_s": goodput,
            "requests_completed": sent - failed,
            "requests_failed": failed,
            "duration_s": duration,
        }

    # The knee counts requests meeting the SLO (>= 90 %), not goodput against the offered
    # rate: 24 Poisson arrivals at 0.125 req/s took 240 s, every one met the SLO.
    rows = [row(0.125, 0.1, 24, 240.0), row(1.0, 1.0, 10, 10.0), row(2.0, 1.9, 20, 10.0)]
    assert knee(rows + [row(4.0, 2.0, 40, 10.0)]) == 2.0
    assert knee(rows[:1]) == 0.125
    assert knee([row(2.0, 1.7, 20, 10.0, failed=2)]) is None  # 17 of 20 met it
    reqs = make_dataset("shared-prefix", 3, prefix_len=32, input_len=8, vocab_size=100)
    assert all(r.body["prompt"][:32] == reqs[0].body["prompt"][:32] for r in reqs)
    chat = make_dataset("chat", 4, max_tokens=40)
    assert all(r.path == "/v1/chat/completions" and r.body["max_tokens"] <= 40 for r in chat)


def test_each_rate_draws_its_own_prompts():
    """A sweep must not replay one prompt list at every rate (a prefix cache would serve the
    later rates from the earlier ones)."""
    seeds = [rate_seed(3, i) for i in range(3)]
    assert seeds[0] == 3 and len(set(seeds)) == 3 and 4 not in seeds  # 4: the warm-up's
    a, b = (make_dataset("chat", 6, seed=s, max_tokens=8) for s in seeds[:2])
    assert [r.body["messages"] for r in a] != [r.body["messages"] for r in b]
    users = [r.body["messages"][1]["content"] for r in make_dataset("chat", 16, seed=5)]
    assert len(set(users)) == 16  # no prompt repeats within a run of up to 16
    assert all(r.body["messages"][0]["role"] == "system" for r in a)
