"""KIVI's residual: partial blocks stay in the model dtype, full ones are quantized once, the pool
evicts and restages without losing tokens, the window keeps recent full blocks exact."""

import numpy as np
import pytest
import torch
from kvcore_kernels import plan_attention
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant import allocate_kv_caches, read_tokens, store_kv_quant

BS, H, D = 8, 2, 32


def _check_state(st):
    staged = np.flatnonzero(st.stage_of_block >= 0)
    assert np.array_equal(st.block_of_slot[st.stage_of_block[staged]], staged)
    held = np.flatnonzero(st.block_of_slot >= 0)
    assert np.array_equal(st.stage_of_block[st.block_of_slot[held]], held)
    assert np.array_equal(st.device_map.numpy(), st.stage_of_block.astype(np.int32))


def _caches(n_layers=2, slots=4, window=0, fmt="kivi2"):
    return allocate_kv_caches(
        fmt, n_layers, 12, BS, H, D, torch.float32, "cpu",
        num_residual_blocks=slots, kivi_window=window, rotate="",
    )  # fmt: skip


def _write(caches, tokens, slots, meta=None):
    for c in caches:  # every layer stores the same step (one plan per step)
        store_kv_quant(tokens, tokens * 2, c, torch.tensor(slots, dtype=torch.int64), meta=meta)


def _slots(blocks, start, n):
    pos = np.arange(start, start + n)
    return (np.asarray(blocks)[pos // BS] * BS + pos % BS).tolist()


def test_prefill_and_decode_give_identical_blocks():
    torch.manual_seed(0)
    x = torch.randn(21, H, D)
    a, b = _caches(), _caches()
    _write(a, x, _slots([3, 5, 9], 0, 21))  # one step: every block staged...
    st = a[0].residual_state
    assert (st.stage_of_block[[3, 5, 9]] >= 0).all()  # ...this step reads them unquantized
    _write(a, x[:0], [])  # the next step quantizes the full ones
    for t in range(21):  # token by token
        _write(b, x[t : t + 1], _slots([3, 5, 9], t, 1))
    for ca, cb in zip(a, b, strict=True):
        for blk in (3, 5):
            assert torch.equal(ca.buffer[blk], cb.buffer[blk])
        idx = torch.tensor([9])
        assert torch.equal(read_tokens(ca, idx, 0)[0, :5], x[16:21])  # exact: model dtype
        assert torch.equal(read_tokens(cb, idx, 1)[0, :5], 2 * x[16:21])
    assert st.stage_of_block[9] >= 0 and st.stage_of_block[3] < 0 and st.fill[9] == 5
    _check_state(st)


def test_pool_eviction_then_restage_keeps_every_token():
    torch.manual_seed(1)
    caches = _caches(slots=1)
    st = caches[0].residual_state
    xa, xb = torch.randn(6, H, D), torch.randn(6, H, D)
    _write(caches, xa[:3], _slots([2], 0, 3))  # request A: partial block 2 in the only slot
    _write(caches, xb[:3], _slots([7], 0, 3))  # request B evicts it (quantized, 3 valid rows)
    assert st.stage_of_block[2] < 0 and st.stage_of_block[7] >= 0 and st.fill[2] == 3
    _write(caches, xa[3:6], _slots([2], 3, 3))  # A continues: restaged (decoded), B evicted
    _check_state(st)
    got = read_tokens(caches[1], torch.tensor([2]), 0)[0]
    assert torch.equal(got[3:6], xa[3:6])  # the new rows are exact
    err = (got[:3] - xa[:3]).abs().max() / xa[:3].abs().max()
    assert err < 0.6  # the evicted rows went through 2-bit once
    b = read_tokens(caches[0], torch.tensor([7]), 0)[0, :3]
    assert ((b - xb[:3]).abs().max() / xb[:3].abs().max()) < 0.6


def test_window_keeps_recent_full_blocks_in_model_dtype():
    torch.manual_seed(2)
    caches = _caches(window=1, slots=4)
    st = caches[0].residual_state
    blocks = [1, 2, 3, 4]
    x = torch.randn(3 * BS + 2, H, D)
    table = torch.tensor([blocks], dtype=torch.int32)
    for start in range(0, len(x), 5):
        n = min(5, len(x) - start)
        meta = plan_attention(
            torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([start + n], dtype=torch.int32),
            table,
            BS,
        )
        _write(caches, x[start : start + n], _slots(blocks, start, n), meta=meta)
        _check_state(st)
    # Blocks 1, 2 quantized; 3 (the last full one) and 4 (partial) still exact.
    assert st.stage_of_block[1] < 0 and st.stage_of_block[2] < 0
    got = read_tokens(caches[0], torch.tensor([3, 4]), 0).reshape(-1, H, D)
    assert torch.equal(got[: BS + 2], x[2 * BS :])
    with pytest.raises(KernelConfigError, match="needs the step's meta"):
        _write(caches, x[:1], _slots([5], 0, 1))


def test_pool_too_small_for_one_step_raises_without_change():
    caches = _caches(slots=1)
    st = caches[0].residual_state
    before = st.stage_of_block.copy()
    x = torch.randn(2, H, D)
    with pytest.raises(KernelConfigError, match="residual pool"):
        _write(caches, x, [2 * BS, 3 * BS])  # two partial blocks in one step, one slot
    assert np.array_equal(before, st.stage_of_block)
