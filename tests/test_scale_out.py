"""kvcore serve on Ray Serve: 2 replicas of the tiny model behind the OpenAI ingress.

One Ray and one Serve app for the whole module (starting them is most of the time). Skipped
when Ray Serve is not installed.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install 'ray[serve]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed")

from kvcore.scaleout.ray_app import build_app  # noqa: E402
from serve_util import ROOT, free_port  # noqa: E402

ENGINE = ["--model", "tiny-llama", "--num-blocks", "96", "--threads", "1"]
ENGINE += ["--max-model-len", "512", "--max-num-seqs", "8"]
SHARED = list(range(100, 148))  # a 48-token "system prompt"


@pytest.fixture(scope="module")
def app_url():
    path = os.pathsep.join([str(ROOT / "python"), str(ROOT / "kernels")])
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=80 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_WAIT_POLICY": "PASSIVE"}},
    )
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(ENGINE, replicas=2, hub_name="hub-test"), name="t", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, prompt: list[int], max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0.0, "return_token_ids": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def test_greedy_through_replicas_equals_generate(app_url):
    from kvcore import LLM
    from kvcore.params import SamplingParams

    prompts = [SHARED + [7, 8, 9], SHARED + [10, 11], list(range(300, 340)), SHARED + [7, 8, 9]]
    got = []
    for p in prompts:
        r = complete(app_url, p, 6)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvcore-replica"].startswith("SERVE_REPLICA::")
        got.append(r.json()["choices"][0]["token_ids"])
    llm = LLM("tiny-llama", num_blocks=96, max_model_len=512)
    want = [
        list(o.outputs[0].token_ids)
        for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    ]
    assert got == want
    # The stream carries the same tokens.
    r = complete(app_url, prompts[1], 6, stream=True)
    assert r.status_code == 200
    streamed = [
        t
        for line in r.text.splitlines()
        if line.startswith("data: {")
        for t in json.loads(line[6:])["choices"][0].get("token_ids", [])
    ]
    assert streamed == want[1]
    # Bad input is the ingress's 400, as with one process.
    assert complete(app_url, [], 3).status_code == 400
    assert complete(app_url, [1, 2], 3, model="nope").status_code == 404


def test_rays_prefix_router_sees_the_prompt_and_outputs_equal_generate(app_url):
    """``--router ray-prefix``: Ray's PrefixCacheAffinityRouter reads ``RoutedRequest.prompt``."""
    from kvcore import LLM
    from kvcore.params import SamplingParams

    app = build_app(ENGINE, replicas=2, router="ray-prefix", hub_name="hub-r")
    serve.run(app, name="r", route_prefix="/r")
    try:
        url = app_url + "/r"
        prompts = [SHARED + [i, 5] for i in range(4)] + [list(range(300, 340))]
        got, where = [], []
        for p in prompts:
            r = complete(url, p, 4)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
            where.append(r.headers["x-kvcore-replica"])
        # Sequential requests, equal queues: the shared prefix keeps one replica (p2c would
        # pick at random), and a later one hits that replica's cache.
        assert len(set(where[:4])) == 1
        r = complete(url, SHARED + [9], 2)
        assert r.headers["x-kvcore-replica"] == where[0]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        llm = LLM("tiny-llama", num_blocks=96, max_model_len=512)
        want = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
        assert got == [list(o.outputs[0].token_ids) for o in want]
    finally:
        serve.delete("r")


def test_prefix_routing_and_merged_metrics(app_url):
    from prometheus_client.parser import text_string_to_metric_families

    where = {complete(app_url, SHARED + [i], 2).headers["x-kvcore-replica"] for i in range(4)}
    assert len(where) == 1  # one system prompt, sequential requests: one replica
    r = complete(app_url, SHARED + [99], 2)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    time.sleep(2.5)  # replicas push their metrics every second
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(app_url + "/metrics").text)}
    replicas = {s.labels["replica"] for s in fams["kvcore:request_success"].samples}
    assert len(replicas) == 2
    health = httpx.get(app_url + "/health").json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2


def test_killed_replica_fails_its_requests_with_503_and_is_replaced(app_url):
    long_a = list(range(600, 620))
    results: dict[str, httpx.Response] = {}
    with httpx.Client(timeout=120) as client:
        body = {"model": "tiny-llama", "prompt": long_a, "max_tokens": 400, "stream": True}
        body |= {"ignore_eos": True}
        with client.stream("POST", app_url + "/v1/completions", json=body) as stream:
            victim = stream.headers["x-kvcore-replica"]

            def send(name: str, prompt: list[int], n: int) -> None:
                results[name] = complete(app_url, prompt, n, ignore_eos=True)

            other = threading.Thread(target=send, args=("other", list(range(700, 720)), 60))
            other.start()
            time.sleep(0.5)  # 'other' is on the other replica (least loaded)
            same = threading.Thread(target=send, args=("same", long_a, 400))
            same.start()  # same prefix, equal queues: the victim
            time.sleep(1.0)
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            tail = b"".join(stream.iter_bytes())
        assert b'"error"' in tail and b"replica failed" in tail  # in-band: headers were sent
    same.join(120)
    other.join(120)
    assert results["same"].status_code == 503, results["same"].text
    assert results["same"].json()["error"]["code"] == "replica_failed"
    assert results["same"].headers["retry-after"] == "1"
    assert results["other"].status_code == 200
    assert results["other"].headers["x-kvcore-replica"] != victim
    # The survivor keeps serving; Serve starts a replacement.
    assert complete(app_url, long_a, 2).status_code == 200
    deadline = time.monotonic() + 90
    names: set[str] = set()
    while time.monotonic() < deadline:
        names = {h["actor_name"] for h in httpx.get(app_url + "/health").json()["replicas"]}
        if len(names) == 2 and victim not in names:
            break
        time.sleep(1)
    assert len(names) == 2 and victim not in names


def test_disaggregated_prefill_through_the_shared_tier(app_url, tmp_path):
    import shutil

    from kvcore import LLM
    from kvcore.params import SamplingParams
    from tier_fixtures import RedisServer

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    redis = RedisServer(binary, str(tmp_path))
    redis.start()
    try:
        argv = [*ENGINE, "--host-kv-mb", "4", "--remote-url", redis.url]
        with pytest.raises(ValueError, match="remote-url"):
            build_app(ENGINE, replicas=1, prefill_replicas=1)
        app = build_app(argv, replicas=1, prefill_replicas=1, hub_name="hub-d")
        serve.run(app, name="d", route_prefix="/d")
        url = app_url + "/d"
        prompts = [SHARED + [1, 2, 3], SHARED + [4, 5]]
        got = []
        for p in prompts:
            r = complete(url, p, 5)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
            # The first prompt is new to the decode replica: its full blocks come from Redis.
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        llm = LLM("tiny-llama", num_blocks=96, max_model_len=512)
        want = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5))
        assert got == [list(o.outputs[0].token_ids) for o in want]
    finally:
        serve.delete("d")
        redis.stop()
