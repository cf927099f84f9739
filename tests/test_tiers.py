"""KV tiers end to end: greedy outputs equal with tiers on and off (L2, swap, L3 disk, L4
Redis across two processes), faults (Redis killed and restarted, corrupted or foreign values,
a full disk) turn into misses, never into errors."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kvcore import LLM, SamplingParams
from kvcore.errors import InvalidArgumentError
from kvcore.tiers import BlockCodec
from kvcore.tiers.stores import DiskStore
from tier_fixtures import redis_server  # noqa: F401  (fixture)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def workload(seed: int = 0, n: int = 6) -> list[list[int]]:
    """Two shared system prompts, unique tails, then the same prompts again (so evicted
    prefixes are asked for a second time)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(5, 500, 48).tolist() for _ in range(2)]
    prompts = [systems[i % 2] + rng.integers(5, 500, 16 + 4 * i).tolist() for i in range(n)]
    return prompts + prompts[::-1]


def run(prompts, params=GREEDY, **kw):
    kw.setdefault("num_blocks", 24)
    llm = LLM("tiny-llama", block_size=8, max_num_seqs=3, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.scheduler.check_invariants()
    assert llm.engine.all_blocks_free()
    return [list(o.outputs[0].token_ids) for o in outs], llm.engine


@pytest.fixture(scope="module")
def baseline():
    return run(workload())[0]


def test_l2_outputs_equal_and_hits_come_from_l2(baseline):
    tokens, engine = run(workload(), host_kv_bytes=1 << 22)
    assert tokens == baseline
    fig = engine.tier_figures()
    assert fig["tier_l2_hit_tokens"] > 0 and fig["tier_bytes_offloaded"] > 0
    assert fig["tier_bytes_loaded"] > 0 and fig["tier_load_p50_ms"] > 0


def test_swap_and_recompute_preemption_give_the_same_outputs():
    rng = np.random.default_rng(1)
    prompts = [rng.integers(5, 500, 40).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref, eng = run(prompts, params, num_blocks=16, preemption="recompute")
    assert eng.scheduler.stats().num_preemptions > 0
    swapped, eng = run(prompts, params, num_blocks=16, host_kv_bytes=1 << 22, preemption="swap")
    assert swapped == ref
    fig = eng.tier_figures()
    # A swapped-out request comes back by its L2 slots, or by L1 when L1 still holds them.
    assert fig["tier_swap_outs"] > 0


def test_disk_tier_serves_a_second_engine(tmp_path, baseline):
    first, _ = run(workload(), host_kv_bytes=1 << 16, disk_path=str(tmp_path))
    assert first == baseline
    files = list(tmp_path.glob("*/*.kvt"))
    assert files
    # A cold engine (empty L1 and L2) on the same directory fetches prefixes from disk.
    second, eng = run(workload(), host_kv_bytes=1 << 22, disk_path=str(tmp_path))
    assert second == baseline
    assert eng.tier_figures()["tier_l3_fetched_tokens"] > 0
    # Corrupt every chunk: all misses, same outputs.
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    third, eng = run(workload()[:4], host_kv_bytes=1 << 22, disk_path=str(tmp_path))
    assert third == baseline[:4]


def test_full_disk_stops_l3_writes_without_failing(tmp_path, monkeypatch, caplog, baseline):
    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        tokens, eng = run(workload(), host_kv_bytes=1 << 16, disk_path=str(tmp_path))
        eng.tiers.close()
    assert tokens == baseline
    assert eng.tiers.disk.writes_stopped and eng.tier_figures()["tier_disk_failures"] >= 1
    assert sum("disk tier write failed" in r.message for r in caplog.records) == 1


def test_codec_refuses_truncated_corrupted_and_foreign_values():
    codec = BlockCodec("model-a", 2, "auto/torch.float32", 4)
    key, toks, payload = b"k" * 32, np.arange(4), bytes(range(64))
    value = codec.encode(key, toks, payload)
    assert codec.decode(value, key, toks, 64) == payload
    assert codec.decode(value[:-1], key, toks, 64) is None
    bad = bytearray(value)
    bad[40] ^= 1
    assert codec.decode(bytes(bad), key, toks, 64) is None
    assert codec.decode(value, key, toks + 1, 64) is None  # token ids are compared
    assert codec.decode(value, b"j" * 32, toks, 64) is None
    for other in (
        BlockCodec("model-b", 2, "auto/torch.float32", 4),
        BlockCodec("model-a", 2, "fp8_e4m3/torch.float32", 4),
        BlockCodec("model-a", 3, "auto/torch.float32", 4),
    ):
        assert other.decode(value, key, toks, 64) is None


def test_disk_store_cap_evicts_lru(tmp_path):
    store = DiskStore(tmp_path, 100)
    assert store.put("aa01", b"x" * 60) and store.put("aa02", b"y" * 60)
    assert store.get("aa01") is None and store.get("aa02") == b"y" * 60
    assert store.used == 60 and not store.put("aa03", b"z" * 101)


def test_bad_tier_arguments_are_typed_errors():
    for kw in (
        {"host_kv_bytes": -1},
        {"disk_path": "/tmp/x"},
        {"remote_url": "http://x", "host_kv_bytes": 1 << 20},
        {"preemption": "sideways"},
        {"preemption": "swap"},
        {"host_kv_bytes": 10},
    ):
        with pytest.raises(InvalidArgumentError):
            LLM("tiny-llama", num_blocks=24, block_size=8, **kw)


SECOND = """
import json, sys
from kvcore import LLM, SamplingParams
prompts, url = json.loads(sys.argv[1]), sys.argv[2]
llm = LLM("tiny-llama", num_blocks=24, block_size=8, max_num_seqs=3, host_kv_bytes=1 << 22,
          remote_url=url)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
fig = llm.engine.tier_figures()
print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                  "l4": fig["tier_l4_fetched_tokens"]}))
"""


def test_second_process_serves_prefixes_from_redis(redis_server, baseline):  # noqa: F811
    first, eng = run(workload(), host_kv_bytes=1 << 22, remote_url=redis_server.url)
    eng.tiers.close()  # background writes done
    assert first == baseline
    assert eng.tier_figures()["tier_bytes_published"] > 0
    out = subprocess.run(
        [sys.executable, "-c", SECOND, json.dumps(workload()), redis_server.url],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tokens"] == baseline
    assert got["l4"] > 0


def test_redis_killed_mid_run_serves_by_recompute_and_reconnects(
    redis_server,  # noqa: F811
    caplog,
    baseline,
):
    llm = LLM(
        "tiny-llama",
        num_blocks=24,
        block_size=8,
        max_num_seqs=3,
        host_kv_bytes=1 << 22,
        remote_url=redis_server.url,
    )
    eng = llm.engine
    eng.tiers.remote.retry_s = 0.05
    fresh = workload(2)[:4]  # new prefixes: the second half fetches and publishes
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        first = llm.generate([{"prompt_token_ids": p} for p in workload()[:6]], GREEDY)
        redis_server.stop()
        second = llm.generate([{"prompt_token_ids": p} for p in fresh], GREEDY)
    assert [list(o.outputs[0].token_ids) for o in first] == baseline[:6]
    assert [list(o.outputs[0].token_ids) for o in second] == run(fresh)[0]
    assert eng.tier_figures()["tier_remote_failures"] > 0
    assert sum("unreachable" in r.message for r in caplog.records) == 1
    redis_server.start()
    import time

    time.sleep(0.1)
    assert eng.tiers.remote.put_many([("ab", b"1")])  # reconnected


def test_smollm2_outputs_equal_with_l2_under_eviction():
    """One real-model case: SmolLM2 with a pool that evicts constantly, L2 on and off."""
    prompts = workload(3, 3)
    kw = dict(num_blocks=14, block_size=8, max_num_seqs=2, dtype="float32")  # auto is bf16
    ref = LLM("smollm2-135m", **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
    )
    llm = LLM("smollm2-135m", host_kv_bytes=1 << 26, **kw)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.tier_figures()["tier_l2_hit_tokens"] > 0


def test_hash_mode_sha256_gives_the_same_outputs(baseline):
    for h in ("sha256", "xxh3"):
        tokens, eng = run(workload(), prefix_caching="hash", prefix_hash=h)
        assert tokens == baseline
        assert eng.scheduler.prefix_mode == ("hash_sha256" if h == "sha256" else "hash")
        assert eng.scheduler.stats().prefix_hit_tokens > 0
    with pytest.raises(InvalidArgumentError):
        LLM("tiny-llama", num_blocks=24, prefix_hash="md5")
