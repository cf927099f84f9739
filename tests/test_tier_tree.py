"""The prefix cache keeps entries whose KV left the pool (issue 10, item 1): with L2 on, radix
nodes and hash entries name the L2 slot an evicted block was written back to, one lookup walk
finds L1 and L2 hits, and outputs equal a run without tiers in both prefix-cache modes."""

from __future__ import annotations

import pytest
from test_tiers import run, workload


@pytest.mark.parametrize("mode", ["radix", "hash"])
def test_tree_keeps_l2_entries_and_outputs_equal(mode):
    ref, _ = run(workload(), prefix_caching=mode)
    tokens, eng = run(workload(), prefix_caching=mode, host_kv_bytes=1 << 22)
    assert tokens == ref
    st = eng.scheduler.tier_stats()
    # Blocks evicted from the pool of 24 stay in the tree as L2 entries and are hit from there.
    assert st["l2_entries"] > 0 and st["l2_hit_tokens"] > 0
    assert st["offloaded_blocks"] > 0
    _, eng = run(workload(), prefix_caching=mode)
    assert eng.scheduler.tier_stats()["l2_entries"] == 0  # no L2: nothing is kept
