"""The byte copy of L2 loads and offloads on the CPU (``copy_block_rows``): each pair's row
moves in every layer and nothing else changes; bad input is a typed error with nothing copied."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from kvcore._kvcore import copy_block_rows
from kvcore.errors import InvalidArgumentError
from kvcore.tiers import BlockCodec, FetchJob, TierManager
from kvcore.tiers.stores import DiskStore


def layers(rng, rows: int, widths: list[int]) -> list[np.ndarray]:
    return [rng.integers(0, 256, (rows, w), dtype=np.uint8) for w in widths]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_block_rows_moves_exactly_the_pairs(threads):
    rng = np.random.default_rng(threads)
    widths = [4096, 8192, 4096, 16384]  # > 1 MiB in all: the threaded path runs too
    src = layers(rng, 80, widths)
    dst = layers(rng, 60, widths)
    want = [d.copy() for d in dst]
    pairs = np.stack([rng.choice(80, 40, replace=False), rng.choice(60, 40, replace=False)], 1)
    for w, s in zip(want, src, strict=True):
        w[pairs[:, 1]] = s[pairs[:, 0]]
    copy_block_rows(dst, src, pairs.astype(np.int32), threads=threads)
    for d, w in zip(dst, want, strict=True):
        np.testing.assert_array_equal(d, w)
    copy_block_rows(dst, src, np.zeros((0, 2), np.int64))  # no pairs: nothing to do


def test_copy_block_rows_refuses_bad_input_and_copies_nothing():
    rng = np.random.default_rng(0)
    src, dst = layers(rng, 6, [8, 8]), layers(rng, 4, [8, 8])
    before = [d.copy() for d in dst]
    ok = np.array([[0, 0]], np.int32)
    bad = [
        (dst, src, np.array([[0, 0], [6, 1]], np.int32)),  # source row out of range
        (dst, src, np.array([[0, 4]], np.int64)),  # destination row out of range
        (dst, src, np.array([[-1, 0]], np.int64)),  # negative
        (dst, src[:1], ok),  # layer counts differ
        (dst, [src[0], layers(rng, 6, [16])[0]], ok),  # row widths differ
        (dst, [s[:, ::2] for s in src], ok),  # not contiguous
        (dst, [s.view(np.int8) for s in src], ok),  # not uint8
        (dst, src, np.array([0, 0], np.int32)),  # pairs not [n, 2]
        (dst, src, ok.astype(np.float32)),
        (dst, dst, ok),  # source and destination alias
        (dst, 3, ok),
    ]
    for d, s, p in bad:
        with pytest.raises(InvalidArgumentError):
            copy_block_rows(d, s, p)
        for x, y in zip(dst, before, strict=True):
            np.testing.assert_array_equal(x, y)


def test_tier_manager_offload_then_load_round_trips_bf16_rows():
    torch.manual_seed(0)
    caches = [torch.randn(10, 2, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    codec = BlockCodec("fp", 3, "bf16", 4)
    tm = TierManager(caches, host_blocks=5, codec=codec, io_threads=1)
    try:
        orig = [c.clone() for c in caches]
        tm._copy(np.array([[2, 4], [7, 0]], np.int32), to_host=True)  # L1 2, 7 -> L2 4, 0
        tm._copy(np.array([[4, 9], [0, 1]], np.int32), to_host=False)  # back to L1 9, 1
        for c, o in zip(caches, orig, strict=True):
            assert torch.equal(c[9], o[2]) and torch.equal(c[1], o[7])
            keep = [i for i in range(10) if i not in (1, 9)]
            assert torch.equal(c[keep], o[keep])
    finally:
        tm.close()


class CountingDisk(DiskStore):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gets: list[str] = []

    def get(self, hexkey: str) -> bytes | None:
        self.gets.append(hexkey)
        return super().get(hexkey)


def test_fetches_of_one_step_read_each_shared_block_once(tmp_path):
    """Three waiting sequences share a 3-block prefix on disk; one of them has a fourth block
    that is missing: the disk is read 4 times, not 3 + 3 + 4 (what one fetch per sequence
    read), and each sequence gets its own leading run."""
    caches = [torch.zeros(6, 2, 4, 1, 2) for _ in range(2)]  # 64 B rows, 128 B blocks
    codec = BlockCodec("fp", 2, "fp32", 4)
    disk = CountingDisk(tmp_path, 1 << 20)
    tm = TierManager(caches, host_blocks=4, codec=codec, disk=disk, io_threads=1)
    try:
        rng = np.random.default_rng(0)
        keys = rng.integers(0, 256, (4, 32), dtype=np.uint8)
        toks = rng.integers(0, 500, (4, 4)).astype(np.int32)
        rows = rng.integers(0, 256, (3, tm.block_bytes), dtype=np.uint8)
        tm._publish(keys[:3], toks[:3], rows)  # block 3 never written
        wants = [(7, keys[:3], toks[:3]), (8, keys, toks), (9, keys[:2], toks[:2])]
        got = tm._fetch_batch(wants)
        assert sorted(disk.gets) == sorted(k.tobytes().hex() for k in keys)
        assert tm.fetch_reads == 4
        assert [len(got[i]) for i in (7, 8, 9)] == [3, 3, 2]
        for j, (payload, tier) in enumerate(got[8]):
            assert tier == 3 and payload == rows[j].tobytes()
    finally:
        tm.close()


class SlowDisk(DiskStore):
    """A disk tier whose every read takes ``delay`` seconds (a slow or stalled device)."""

    def __init__(self, *a, delay: float = 0.0, **kw):
        super().__init__(*a, **kw)
        self.delay = delay

    def get(self, hexkey: str) -> bytes | None:
        time.sleep(self.delay)
        return super().get(hexkey)


def _slow_fetch_setup(tmp_path, delay: float):
    caches = [torch.zeros(6, 2, 4, 1, 2) for _ in range(2)]
    codec = BlockCodec("fp", 2, "fp32", 4)
    disk = SlowDisk(tmp_path, 1 << 20, delay=delay)
    tm = TierManager(caches, 8, codec, disk=disk, io_threads=1, fetch_timeout_s=0.75)
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 256, (6, 32), dtype=np.uint8)
    toks = rng.integers(0, 500, (6, 4)).astype(np.int32)
    rows = rng.integers(0, 256, (6, tm.block_bytes), dtype=np.uint8)
    tm._publish(keys, toks, rows)
    # six sequences, one block each, no block shared: six reads in a row
    return tm, [(10 + i, keys[i : i + 1], toks[i : i + 1]) for i in range(6)], rows


def test_a_large_fetch_that_keeps_moving_is_waited_for_sequence_by_sequence(tmp_path):
    """Each read takes 0.25 s, the timeout is 0.75 s, the batch 1.5 s: every sequence is a hit
    (the timeout runs from the job's last progress, not from submission), and each one is
    handed over as soon as it is read, before the batch ends. (Margins of 0.5 s: a loaded CI
    machine may delay a thread.)"""
    tm, wants, rows = _slow_fetch_setup(tmp_path, delay=0.25)
    try:
        job = FetchJob(time.perf_counter())
        tm.io.submit(tm._run_fetch, job, wants)
        seen_early = False
        while not job.finished:
            now = time.perf_counter()
            states = [tm.fetched(job, kv, now) for kv, _, _ in wants]
            assert all(s is None or len(s) == 1 for s in states)  # never a miss
            seen_early |= states[0] is not None and states[-1] is None
            time.sleep(0.01)
        assert seen_early
        for i, (kv, _, _) in enumerate(wants):
            ((payload, tier),) = tm.fetched(job, kv, time.perf_counter())
            assert tier == 3 and payload == rows[i].tobytes()
    finally:
        tm.close()


def test_a_stalled_fetch_turns_into_misses(tmp_path):
    """A read that hangs past the timeout: the sequences not yet read are misses ([]), not
    errors, while the job is still running."""
    tm, wants, _ = _slow_fetch_setup(tmp_path, delay=1.75)
    try:
        job = FetchJob(time.perf_counter())
        tm.io.submit(tm._run_fetch, job, wants[:1])
        time.sleep(0.05)
        assert tm.fetched(job, wants[0][0], time.perf_counter()) is None  # still waiting
        time.sleep(1.0)
        assert not job.finished
        assert tm.fetched(job, wants[0][0], time.perf_counter()) == []
    finally:
        tm.close()
