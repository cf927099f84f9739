"""Tiers that misbehave (issue 28, items 1, 4, 5): chunk files replaced by named pipes, reads
and writes that never return, a Redis that never answers, forged values in a shared Redis.
Requests are served (a bad tier is a miss), ``close()`` and the process finish within their
deadlines, the engine sleeps instead of spinning, and only values MACed with the operator's
secret are served."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from serve_util import env
from test_tiers import GREEDY, run, workload
from tier_fixtures import redis_server  # noqa: F401  (fixture)

SECRET = "an operator secret of at least sixteen bytes"


@pytest.fixture(scope="module")
def baseline():
    return run(workload())[0]


def _python(code: str, *args: str, timeout: float, extra_env=None) -> tuple[float, str]:
    """Runs ``code`` in a fresh interpreter; (wall seconds to exit, stdout). A process that does
    not exit within ``timeout`` fails the test (it is killed)."""
    e = env()
    e.update(extra_env or {})
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return time.monotonic() - start, out.stdout


CHILD = """
import json, sys, threading, time
from kvcore import LLM, SamplingParams
from kvcore.tiers.stores import DiskStore
if sys.argv[2] == "hang":  # a hung mount: every read and write blocks for good
    DiskStore.get = lambda self, key: threading.Event().wait()
    DiskStore.put = lambda self, key, value: threading.Event().wait()
llm = LLM("tiny-llama", num_blocks=24, block_size=8, max_num_seqs=3, host_kv_bytes=1 << 22,
          disk_path=sys.argv[1])
prompts = json.loads(sys.argv[3])
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
start = time.monotonic()
closed = llm.engine.close(timeout_s=1.0) if sys.argv[2] == "hang" else None
print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                  "close_s": time.monotonic() - start, "closed": closed,
                  "l3": llm.engine.tier_figures()["tier_l3_fetched_tokens"]}))
"""


def test_named_pipe_chunks_are_misses_and_the_process_exits(tmp_path, baseline):
    import json

    first, _ = run(workload(), host_kv_bytes=1 << 16, disk_path=str(tmp_path))
    assert first == baseline
    files = sorted(tmp_path.glob("*/*.kvt"))
    assert len(files) >= 10
    for f in files[:: max(1, len(files) // 3)][:3]:  # 3 chunk files become named pipes
        f.unlink()
        os.mkfifo(f)
    wall, out = _python(CHILD, str(tmp_path), "fifo", json.dumps(workload()), timeout=120)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["tokens"] == baseline
    assert got["l3"] > 0  # the other chunks were served


def test_hung_disk_reads_and_writes_never_hold_close_or_exit(tmp_path, baseline):
    import json

    wall, out = _python(CHILD, str(tmp_path), "hang", json.dumps(workload()[:4]), timeout=120)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["tokens"] == baseline[:4]  # every fetch timed out: recomputed
    assert got["closed"] is False and got["close_s"] < 2.5  # close() kept its deadline


SERVE_HUNG = """
import sys, threading
from kvcore.tiers.stores import DiskStore
DiskStore.get = lambda self, key: threading.Event().wait()
DiskStore.put = lambda self, key, value: threading.Event().wait()
from kvcore.entrypoints.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_with_a_hung_disk_tier_exits_within_the_grace_period(tmp_path):
    import signal

    import httpx
    from serve_util import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_HUNG, "serve", "--model", "tiny-llama", "--port", str(port),
         "--num-blocks", "64", "--block-size", "8", "--host-kv-mb", "4", "--disk-path",
         str(tmp_path), "--shutdown-grace-s", "2"],
        env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        body = {"model": "tiny-llama", "prompt": list(range(5, 45)), "max_tokens": 4}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200  # the fetch timed out: served by recompute
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, proc.stderr.read()[-2000:]
    assert took < 2 + 8, took  # grace period plus a few seconds, whatever the tier does


# ---- a stalled Redis: the engine sleeps on the fetch --------------------------------------


def test_engine_sleeps_while_a_fetch_waits_on_a_stalled_redis(tmp_path, baseline):
    from kvcore import LLM

    stalled = socket.socket()  # accepts connections (backlog), never answers
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(16)
    port = stalled.getsockname()[1]
    try:
        llm = LLM("tiny-llama", num_blocks=24, block_size=8, max_num_seqs=3,
                  host_kv_bytes=1 << 22, remote_url=f"redis://127.0.0.1:{port}/0",
                  remote_timeout_s=1.5, tier_secret_file=_secret_file(tmp_path))  # fmt: skip
        engine = llm.engine
        calls = {"n": 0}
        real = engine.step

        def counted(**kw):
            calls["n"] += 1
            return real(**kw)

        engine.step = counted
        start = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": workload()[0]}], GREEDY, use_tqdm=False)
        took = time.monotonic() - start
        engine.close(timeout_s=0.5)
    finally:
        stalled.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == baseline[:1]
    assert took > 1.0  # it did wait on the stalled fetch
    assert calls["n"] < 60, calls["n"]  # not hundreds of empty steps


# ---- authenticity: a MAC keyed by the operator's secret -----------------------------------


def _secret_file(tmp_path, text=SECRET):
    path = tmp_path / "tier.secret"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_forged_redis_values_are_refused(redis_server, tmp_path, baseline, caplog):  # noqa: F811
    import redis

    secret = _secret_file(tmp_path)
    first, eng = run(workload(), host_kv_bytes=1 << 22, remote_url=redis_server.url,
                     tier_secret_file=secret)  # fmt: skip
    assert eng.tiers.close()
    assert first == baseline
    # A writer to the shared store without the secret: a forged payload under a recomputed
    # (unkeyed) checksum, the integrity check of kvcore before the MAC.
    client = redis.Redis.from_url(redis_server.url)
    keys = client.keys("kvcore:*")
    assert keys
    for k in keys:
        value = bytearray(client.get(k))
        body = value[:-16]
        body[-8:] = b"\x7f" * 8  # forged KV bytes (the end of the payload)
        client.set(k, bytes(body) + hashlib.blake2b(bytes(body), digest_size=16).digest())
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        forged, eng = run(workload(), host_kv_bytes=1 << 22, remote_url=redis_server.url,
                          tier_secret_file=secret)  # fmt: skip
        eng.tiers.close()
    fig = eng.tier_figures()
    assert forged == baseline  # every forged value was a miss: recomputed
    assert fig["tier_l4_fetched_tokens"] == 0 and fig["tier_auth_failures"] > 0
    assert sum("failed its MAC check" in r.message for r in caplog.records) == 1
    # The same store with the right values again: an engine with the secret reads them ...
    client.flushall()
    run(workload(), host_kv_bytes=1 << 22, remote_url=redis_server.url, tier_secret_file=secret)
    again, eng = run(workload(), host_kv_bytes=1 << 22, remote_url=redis_server.url,
                     tier_secret_file=secret)  # fmt: skip
    assert again == baseline and eng.tier_figures()["tier_l4_fetched_tokens"] > 0
    # ... one with another secret (a replica misconfigured, or a forger with its own key) not.
    other = _secret_file(tmp_path / "..", "another secret, also sixteen bytes or more")
    theirs, eng = run(workload(), host_kv_bytes=1 << 22, remote_url=redis_server.url,
                      tier_secret_file=other)  # fmt: skip
    fig = eng.tier_figures()
    assert theirs == baseline
    assert fig["tier_l4_fetched_tokens"] == 0 and fig["tier_auth_failures"] > 0


def test_local_secret_is_created_owner_only_and_read_after_a_restart(tmp_path, baseline):
    first, _ = run(workload(), host_kv_bytes=1 << 16, disk_path=str(tmp_path))
    secret = tmp_path / "tier-secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    before = secret.read_bytes()
    second, eng = run(workload(), host_kv_bytes=1 << 22, disk_path=str(tmp_path))
    assert secret.read_bytes() == before
    assert second == baseline and eng.tier_figures()["tier_l3_fetched_tokens"] > 0


def test_salt_namespaces_are_keyed():
    from kvcore.engine.request import salt_namespace

    assert salt_namespace("tenant", b"k" * 32) == salt_namespace("tenant", b"k" * 32)
    assert salt_namespace("tenant", b"k" * 32) != salt_namespace("tenant", b"j" * 32)


def test_cache_salt_on_generate_isolates_prefix_hits():
    from kvcore import LLM

    llm = LLM("tiny-llama", num_blocks=64, block_size=8)
    shared = workload()[0]
    prompts = [{"prompt_token_ids": shared + [7]}, {"prompt_token_ids": shared + [8]}]
    llm.generate(prompts[:1], GREEDY, use_tqdm=False, cache_salt="a")
    (b,) = llm.generate(prompts[1:], GREEDY, use_tqdm=False, cache_salt="b")
    (a,) = llm.generate(prompts[1:], GREEDY, use_tqdm=False, cache_salt=["a"])
    assert b.num_cached_tokens == 0 and a.num_cached_tokens > 0
