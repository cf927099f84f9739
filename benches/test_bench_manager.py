"""pytest-benchmark benches of the batch API (not run by CI; tests/ is the test path).

    python -m pytest benches/test_bench_manager.py --benchmark-enable

Smaller versions of the issue-2 workloads so a round takes well under a second; the full
workloads with printed `name: value unit` lines are bench_allocator.py / bench_prefix_cache.py.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvcore  # noqa: E402
import workloads  # noqa: E402

pytestmark = pytest.mark.skipif(
    kvcore._kvcore.DEBUG_BUILD, reason="benchmarks need a release build"
)


def flat(seqs):
    offs = np.zeros(len(seqs) + 1, dtype=np.int64)
    offs[1:] = np.cumsum([len(s) for s in seqs])
    return np.concatenate(seqs).astype(np.uint32, copy=False), offs


@pytest.fixture(scope="module")
def churn_rounds():
    rounds = list(workloads.churn(0, num_ops=20_000))
    return [
        (
            np.array(r.free, dtype=np.int64),
            np.array([a[0] for a in r.alloc], dtype=np.int64),
            np.array([a[1] for a in r.alloc], dtype=np.int64),
        )
        for r in rounds
    ]


def test_churn_prefix_off(benchmark, churn_rounds):
    def run():
        m = kvcore.KvCacheManager(65_536, 16, "off")
        for free, ids, nums in churn_rounds:
            if len(free):
                m.free(free)
            if len(ids):
                m.admit(ids, nums)
        assert m.num_requests == 0

    benchmark(run)


@pytest.mark.parametrize("mode", ["radix", "hash"])
def test_prefix_trace(benchmark, mode):
    reqs = workloads.prefix_trace(0, num_requests=500)
    batches = []
    for kind, ids in workloads.replay_order(len(reqs)):
        rid = np.array(ids, dtype=np.int64)
        if kind == "admit":
            toks, offs = flat([reqs[i].prompt for i in ids])
            total = np.array([len(reqs[i].prompt) + len(reqs[i].output) for i in ids])
            batches.append((rid, toks, offs, total))
        else:
            seqs = [np.concatenate([reqs[i].prompt, reqs[i].output]) for i in ids]
            batches.append((rid, *flat(seqs), None))

    def run():
        m = kvcore.KvCacheManager(65_536, 16, mode)
        for rid, toks, offs, total in batches:
            if total is None:
                m.free(rid, toks, offs)
            else:
                m.admit(rid, total, toks, offs)
                m.drain_copy_ops()
        return m.stats()["hit_tokens"]

    assert benchmark(run) > 0
