"""``kvcore serve`` end to end: one server subprocess (a tiny random Llama with a small trained
tokenizer) shared by the module, talked to with the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_util import ServerProcess, make_model_dir

KEY = "sk-test-key"
MAX_MODEL_LEN = 256
BODY_CAP = 1 << 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def server_process(model_dir):
    srv = ServerProcess(
        "--model", str(model_dir), "--served-model-name", "tiny", "--api-key", KEY,
        "--num-blocks", "1024", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32",
        "--max-waiting", "64", "--max-body-bytes", str(BODY_CAP), "--threads", "1",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0  # SIGTERM: a graceful exit


@pytest.fixture(scope="module")
def server(server_process):
    return server_process.wait_ready()


@pytest.fixture(scope="module")
def llm(model_dir, server_process):  # loads while the server starts
    from kvcore import LLM

    return LLM(str(model_dir), num_blocks=256, max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if not isinstance(body, bytes | str):
        body = json.dumps(body)
    return httpx.post(server.url + path, content=body, headers=headers, timeout=60, **kw)


def _wait_idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = server.health()
        if h["num_unfinished"] == 0 and h["all_blocks_free"]:
            return h
        time.sleep(0.1)
    raise AssertionError(f"server not idle: {server.health()}")


def test_greedy_matches_llm_generate(llm, client):
    from kvcore import SamplingParams

    prompts = ["The for statement", "A class definition creates", "Exceptions are"]
    ref = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    got = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=12, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert len(got.choices) == 3
    for choice, out in zip(got.choices, ref, strict=True):
        assert choice.token_ids == out.outputs[0].token_ids
        assert choice.text == out.outputs[0].text
        assert choice.finish_reason == out.outputs[0].finish_reason
    assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in ref)
    # streaming gives the same tokens, and token-id prompts work too
    stream = client.completions.create(
        model="tiny", prompt=ref[0].prompt_token_ids, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids, reasons, usage = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            ids += c.token_ids
            reasons.append(c.finish_reason)
        usage = chunk.usage or usage
    assert ids == ref[0].outputs[0].token_ids
    assert reasons[-1] == ref[0].outputs[0].finish_reason and set(reasons[:-1]) <= {None}
    assert usage.completion_tokens == len(ids)


def test_chat_matches_llm_chat(llm, client):
    from kvcore import SamplingParams

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is for?"}]
    ref = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == ref.outputs[0].text
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids)
    text, roles = "", []
    for chunk in client.chat.completions.create(
        model="tiny", messages=msgs, max_completion_tokens=10, temperature=0, stream=True
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
            roles.append(c.delta.role)
    # the stream holds back the bytes of an incomplete character at the very end
    assert roles[0] == "assistant" and text.rstrip("\ufffd") == ref.outputs[0].text.rstrip("\ufffd")


def test_sampling_options_n_seed_logprobs_stop(client):
    kw = dict(model="tiny", prompt="The while loop", max_tokens=8, temperature=1.0, seed=7)
    a = client.completions.create(n=3, logprobs=2, **kw)
    b = client.completions.create(n=3, logprobs=2, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True,
        top_logprobs=3, extra_body={"top_k": 5, "min_p": 0.01},
    )  # fmt: skip
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    full = client.completions.create(model="tiny", prompt="x", max_tokens=16, temperature=0)
    if len(full.choices[0].text) > 3:
        stop = full.choices[0].text[2:4]
        cut = client.completions.create(
            model="tiny", prompt="x", max_tokens=16, temperature=0, stop=[stop]
        )
        assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


def test_models_auth_and_unknown_model(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    for key in (None, "sk-wrong", KEY + "x"):
        r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "a"}, key=key)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="a", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b'{"model": "tiny", "prompt": "a"', 400, None),  # malformed JSON
        (b"[1, 2]", 400, None),  # not an object
        ({"model": "tiny", "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),  # wrong type
        ({"model": "tiny", "prompt": 5}, 400, "prompt"),
        ({"model": "tiny", "prompt": "a", "frobnicate": 1}, 400, "frobnicate"),  # unknown field
        ({"model": "tiny", "prompt": "a", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "a", "n": 33}, 400, "n"),  # over --max-num-seqs
        ({"model": "tiny", "prompt": "a", "temperature": 3.0}, 400, "temperature"),
        ({"model": "tiny", "prompt": "a", "logit_bias": {"1": 5}}, 400, "logit_bias"),
        ({"model": "tiny", "prompt": [1, 2, 99999]}, 400, None),  # outside the vocabulary
        ({"model": "tiny", "prompt": [5] * MAX_MODEL_LEN}, 400, "prompt"),  # too long
        ({"model": "tiny", "prompt": [5] * 200, "max_tokens": 100}, 400, "prompt"),
        ({"model": "tiny", "prompt": "a" * (BODY_CAP + 10)}, 413, None),  # byte cap
        ({"prompt": "a"}, 400, "model"),
        ({"model": "tiny", "messages": []}, 400, None),  # a chat body on /v1/completions
    ],
)
def test_bad_input_is_an_openai_error_and_server_keeps_serving(server, client, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if status == 400 and isinstance(prompt, list) and len(prompt) >= 200:  # the two too long
        assert err["code"] == "context_length_exceeded"
    ok = client.completions.create(model="tiny", prompt="ok", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_bad_chat_input(server):
    bad = [
        {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "tiny", "messages": [{"role": "user", "content": "x", "extra": 1}]},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}]},
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    ]
    for body in bad:
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and "error" in r.json(), r.text


def test_cache_salt_isolates_prefix_hits(client):
    prompt = list(range(10, 10 + 64))

    def cached(salt):
        extra = {"cache_salt": salt} if salt else {}
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 48  # same namespace: the full blocks hit
    assert cached("tenant-b") == 0  # another tenant never shares a hit
    assert cached(None) == 0


def _metrics(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(
                f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"
            )
            out[key] = s.value
    return out


def test_metrics_agree_with_engine_statistics(server, client):
    _wait_idle(server)
    before = _metrics(server)
    prompts, completions = 0, 0
    for i in range(4):
        r = client.completions.create(model="tiny", prompt=[7] * 40 + [i + 3], max_tokens=5)
        prompts += r.usage.prompt_tokens
        completions += r.usage.completion_tokens
    after = _metrics(server)
    health = _wait_idle(server)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("kvcore:prompt_tokens_total") == prompts
    assert delta("kvcore:generation_tokens_total") == completions
    finished = sum(
        delta(f"kvcore:request_success_total|finished_reason={r}")
        for r in ("stop", "length", "abort")
    )
    assert finished == 4
    assert delta("kvcore:e2e_request_latency_seconds_count") == 4
    assert delta("kvcore:request_server_overhead_seconds_count") == 4
    assert after["kvcore:prefix_cache_queries_total"] == health["prefix_query_tokens"]
    assert after["kvcore:prefix_cache_hits_total"] == health["prefix_hit_tokens"]
    assert delta("kvcore:prefix_cache_hits_total") >= 3 * 32  # the shared 40-token prefix
    assert after["kvcore:num_preemptions_total"] == health["num_preemptions"]
    assert after["kvcore:num_requests_running"] == 0
    assert any(k.startswith("kvcore:cache_config_info") for k in after)


async def _many_streams(server, num):
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=120) as c:

        async def one(i):
            body = {
                "model": "tiny", "prompt": [3 + i % 50] * 8 + [i % 300 + 4], "max_tokens": 6,
                "stream": True, "ignore_eos": True, "return_token_ids": True,
            }  # fmt: skip
            async with c.stream(
                "POST", server.url + "/v1/completions", json=body, headers=headers
            ) as r:
                if r.status_code == 503:
                    assert r.headers.get("retry-after") and (await r.aread())
                    return i, 503, None
                assert r.status_code == 200, await r.aread()
                ids, rid = [], None
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        rid = chunk["id"]
                        ids += chunk["choices"][0]["token_ids"]
                return i, 200, (rid, ids)

        return await asyncio.gather(*(one(i) for i in range(num)))


def test_256_concurrent_streams_complete_or_503(server):
    _wait_idle(server)
    results = asyncio.run(_many_streams(server, 256))
    assert sorted(i for i, _, _ in results) == list(range(256))  # none lost
    done = [r for _, status, r in results if status == 200]
    refused = [i for i, status, _ in results if status == 503]
    assert len(done) + len(refused) == 256 and len(done) >= 32
    assert refused  # 256 at once against 32 running + 64 waiting: some are turned away
    assert len({rid for rid, _ in done}) == len(done)  # none duplicated
    assert all(len(ids) == 6 for _, ids in done)
    health = _wait_idle(server)
    assert health["all_blocks_free"] and health["num_running"] == 0


def test_disconnecting_clients_leave_nothing_running(server):
    async def leave_early():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(timeout=60) as c:

            async def one(i):
                body = {"model": "tiny", "prompt": [i + 5] * 4, "max_tokens": 200,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                async with c.stream(
                    "POST", server.url + "/v1/completions", json=body, headers=headers
                ) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                        if n >= 2:
                            return  # closes the connection mid-stream

            await asyncio.gather(*(one(i) for i in range(8)))
            # a non-streaming client that gives up once its request runs (not after a fixed
            # time: on a quiet machine 200 tokens of the tiny model take well under a second)
            body = {"model": "tiny", "prompt": [9] * 4, "max_tokens": 200, "ignore_eos": True}
            post = asyncio.create_task(
                c.post(server.url + "/v1/completions", json=body, headers=headers)
            )
            for _ in range(2000):
                running = (await c.get(server.url + "/health")).json()["num_running"]
                if running or post.done():
                    break
                await asyncio.sleep(0.005)
            assert not post.done(), "the request finished before the client could leave"
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(leave_early())
    health = _wait_idle(server, timeout=20)
    assert health["num_running"] == 0 and health["all_blocks_free"]
    m = _metrics(server)
    assert m["kvcore:request_success_total|finished_reason=abort"] >= 9


def test_bench_serve_prints_its_figures(server, capsys, tmp_path):
    from kvcore.tools.bench_serve import main

    plot = tmp_path / "curves.png"
    argv = ["--base-url", server.url, "--api-key", KEY, "--dataset", "random", "--num-prompts",
            "8", "--request-rate", "50", "inf", "--max-tokens", "4", "--input-len", "16",
            "--vocab-size", "400", "--cost-per-hour", "1", "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 0
    lines = dict(
        line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line
    )
    for name in ("requests_completed", "requests_failed", "output_tok_per_s", "ttft_p50_ms",
                 "ttft_p95_ms", "itl_p50_ms", "goodput_req_per_s", "server_overhead_pct_of_e2e",
                 "cost_per_m_useful_tok_usd"):  # fmt: skip
        assert name in lines, name
    assert lines["requests_completed"] == "8 req" and lines["requests_failed"] == "0 req"
    assert plot.stat().st_size > 1000


def test_sigterm_finishes_in_flight_request_and_exits_zero(server):
    """Last test of the module: it stops the shared server."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def during_shutdown():
        async with httpx.AsyncClient(timeout=60, headers=headers) as c:
            task = asyncio.create_task(c.post(server.url + "/v1/completions", json=body))
            await asyncio.sleep(0.3)
            stop = asyncio.create_task(asyncio.to_thread(server.stop))
            return await task, await stop

    resp, code = asyncio.run(during_shutdown())
    assert code == 0
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
