"""``step_calls.LayerCalls``: a step's K/V store + attention for every layer, the argument
checks done on the first layer of each geometry. Same outputs and caches as the checked entry
points (``store_kv`` + ``paged_attention``) layer by layer, geometry changes mid-step (a sliding
window on every other layer), the checks really skipped, bad slots still refused before any
write, and quantized caches passed through to the checked path."""

from __future__ import annotations

import kvcore_kernels as kk
import pytest
import torch
from kernel_reference import make_batch
from kvcore_kernels import attention_cpu, cpu_native, step_calls
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant import allocate_kv_caches

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="extension not built")

REQS = [(5, 3), (0, 9), (20, 1), (13, 0)]  # (cached, new): prefill, chunk, decode, idle


def _step(seed: int, dtype: torch.dtype, layers: int):
    gen = torch.Generator().manual_seed(seed)
    b = make_batch(gen, REQS, block_size=8, num_q_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype)
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, b.block_size)
    table = b.block_table.long()
    slots = torch.cat(
        [
            table[r, torch.arange(c, c + q) // 8] * 8 + torch.arange(c, c + q) % 8
            for r, (c, q) in enumerate(REQS)
        ]
    )
    t = slots.numel()
    per_layer = [
        tuple(torch.randn(t, h, 64, generator=gen).to(dtype) for h in (6, 2, 2))
        for _ in range(layers)
    ]  # q, k, v
    return b.kv_cache, meta, slots, per_layer


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # free slots hold NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_layer_calls_match_the_checked_calls_layer_by_layer(dtype, slot_dtype):
    cache, meta, slots, layers = _step(0, dtype, 6)
    slots = slots.to(slot_dtype)
    fast_caches = [cache.clone() for _ in layers]
    checked_caches = [cache.clone() for _ in layers]
    calls = step_calls.LayerCalls()
    for i, (q, k, v) in enumerate(layers):
        window = 6 if i % 2 else None  # two geometries, alternating
        got = calls(q, k, v, fast_caches[i], slots, meta, scale=0.125, sliding_window=window)
        kk.store_kv(k, v, checked_caches[i], slots)
        want = kk.paged_attention(q, checked_caches[i], meta, scale=0.125, sliding_window=window)
        _same(got, want)
        _same(fast_caches[i], checked_caches[i])
    assert len(calls._fast) == 2


def test_the_checks_run_once_per_geometry(monkeypatch):
    cache, meta, slots, layers = _step(1, torch.bfloat16, 4)
    counted = []
    check = attention_cpu.check_attention_args

    def counting(*a, **kw):
        counted.append(1)
        return check(*a, **kw)

    monkeypatch.setattr(attention_cpu, "check_attention_args", counting)
    calls = step_calls.LayerCalls()
    for q, k, v in layers:
        calls(q, k, v, cache.clone(), slots, meta, scale=0.125)
    assert len(counted) == 1


def test_a_bad_slot_is_refused_before_any_write_on_the_fast_path():
    cache, meta, slots, layers = _step(2, torch.bfloat16, 2)
    calls = step_calls.LayerCalls()
    (q, k, v), (q2, k2, v2) = layers
    calls(q, k, v, cache.clone(), slots, meta, scale=0.125)
    second = cache.clone()
    slots[0] = cache.shape[0] * cache.shape[2] + 5  # past the cache's end, same slots object
    with pytest.raises(KernelConfigError):
        calls(q2, k2, v2, second, slots, meta, scale=0.125)
    _same(second, cache)


def test_quantized_caches_take_the_checked_path():
    cache, meta, slots, layers = _step(3, torch.bfloat16, 2)
    nb, _, bs, hk, d = cache.shape
    calls = step_calls.LayerCalls()
    for q, k, v in layers:
        a, b = allocate_kv_caches("int8", 2, nb, bs, hk, d, torch.bfloat16, "cpu")
        got = calls(q, k, v, a, slots, meta, scale=0.125)
        kk.store_kv(k, v, b, slots)
        torch.testing.assert_close(got, kk.paged_attention(q, b, meta, scale=0.125), rtol=0, atol=0)
    assert not calls._fast
