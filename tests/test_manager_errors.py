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
