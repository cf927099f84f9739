"""Bad input raises a KvCoreError subclass and leaves the manager exactly as it was."""

import kvcore
import numpy as np
import pytest
from kvcore import (
    DoubleFreeError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvalidBlockError,
    TooLongError,
    UnknownRequestError,
)

I64, U32 = np.int64, np.uint32


def arr(*xs, dtype=I64):
    return np.array(xs, dtype=dtype)


@pytest.fixture(params=["radix", "hash", "off"])
def mgr(request):
    m = kvcore.KvCacheManager(16, 4, request.param)
    toks = np.arange(10, dtype=U32)
    m.admit(arr(1), arr(10), toks, arr(0, 10))
    m.cache_computed(arr(1), toks[:8], arr(0, 8))
    m.admit(arr(2), arr(6))
    m.fork(arr(2), arr(3))
    return m


def snapshot(m):
    ids = [r for r in range(10) if r in m]
    return (
        m.free_queue().tolist(),
        m.ref_counts(np.arange(m.num_blocks, dtype=I64)).tolist(),
        m.stats(),
        [m.block_table(r).tolist() for r in ids],
        m.num_free_blocks,
        len(m),
    )


T = np.arange(10, dtype=U32)
BAD_CALLS = [
    # (exception, call)
    (DuplicateRequestError, lambda m: m.admit(arr(1), arr(4))),
    (DuplicateRequestError, lambda m: m.admit(arr(5, 5), arr(4, 4))),
    (DuplicateRequestError, lambda m: m.admit(arr(5, 1), arr(4, 4))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(0))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(-3))),
    (TooLongError, lambda m: m.admit(arr(5), arr(61))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(4), T[:0], arr(0, 0))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(4), T, arr(0, 11))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(4), T, arr(0, 5, 10))),
    (InvalidArgumentError, lambda m: m.admit(arr(5, 6), arr(4, 4), T, arr(0, 7, 3))),
    (InvalidArgumentError, lambda m: m.admit(arr(5, 6), arr(4, 4), T)),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(4), T.astype(np.float64), arr(0, 10))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(4), arr(-1, dtype=np.int32), arr(0, 1))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(4), namespaces=arr(0, 1))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(4), watermark_blocks=-1)),
    (InvalidArgumentError, lambda m: m.admit(arr(5.0, dtype=np.float64), arr(4))),
    (InvalidArgumentError, lambda m: m.admit(arr(-5), arr(4))),
    (InvalidArgumentError, lambda m: m.admit(np.array([[5]], dtype=I64), arr(4))),
    (InvalidArgumentError, lambda m: m.admit(["5"], arr(4))),
    (InvalidArgumentError, lambda m: m.admit(arr(5), arr(4, dtype=np.float32))),
    (InvalidArgumentError, lambda m: m.admit(arr(5, 6), arr(4))),
    (UnknownRequestError, lambda m: m.allocate_slots(arr(1, 9), arr(12, 4))),
    (TooLongError, lambda m: m.allocate_slots(arr(1, 2), arr(12, 61))),
    (InvalidArgumentError, lambda m: m.allocate_slots(arr(1), arr(12, 12))),
    (UnknownRequestError, lambda m: m.cache_computed(arr(9), T, arr(0, 10))),
    (InvalidArgumentError, lambda m: m.cache_computed(arr(2), T, arr(0, 10))),
    (UnknownRequestError, lambda m: m.free(arr(2, 9))),
    (DoubleFreeError, lambda m: m.free(arr(2, 2))),
    (InvalidArgumentError, lambda m: m.free(arr(3, 2), T, arr(0, 3, 10))),
    (InvalidArgumentError, lambda m: m.free(arr(1), offsets=arr(0, 10))),
    (UnknownRequestError, lambda m: m.fork(arr(9), arr(7))),
    (DuplicateRequestError, lambda m: m.fork(arr(1, 2), arr(7, 7))),
    (DuplicateRequestError, lambda m: m.fork(arr(1), arr(3))),
    (InvalidArgumentError, lambda m: m.fork(arr(1, 2), arr(7))),
    (UnknownRequestError, lambda m: m.block_table(9)),
    (UnknownRequestError, lambda m: m.block_tables(arr(1, 9))),
    (InvalidArgumentError, lambda m: m.block_tables(arr(1), width=1)),
    (InvalidArgumentError, lambda m: m.block_tables(arr(1), width=10**12)),
    (InvalidArgumentError, lambda m: m.block_tables(arr(1), width=-1)),
    (InvalidArgumentError, lambda m: m.block_table(-1)),
    (InvalidBlockError, lambda m: m.ref_counts(arr(0, 16))),
    (InvalidBlockError, lambda m: m.ref_counts(arr(-1))),
    (InvalidBlockError, lambda m: m.block_hash(16)),
    (InvalidArgumentError, lambda m: m.match_prefix(T, arr(0, 3))),
]


@pytest.mark.parametrize("exc,call", BAD_CALLS)
def test_bad_input_raises_and_changes_nothing(mgr, exc, call):
    before = snapshot(mgr)
    with pytest.raises(exc):
        call(mgr)
    mgr.check_invariants()
    assert snapshot(mgr) == before


def test_errors_form_one_hierarchy():
    with pytest.raises(kvcore.KvCoreError, match="unknown request id 9"):
        kvcore.KvCacheManager(8, 4).free(arr(9))


@pytest.mark.parametrize(
    "args,exc",
    [
        ((1, 16), InvalidArgumentError),
        ((0, 16), InvalidArgumentError),
        ((-4, 16), InvalidArgumentError),
        ((8, 0), InvalidArgumentError),
        ((8, -1), InvalidArgumentError),
        ((8, 16, "lru"), InvalidArgumentError),
        ((2**31, 2**10), InvalidArgumentError),
        ((2**27, 16), InvalidArgumentError),
        ((2**40, 16), InvalidArgumentError),
        ((64, 2**17), InvalidArgumentError),
    ],
)
def test_bad_config(args, exc):
    with pytest.raises(exc):
        kvcore.KvCacheManager(*args)


def test_out_of_blocks_is_not_an_error():
    m = kvcore.KvCacheManager(5, 4, "off")
    assert m.admit(arr(1, 2, 3), arr(8, 8, 8)).tolist() == [0, 0]
    before = snapshot(m)
    assert m.allocate_slots(arr(1), arr(9)) == 0
    assert m.admit(arr(3), arr(1)).tolist() == []
    assert snapshot(m) == before
    m.check_invariants()


# -- issue 17: ids, tokens on free, pending copies, the scalar path --------------------------


def test_ids_and_namespaces_are_below_2_pow_63_in_both_apis():
    top = 2**63 - 1
    m = kvcore.KvCacheManager(16, 4)
    for bad in (np.array([2**63], np.uint64), [2**63], 2**64, -1):
        with pytest.raises(InvalidArgumentError):
            m.admit(bad, 4)
        with pytest.raises(InvalidArgumentError):
            m.admit(5, 4, namespaces=bad)
    m.admit(np.array([top], np.uint64), 4, namespaces=top)
    assert top in m and m.block_table(top).tolist() == [1]
    s = kvcore.Scheduler(64, 4)
    with pytest.raises(InvalidArgumentError):
        s.add_request(2**63, [1, 2], 3)
    with pytest.raises(InvalidArgumentError):
        s.add_requests(np.array([2**63], np.uint64), [1, 2], [0, 2], 3)
    with pytest.raises(InvalidArgumentError):
        s.add_request(1, [1, 2], 3, namespace=2**63)
    s.add_request(top, [1, 2], 3, namespace=top)
    plan = s.schedule()
    assert plan.req_ids.tolist() == [top]
    s.update(plan.step_id, np.zeros(plan.num_sampled, np.int64))
    assert s.abort_requests([top]).req_ids.tolist() == [top]


@pytest.mark.parametrize("mode", ["radix", "hash"])
def test_freeing_with_other_tokens_is_refused(mode):
    m = kvcore.KvCacheManager(32, 4, mode)
    x, y = list(range(16)), list(range(100, 116))
    m.admit(1, 16, x)
    before = snapshot(m)
    for lie in (y, x[:8] + y[8:], x[:15] + [999]):
        with pytest.raises(InvalidArgumentError, match="request 1: token"):
            m.free(1, lie)
        with pytest.raises(InvalidArgumentError):
            m.cache_computed(1, lie)
        # In a batch, a later request's lie refuses the whole batch.
        with pytest.raises(InvalidArgumentError):
            m.free([1], np.array(lie, np.uint32), [0, 16])
        assert snapshot(m) == before
    m.free(1, x)
    assert m.match_prefix(y).tolist() == [0]  # Y is not served X's KV
    assert m.match_prefix(x).tolist() == [15 if mode == "radix" else 12]
    m.check_invariants()


def test_a_partial_last_block_may_be_restated():
    m = kvcore.KvCacheManager(16, 4)
    m.admit(1, 10)
    m.cache_computed(1, list(range(10)))
    m.cache_computed(1, list(range(8)) + [50, 51])  # only the partial block changed
    with pytest.raises(InvalidArgumentError):
        m.cache_computed(1, [9] + list(range(1, 10)))
    m.free(1, list(range(8)))
    m.check_invariants()


def test_free_cancels_the_requests_pending_copies():
    m = kvcore.KvCacheManager(8, 4)
    a = list(range(8))
    m.admit(1, 8, a)
    m.free(1, a)
    b = list(range(6)) + [50, 51, 52]
    assert m.admit(2, 9, b).tolist() == [6]  # a copy of block 2 into block 3 is pending
    m.free(2)
    assert m.drain_copy_ops().shape == (0, 2)
    m.check_invariants()
    m.admit(3, 12, list(range(200, 212)))
    assert 3 in m.block_table(3).tolist()  # the block the cancelled copy would have written
    assert m.drain_copy_ops().shape == (0, 2)
    m.check_invariants()


@pytest.mark.parametrize("mode", ["radix", "hash", "off"])
def test_scalar_path_matches_the_array_path(mode):
    a, s = kvcore.KvCacheManager(64, 4, mode), kvcore.KvCacheManager(64, 4, mode)
    rng = np.random.default_rng(0)
    prompts = {r: rng.integers(0, 5, 9 + r).tolist() for r in range(1, 6)}
    for r, p in prompts.items():
        a.admit(arr(r), arr(len(p) + 2), np.array(p, np.uint32), arr(0, len(p)))
        s.admit(r, len(p) + 2, p)
        a.allocate_slots(arr(r), arr(len(p) + 5))
        s.allocate_slots(r, len(p) + 5)
        a.cache_computed(arr(r), np.array(p, np.int32), arr(0, len(p)))
        s.cache_computed(r, p)
    a.fork(arr(1), arr(9))
    s.fork(1, 9)
    assert a.block_tables(arr(1, 2, 9)).tolist() == s.block_tables([1, 2, 9]).tolist()
    for r in (1, 3):
        p = prompts[r]
        a.free(arr(r), np.array(p, np.uint32), arr(0, len(p)))
        s.free(r, p)
    assert a.drain_copy_ops().tolist() == s.drain_copy_ops().tolist()
    assert snapshot(a) == snapshot(s)
    assert (
        a.ref_counts(arr(1, 2)).tolist()
        == s.ref_counts([1, 2]).tolist()
        == [
            *s.ref_counts(1).tolist(),
            *s.ref_counts(2).tolist(),
        ]
    )
