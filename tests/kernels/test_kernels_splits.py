"""The flash-decoding split count as a pure function of (programs, keys, SMs): fills an H200 at
batch 1, leaves big grids alone, never makes a split too short or empty."""

import pytest
from kvcore_kernels.splits_triton import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    PROGRAMS_PER_SM,
    num_kv_splits,
)

H200_SMS = 132


def _nonempty(splits: int, keys: int, block_n: int) -> bool:
    tiles = -(-keys // block_n)
    per = -(-tiles // splits)
    return (splits - 1) * per < tiles  # the last split starts inside the key range


def test_batch_one_long_context_fills_every_sm():
    for kv_heads in (1, 2, 8):
        splits = num_kv_splits(kv_heads, 32768, H200_SMS)
        assert kv_heads * splits >= H200_SMS * PROGRAMS_PER_SM or splits == MAX_SPLITS
        assert 32768 / splits >= MIN_KEYS_PER_SPLIT
    assert num_kv_splits(8, 32768, H200_SMS) == 74  # 7 tiles of 64 keys each: 592 programs


def test_big_grids_and_short_contexts_are_not_split():
    assert num_kv_splits(H200_SMS * PROGRAMS_PER_SM, 32768, H200_SMS) == 1  # batch 66 x 8 heads
    assert num_kv_splits(8, 2 * MIN_KEYS_PER_SPLIT - 1, H200_SMS) == 1
    assert num_kv_splits(0, 32768, H200_SMS) == 1


@pytest.mark.parametrize("programs", [1, 3, 8, 64, 200])
@pytest.mark.parametrize("keys", [300, 1000, 4097, 32768, 131072])
@pytest.mark.parametrize("block_n", [16, 64])
def test_splits_are_bounded_long_enough_and_never_empty(programs, keys, block_n):
    splits = num_kv_splits(programs, keys, H200_SMS, block_n)
    assert 1 <= splits <= MAX_SPLITS
    if splits > 1:
        assert keys // splits >= MIN_KEYS_PER_SPLIT * 0.5  # whole tiles: at most half a split off
        assert _nonempty(splits, keys, block_n)


def test_enough_context_always_fills_the_grid():
    """Once every split can be MIN_KEYS_PER_SPLIT long, the grid reaches the target."""
    target = H200_SMS * PROGRAMS_PER_SM
    for programs in (1, 4, 8, 16):
        need = min(-(-target // programs), MAX_SPLITS)
        for keys in range(need * MIN_KEYS_PER_SPLIT, 65536, 997):
            s = num_kv_splits(programs, keys, H200_SMS)
            assert programs * s >= target or s >= MAX_SPLITS * 0.5, (programs, keys, s)
