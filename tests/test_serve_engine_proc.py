"""``kvcore serve`` with the engine core in its own process: outputs equal offline greedy under
256 concurrent streams, the engine process killed mid-stream (every client gets an error, the
server exits non-zero), SIGTERM stopping both processes, and an engine that keeps stepping while
nobody reads its outputs."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import httpx
import pytest
from serve_util import ServerProcess, env, make_model_dir

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny-chat-proc"))


def _serve(model_dir, *extra: str) -> ServerProcess:
    return ServerProcess(
        "--model", str(model_dir), "--served-model-name", "tiny", "--num-blocks", "2048",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64", "--max-waiting", "0",
        "--threads", "1", *extra,
    )  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7 + j * 13) % 390 for j in range(4 + i % 37)]


async def _stream_all(url: str, num: int, max_tokens: int):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=300) as c:

        async def one(i):
            body = {
                "model": "tiny", "prompt": _prompt(i), "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            }  # fmt: skip
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                ids = []
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        ids += chunk["choices"][0]["token_ids"]
                return ids

        return await asyncio.gather(*(one(i) for i in range(num)))


def test_256_concurrent_streams_equal_offline_greedy(model_dir):
    from kvcore import LLM, SamplingParams

    srv = _serve(model_dir)
    try:
        llm = LLM(str(model_dir), num_blocks=2048, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        ref = llm.generate([_prompt(i) for i in range(256)], params, use_tqdm=False)
        srv.wait_ready()
        got = asyncio.run(_stream_all(srv.url, 256, 10))
        want = [list(o.outputs[0].token_ids) for o in ref]
        assert sum(g == w for g, w in zip(got, want, strict=True)) == 256
        health = srv.health()
        assert health["engine_pid"] != srv.proc.pid and health["num_steps"] < 256 * 10
        engine_pid = health["engine_pid"]
    finally:
        code = srv.stop()
    assert code == 0  # SIGTERM drains both processes
    deadline = time.monotonic() + 10
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine_pid)


def test_an_idle_keep_alive_connection_outlives_clients_pools(model_dir):
    """A pooled connection idle for 6 s (past uvicorn's default 5 s) still serves a request."""
    import http.client

    srv = _serve(model_dir).wait_ready()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        socks = []
        for _ in range(2):
            conn.request("GET", "/health")  # raises RemoteDisconnected if the server closed it
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"
            socks.append(conn.sock)
            time.sleep(6)
        assert socks[0] is socks[1]  # the same connection, not a new one
    finally:
        conn.close()
        srv.stop()


def test_step_log_accounts_for_each_requests_first_token(model_dir, tmp_path, monkeypatch):
    """KVCORE_STEP_LOG: one line per engine step on the machine's one perf_counter clock, so
    ttft_breakdown finds the step that ran each prompt (its tokens, one sequence) between the
    client's send and its first byte."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "ttft_breakdown", Path(__file__).parents[1] / "benches" / "tools" / "ttft_breakdown.py"
    )
    tb = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ttft_breakdown", tb)  # dataclasses look themselves up
    spec.loader.exec_module(tb)
    log = tmp_path / "steps.log"
    monkeypatch.setenv("KVCORE_STEP_LOG", str(log))
    srv = _serve(model_dir).wait_ready()
    records = {"start_times": [], "ttfts": [], "input_lens": []}
    try:
        for i in range(3):  # one at a time: each first token comes from the prompt's own step
            prompt = _prompt(20 + i)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            t0, ttft = time.perf_counter(), None
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and ttft is None:
                        ttft = time.perf_counter() - t0
            records["start_times"].append(t0)
            records["ttfts"].append(ttft)
            records["input_lens"].append(len(prompt))
    finally:
        srv.stop()
    steps = tb.read_steps(str(log))
    assert len(steps) >= 3 * 3  # a prefill and two decode steps per request
    assert all(s.seconds > 0 and s.tokens >= 1 and s.seqs >= 1 for s in steps)
    rows = tb.breakdown(records, steps)
    assert [(r.step.tokens, r.step.seqs) for r in rows] == [(n, 1) for n in records["input_lens"]]
    assert all(r.wait >= 0 and r.deliver >= 0 and not r.shared for r in rows)
    assert "requests: 3" in tb.report(rows, top=3)


def test_engine_env_bounds_the_openmp_spin_unless_set():
    from kvcore.engine.core_client import ENGINE_SPIN_COUNT, engine_env

    env = engine_env({"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"})
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin",
                   "GOMP_SPINCOUNT": str(ENGINE_SPIN_COUNT)}  # fmt: skip
    assert engine_env({"GOMP_SPINCOUNT": "0"})["GOMP_SPINCOUNT"] == "0"  # the user's value wins


def test_engine_killed_mid_stream_every_client_gets_an_error(model_dir):
    srv = _serve(model_dir).wait_ready()
    engine_pid = srv.health()["engine_pid"]
    with open(f"/proc/{engine_pid}/environ", "rb") as f:  # the engine process got the default
        assert b"GOMP_SPINCOUNT=20000" in f.read().split(b"\0")

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            started = asyncio.Event()
            num_started = [0]

            async def streaming(i):
                body = {"model": "tiny", "prompt": _prompt(i), "max_tokens": 460,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                async with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    tail = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            tail.append(line)
                            if len(tail) == 2:
                                num_started[0] += 1
                                if num_started[0] == 6:
                                    started.set()
                    return "stream", time.monotonic(), tail[-2:]

            async def whole(i):
                body = {"model": "tiny", "prompt": _prompt(i), "max_tokens": 460,
                        "ignore_eos": True}  # fmt: skip
                r = await c.post(srv.url + "/v1/completions", json=body)
                return "whole", time.monotonic(), (r.status_code, r.json())

            tasks = [asyncio.create_task(streaming(i)) for i in range(6)]
            tasks += [asyncio.create_task(whole(i)) for i in range(6, 8)]
            await asyncio.wait_for(started.wait(), 60)
            assert not any(t.done() for t in tasks)
            killed = time.monotonic()
            os.kill(engine_pid, signal.SIGKILL)
            return killed, await asyncio.gather(*tasks)

    try:
        killed, results = asyncio.run(main())
    except BaseException:
        srv.stop()
        raise
    for kind, when, what in results:
        assert when - killed < 10, (kind, when - killed)
        if kind == "stream":  # headers were sent: an in-band error event, then [DONE]
            err = json.loads(what[0][6:])["error"]
            assert "engine process died" in err["message"] and what[1] == "data: [DONE]"
        else:
            status, body = what
            assert status == 503 and "engine process died" in body["error"]["message"]
    code = srv.proc.wait(20)  # exits on its own, non-zero
    assert code != 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(srv.url + "/health", timeout=2)


def test_engine_keeps_stepping_when_nobody_reads(model_dir, tmp_path):
    """The engine process's output socket never blocks: with 32 streaming requests and no
    reader, every request still finishes (its final delta is stamped before anyone read)."""
    import msgspec
    import zmq
    from kvcore.engine.core_messages import AddRequest, EngineInputs, EngineOutputs, decoder
    from kvcore.engine.factory import make_engine
    from kvcore.entrypoints.cli.serve import serve_parser
    from kvcore.params import SamplingParams

    args = serve_parser().parse_args(["--model", str(model_dir), "--num-blocks", "1024",
                                      "--max-model-len", "512", "--threads", "1"])  # fmt: skip
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{tmp_path}/in")
    pull.setsockopt(zmq.RCVHWM, 1)  # the reader side holds almost nothing
    pull.bind(f"ipc://{tmp_path}/out")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcore.engine.core_proc", f"ipc://{tmp_path}/in",
         f"ipc://{tmp_path}/out"], stdin=subprocess.PIPE, env=env(),
    )  # fmt: skip
    try:
        proc.stdin.write(pickle.dumps((make_engine, args)))
        proc.stdin.close()
        assert pull.poll(120_000) and pickle.loads(pull.recv())[0] == "ready"
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        adds = [AddRequest(f"r{i}", _prompt(i), params) for i in range(32)]
        push.send(msgspec.msgpack.encode(EngineInputs(adds=adds)))
        deadline, last, stable_since = time.monotonic() + 120, -1, time.monotonic()
        while time.monotonic() < deadline:  # nobody reads; wait until its CPU time stops
            with open(f"/proc/{proc.pid}/stat") as f:
                ticks = sum(int(x) for x in f.read().split(") ", 1)[1].split()[11:13])
            if ticks != last:
                last, stable_since = ticks, time.monotonic()
            elif time.monotonic() - stable_since > 1.5:
                break
            time.sleep(0.25)
        reading = time.perf_counter()
        dec = decoder(EngineOutputs)
        finals, tokens = {}, {}
        while len(finals) < 32 and pull.poll(10_000):
            msg = dec.decode(pull.recv())
            for d in msg.deltas:
                tokens[d.request_id] = tokens.get(d.request_id, 0) + len(d.token_ids[0])
                if d.finished:
                    finals[d.request_id] = msg.time
        assert len(finals) == 32 and set(tokens.values()) == {300}
        assert max(finals.values()) < reading  # all done before anyone read
        push.send(msgspec.msgpack.encode(EngineInputs(shutdown=True)))
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        ctx.destroy(linger=0)
