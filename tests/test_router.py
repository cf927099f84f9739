"""The replica routers (kvcore.scaleout.router): exact choices on scripted streams."""

from __future__ import annotations

import numpy as np
import pytest
from kvcore.errors import InvalidArgumentError
from kvcore.scaleout.policies import make_router
from kvcore.scaleout.router import (
    PowerOfTwoRouter,
    PrefixRouter,
    RandomRouter,
    ReplicaTree,
)


def prompt(system: int, user: int, sys_len: int = 64, user_len: int = 16) -> list[int]:
    return [1000 + system] * sys_len + list(range(user * user_len, (user + 1) * user_len))


def test_tree_matches_routed_prefix_and_evicts_oldest():
    tree = ReplicaTree(num_blocks=8, block_size=16)  # 7 blocks = 112 tokens
    a, b = prompt(0, 0), prompt(1, 1)  # 80 tokens each: 5 full blocks
    assert tree.match(np.array(a, np.uint32)) == 0
    tree.insert(np.array(a, np.uint32))
    assert tree.match(np.array(prompt(0, 5), np.uint32)) == 64  # shared system prompt
    assert tree.match(np.array(a, np.uint32)) == 79  # capped at len - 1
    tree.insert(np.array(b, np.uint32))  # 5 more blocks, 2 free: 3 of a's go, leaves first
    assert tree.match(np.array(b, np.uint32)) == 79
    assert tree.match(np.array(prompt(0, 5), np.uint32)) == 32
    assert tree.num_cached_blocks == 7


def test_prefix_router_follows_the_longest_match():
    r = PrefixRouter(threshold=2, min_match=16, seed=0)
    loads = {"a": 0, "b": 0, "c": 0}
    first = r.choose(prompt(3, 0), loads)
    r.routed(first, prompt(3, 0))
    for user in range(1, 6):  # loads stay within the threshold: always the same replica
        loads[first] = 2
        assert r.choose(prompt(3, user), loads) == first
    other = r.choose(prompt(4, 0), {**loads, first: 2})  # no match: the least loaded
    assert other != first
    assert r.num_affinity == 5


def test_prefix_router_balances_past_the_threshold():
    r = PrefixRouter(threshold=2, seed=0)
    r.routed("a", prompt(0, 0))
    assert r.choose(prompt(0, 1), {"a": 3, "b": 1}) == "a"  # 3 - 1 <= 2
    assert r.choose(prompt(0, 1), {"a": 4, "b": 1}) == "b"  # 4 - 1 > 2
    assert r.num_balanced == 1
    r.routed("b", prompt(0, 1))
    # Both hold the system prompt now; the longer match wins, ties go to the less loaded.
    assert r.choose(prompt(0, 1), {"a": 0, "b": 1}) == "b"
    assert r.choose(prompt(0, 7), {"a": 0, "b": 1}) == "a"


def test_prefix_router_drops_a_dead_replica():
    r = PrefixRouter(seed=0)
    r.routed("a", prompt(0, 0))
    assert r.matches(prompt(0, 1), ["a", "b"]) == {"a": 64, "b": 0}
    r.remove_replica("a")
    assert "a" not in r.trees
    assert r.matches(prompt(0, 1), ["a", "b"]) == {"a": 0, "b": 0}
    r.remove_replica("zzz")  # unknown: a no-op


def test_p2c_and_random():
    p2c = PowerOfTwoRouter(seed=1)
    assert p2c.choose([1, 2], {"only": 7}) == "only"
    picks = [p2c.choose([1], {"a": 0, "b": 100}) for _ in range(20)]
    assert set(picks) == {"a"}  # with two replicas both are sampled: the shorter queue wins
    rnd = RandomRouter(seed=1)
    picks = {rnd.choose([1], {"a": 0, "b": 100, "c": 5}) for _ in range(60)}
    assert picks == {"a", "b", "c"}
    # Same seed, same stream: the same choices.
    a, b = RandomRouter(seed=3), RandomRouter(seed=3)
    loads = {i: 0 for i in range(8)}
    assert [a.choose([1], loads) for _ in range(10)] == [b.choose([1], loads) for _ in range(10)]


def test_bad_input_is_a_typed_error():
    with pytest.raises(InvalidArgumentError):
        PrefixRouter().choose([1, 2, 3], {})
    with pytest.raises(InvalidArgumentError):
        PrefixRouter().choose([[1, 2]], {"a": 0})
    with pytest.raises(InvalidArgumentError):
        PrefixRouter(threshold=-1)
    with pytest.raises(InvalidArgumentError):
        make_router("round-robin")
    assert make_router("p2c").name == "p2c"
    assert make_router("prefix", threshold=3).threshold == 3


def test_ray_prefix_model_follows_rays_rule():
    """The simulator's model of Ray's PrefixCacheAffinityRouter, over Ray's own tree."""
    pytest.importorskip("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree")
    router = make_router("ray-prefix")
    loads = {"a": 0, "b": 0, "c": 0}
    assert router.choose(prompt(0, 0), loads) == "a"  # empty tree: smallest tenants, first
    router.routed("a", prompt(0, 0))
    assert router.choose(prompt(0, 1), loads) == "a"  # 64 of 80 tokens match
    # The match never yields to load (imbalanced_threshold is infinite by default).
    assert router.choose(prompt(0, 2), {"a": 50, "b": 0, "c": 0}) == "a"
    assert router.choose(prompt(1, 0), loads) == "b"  # no match: fewest characters in tree
    router.routed("b", prompt(1, 0))
    router.remove_replica("a")
    assert router.choose(prompt(0, 3), {"b": 0, "c": 0}) == "c"
    # With a threshold, a spread past it falls back to power of two choices.
    balanced = make_router("ray-prefix", imbalanced_threshold=2)
    balanced.routed("a", prompt(0, 0))
    picks = {balanced.choose(prompt(0, 1), {"a": 9, "b": 0, "c": 0}) for _ in range(20)}
    assert "a" not in picks  # p2c never takes the longer queue of its pair


def test_cluster_sim_prefix_beats_p2c(capsys):
    from kvcore.tools import sim

    small = ["--replicas", "4", "--requests-per-replica", "40", "--system-len", "256"]
    small += ["--kv-blocks", "96", "--systems", "8", "--seed", "1"]
    figures = {}
    for name in ("prefix", "p2c"):
        sim.main([*small, "--router", name])
        lines = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("#")]
        figures[name] = {x.split(":")[0]: float(x.split()[1]) for x in lines}
    assert figures["prefix"]["hit_rate"] > 1.5 * figures["p2c"]["hit_rate"]
    assert figures["prefix"]["hit_rate"] <= figures["prefix"]["hit_rate_single"] + 1e-9
    assert figures["prefix"]["ttft_p50_ms"] < figures["p2c"]["ttft_p50_ms"]
    assert 1.0 <= figures["p2c"]["imbalance"] < 2.0


def test_merge_metrics_labels_every_series_with_its_replica():
    from kvcore.entrypoints.openai.metrics import ServerMetrics
    from kvcore.scaleout.merge import merge_metrics
    from prometheus_client.parser import text_string_to_metric_families

    texts = {}
    for name, hits in (("r0", 5), ("r1", 7)):
        m = ServerMetrics("tiny", cache_info={"block_size": 16})
        m.prefix_hits.inc(hits)
        m.ttft.observe(0.02)
        texts[name] = m.render().decode()
    merged = merge_metrics(texts)
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    hits = {s.labels["replica"]: s.value for s in fams["kvcore:prefix_cache_hits"].samples}
    assert hits == {"r0": 5.0, "r1": 7.0}
    counts = [s for s in fams["kvcore:time_to_first_token_seconds"].samples if "_count" in s.name]
    assert sorted((s.labels["replica"], s.value) for s in counts) == [("r0", 1.0), ("r1", 1.0)]
    assert merged.count("# TYPE kvcore:prefix_cache_hits_total counter") == 1


def test_prefix_router_keeps_deep_queues_on_their_prefix():
    # Spilling needs both the absolute spread and the ratio (SGLang's abs and rel thresholds).
    r = PrefixRouter(threshold=2, rel_threshold=1.5, seed=0)
    r.routed("a", prompt(0, 0))
    assert r.choose(prompt(0, 1), {"a": 10, "b": 7}) == "a"  # spread 3 > 2, but 10 <= 10.5
    assert r.choose(prompt(0, 1), {"a": 11, "b": 7}) == "b"  # 11 > 10.5 as well
    assert r.choose(prompt(0, 1), {"a": 4, "b": 0}) == "b"  # an idle replica: always spill
    assert (r.num_affinity, r.num_balanced) == (1, 2)
    # rel_threshold=1 is the absolute test alone.
    plain = PrefixRouter(threshold=2, rel_threshold=1.0, seed=0)
    plain.routed("a", prompt(0, 0))
    assert plain.choose(prompt(0, 1), {"a": 10, "b": 7}) == "b"


@pytest.mark.parametrize("bad", [0.5, 0.0, -1.0, float("nan")])
def test_prefix_router_refuses_a_bad_rel_threshold(bad):
    with pytest.raises(InvalidArgumentError, match="rel_threshold"):
        PrefixRouter(rel_threshold=bad)
