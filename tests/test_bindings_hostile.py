"""Hostile scalars against every public method of the Rust bindings (issue 17).

Each method is called with valid arguments except one, replaced by a value from a battery of
bad scalars. Whatever happens, only a ``KvCoreError`` subclass may be raised (never TypeError,
OverflowError, RuntimeError or a panic), the invariants must hold, and a refused call must
leave the object exactly as it was. Values no parameter accepts (2**64, 2**63, "1", 1.5) must
be refused everywhere.
"""

from __future__ import annotations

import kvcore
import numpy as np
import pytest

BAD = [2**64, 2**63, -1, "1", 1.5, None, [], True, object()]
NEVER_OK = {repr(v) for v in (2**64, 2**63, "1", 1.5)}
T = np.arange(10, dtype=np.uint32)


def manager(mode: str = "radix") -> kvcore.KvCacheManager:
    m = kvcore.KvCacheManager(16, 4, mode)
    m.admit([1], [10], T, [0, 10])
    m.cache_computed([1], T[:8], [0, 8])
    m.admit([2], [6])
    m.fork([2], [3])
    return m


def manager_state(m: kvcore.KvCacheManager) -> tuple:
    ids = [r for r in range(10) if r in m]
    return (
        m.free_queue().tolist(),
        m.ref_counts(np.arange(m.num_blocks)).tolist(),
        m.stats(),
        [m.block_table(r).tolist() for r in ids],
        len(m),
    )


def scheduler(outstanding: bool = False) -> tuple[kvcore.Scheduler, object]:
    s = kvcore.Scheduler(64, 4, max_num_batched_tokens=64, max_model_len=64)
    s.add_requests([1, 2], [1, 2, 3, 4, 5], [0, 3, 5], 4)
    plan = s.schedule()
    s.update(plan.step_id, np.zeros(plan.num_sampled, dtype=np.int64))
    plan = s.schedule() if outstanding else None
    return s, plan


def scheduler_state(s: kvcore.Scheduler) -> tuple:
    st = s.stats()
    fields = [k for k in dir(st) if not k.startswith("_")]
    return tuple(getattr(st, k) for k in fields) + (s.outstanding_step, s.has_unfinished())


# (name, make object, method, valid keyword arguments)
MANAGER_CALLS = [
    ("match_prefix", dict(tokens=T, offsets=[0, 10], namespaces=[0])),
    (
        "admit",
        dict(
            req_ids=[5],
            num_tokens=[4],
            tokens=T[:4],
            offsets=[0, 4],
            namespaces=[0],
            watermark_blocks=0,
        ),
    ),
    ("allocate_slots", dict(req_ids=[1], num_total_tokens=[12])),
    ("cache_computed", dict(req_ids=[1], tokens=T, offsets=[0, 10])),
    ("free", dict(req_ids=[1], tokens=T, offsets=[0, 10])),
    ("fork", dict(parent_ids=[1], child_ids=[7])),
    ("block_table", dict(req_id=1)),
    ("block_tables", dict(req_ids=[1, 2], width=5)),
    ("ref_counts", dict(block_ids=[1])),
    ("block_hash", dict(block_id=1)),
]
SCHEDULER_CALLS = [
    (
        "add_requests",
        dict(
            req_ids=[5],
            prompt_token_ids=[1, 2, 3],
            prompt_offsets=[0, 3],
            max_tokens=4,
            priorities=0,
            namespaces=0,
            n=1,
            ignore_eos=False,
            stop_token_ids=[9],
            stop_offsets=[0, 1],
        ),
    ),
    (
        "add_request",
        dict(
            req_id=5,
            prompt_token_ids=[1, 2],
            max_tokens=3,
            priority=0,
            namespace=0,
            n=1,
            ignore_eos=False,
            stop_token_ids=[9],
        ),
    ),
    ("abort_requests", dict(req_ids=[1])),
    ("bench_step", dict(token_id=0)),
]
SCHEDULER_NEW = dict(
    num_blocks=64,
    block_size=4,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    max_model_len=64,
    prefix_mode="radix",
    policy="fcfs",
    long_prefill_token_threshold=0,
    watermark=0.01,
    eos_token_id=0,
    enable_chunked_prefill=True,
)
MANAGER_NEW = dict(num_blocks=16, block_size=4, prefix_mode="radix")


def cases(calls):
    return [(name, kw, arg, bad) for name, kw in calls for arg in kw for bad in BAD]


def ids(case):
    name, _, arg, bad = case
    return f"{name}-{arg}-{type(bad).__name__}-{str(bad)[:6]}"


def attempt(call) -> bool:
    """True if `call` was refused (with a KvCoreError: anything else fails the test)."""
    try:
        call()
    except kvcore.KvCoreError:
        return True
    return False


def check_refusal(refused: bool, bad) -> None:
    if repr(bad) in NEVER_OK:
        assert refused, f"{bad!r} was accepted"


@pytest.mark.parametrize("mode", ["radix", "hash"])
@pytest.mark.parametrize("case", cases(MANAGER_CALLS), ids=ids)
def test_manager_methods(mode, case):
    name, kw, arg, bad = case
    m = manager(mode)
    before = manager_state(m)
    refused = attempt(lambda: getattr(m, name)(**{**kw, arg: bad}))
    m.check_invariants()
    check_refusal(refused, bad)
    if refused:
        assert manager_state(m) == before


@pytest.mark.parametrize("case", cases(SCHEDULER_CALLS), ids=ids)
def test_scheduler_methods(case):
    name, kw, arg, bad = case
    s, _ = scheduler()
    before = scheduler_state(s)
    refused = attempt(lambda: getattr(s, name)(**{**kw, arg: bad}))
    s.check_invariants()
    check_refusal(refused, bad)
    if refused:
        assert scheduler_state(s) == before


@pytest.mark.parametrize("arg", ["step_id", "sampled_token_ids"])
@pytest.mark.parametrize("bad", BAD, ids=lambda b: f"{type(b).__name__}-{str(b)[:6]}")
def test_scheduler_update(arg, bad):
    s, plan = scheduler(outstanding=True)
    kw = dict(step_id=plan.step_id, sampled_token_ids=np.zeros(plan.num_sampled, np.int64))
    before = scheduler_state(s)
    refused = attempt(lambda: s.update(**{**kw, arg: bad}))
    s.check_invariants()
    assert refused  # no bad value is a step id or a sampled-token array
    assert scheduler_state(s) == before
    s.update(**kw)  # the step is still outstanding and completes


@pytest.mark.parametrize(
    "cls,kw", [(kvcore.KvCacheManager, MANAGER_NEW), (kvcore.Scheduler, SCHEDULER_NEW)]
)
@pytest.mark.parametrize("bad", BAD, ids=lambda b: f"{type(b).__name__}-{str(b)[:6]}")
def test_constructors(cls, kw, bad):
    cls(**kw)
    for arg in kw:
        refused = attempt(lambda arg=arg: cls(**{**kw, arg: bad}))
        check_refusal(refused, bad)


@pytest.mark.parametrize("bad", BAD, ids=lambda b: f"{type(b).__name__}-{str(b)[:6]}")
def test_contains_never_raises(bad):
    m = manager()
    assert (bad in m) is False
    assert 1 in m and np.int64(2) in m


def test_step_output_arrays_edited_in_place_are_checked():
    s, _ = scheduler()
    out = s.abort_requests([1, 2])
    assert [o[0] for o in out.outputs()] == [1, 2]
    out.token_offsets[1] = 10**9
    with pytest.raises(kvcore.KvCoreError):
        out.outputs()
    out.token_offsets[1] = -5
    with pytest.raises(kvcore.KvCoreError):
        out.outputs()
