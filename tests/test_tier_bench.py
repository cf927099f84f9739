"""The drivers of benches/bench_tiers.py: arrival models and paired (interleaved) timing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"
sys.path.insert(0, str(BENCHES))

import bench_tiers as b  # noqa: E402


def _args(*extra: str):
    return b.parse(
        ["--conversations", "4", "--turns", "2", "--output", "3", "--scale", "0.04"]
        + ["--block-size", "4", *extra]
    )


@pytest.fixture(scope="module")
def workload():
    args = _args()
    systems, convs = b.make_workload(args)
    return args, systems, convs, b.sizes(args, systems, convs)


def test_paired_equals_sequential(workload):
    args, systems, convs, sz = workload
    cfg = {k: sz["configs"][k] for k in ("pool_only", "tiered")}
    alone = {k: b.serve(args, systems, convs, kw) for k, kw in cfg.items()}
    both = b.serve_paired(args, systems, convs, cfg)
    n = len(convs) * args.turns
    for name, (out, ttft, prompt_tokens, llm, clock, ref) in both.items():
        assert out == alone[name][0]  # interleaving two engines changes no token
        assert prompt_tokens == alone[name][2]
        assert len(ttft) == n and len(alone[name][1]) == n
        # Own-step clock: every TTFT is positive and within the engine's total step time.
        assert all(0 < t <= clock for t in ttft)
        assert llm.engine.all_blocks_free()
        assert (ref is None) == (llm.engine.tiers is None)
    assert both["pool_only"][0] == both["tiered"][0]


def test_paired_load_reference_copies_what_the_loads_moved():
    """The load bandwidth's reference runs beside every L2 load: the same bytes, and outside
    the loads' own timing."""
    args = b.parse(
        ["--conversations", "8", "--turns", "3", "--output", "3", "--scale", "0.04"]
        + ["--block-size", "4"]
    )
    systems, convs = b.make_workload(args)
    sz = b.sizes(args, systems, convs)
    both = b.serve_paired(args, systems, convs, {"tiered": sz["configs"]["tiered"]})
    _, _, _, llm, _, ref = both["tiered"]
    tiers = llm.engine.tiers
    assert tiers.bytes_loaded > 0 and ref.bytes == tiers.bytes_loaded
    assert ref.seconds > 0 and tiers.load_seconds > 0
    assert llm.engine.all_blocks_free()


def test_closed_loop_serves_every_turn_in_order(workload):
    _, systems, convs, sz = workload
    waves = b.serve(_args(), systems, convs, sz["configs"]["tiered"])
    closed = _args("--arrival", "closed", "--concurrency", "2")
    out, ttft, _, llm = b.serve(closed, systems, convs, sz["configs"]["tiered"])
    # Same greedy answers per (conversation, turn) as the waves; every turn answered once.
    assert out == waves[0]
    assert len(ttft) == len(convs) * closed.turns
    assert llm.engine.get_num_unfinished_requests() == 0


def test_closed_loop_keeps_concurrency(workload):
    """At most ``--concurrency`` requests are ever queued or running at once."""
    _, systems, convs, sz = workload
    args = _args("--arrival", "closed", "--concurrency", "2")
    peak = []

    def hook(llm):
        eng, step = llm.engine, llm.engine._step

        def counted(*args, **kwargs):  # the engine's _step (its owner argument passed through)
            peak.append(eng.get_num_unfinished_requests())
            return step(*args, **kwargs)

        eng._step = counted

    b.serve(args, systems, convs, sz["configs"]["pool_only"], hook=hook)
    assert max(peak) == 2
