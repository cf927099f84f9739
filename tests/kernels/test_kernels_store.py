"""store_kv: both backends write exactly the slots asked for and nothing else."""

from __future__ import annotations

import kvcore_kernels as kk
import pytest
import torch
from kernel_reference import make_batch, reference_attention, triton_interpreted

BACKENDS = ["torch", "triton"]
CPU_BACKENDS = ["torch", "auto", "cpu"]  # auto/cpu: the native row copy where it is built


def backend_or_skip(backend: str, device: str = "cpu") -> str:
    if backend == "triton" and device == "cpu" and not triton_interpreted():
        pytest.skip("Triton kernels are not running under TRITON_INTERPRET=1 here")
    return backend


def expected_store(cache, key, value, slots):
    """Slot-by-slot Python loop: the obvious semantics."""
    want = cache.clone()
    block_size = cache.shape[2]
    for t, s in enumerate(slots.tolist()):
        if s < block_size:  # padding (negative) or the null block
            continue
        want[s // block_size, 0, s % block_size] = key[t]
        want[s // block_size, 1, s % block_size] = value[t]
    return want


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS + CPU_BACKENDS[1:])
def test_store_writes_only_real_slots(gen, backend, dtype, slot_dtype):
    backend_or_skip(backend)
    num_blocks, block_size, heads, dim = 9, 8, 3, 64
    cache = torch.randn(num_blocks, 2, block_size, heads, dim, generator=gen).to(dtype)
    num_tokens = 30
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding
    slots[3] = 5  # inside the null block: skipped
    key = torch.randn(num_tokens, heads, dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(dtype)
    want = expected_store(cache, key, value, slots)
    kk.store_kv(key, value, cache, slots.to(slot_dtype), backend=backend)
    assert torch.equal(cache, want)


def test_store_strided_inputs(gen):
    """key/value views (e.g. slices of a fused QKV projection) are accepted."""
    cache = kk.allocate_kv_cache(4, 16, 2, 64, torch.float32, "cpu")
    qkv = torch.randn(5, 3, 2, 64, generator=gen)
    slots = torch.tensor([16, 17, 40, -1, 63])
    want = expected_store(cache, qkv[:, 1], qkv[:, 2], slots)
    kk.store_kv(qkv[:, 1], qkv[:, 2], cache, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_store_past_the_end_raises_and_changes_nothing(backend):
    cache = kk.allocate_kv_cache(3, 8, 1, 64, torch.float32, "cpu")
    before = cache.clone()
    key = torch.ones(2, 1, 64)
    with pytest.raises(kk.KernelConfigError, match="past the cache"):
        kk.store_kv(key, key, cache, torch.tensor([9, 24]), backend=backend)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("block_size", [1, 8, 16, 128])
def test_native_store_matches_the_twin(gen, block_size):
    """The native row copy, where built, writes what the twin writes, strided rows too; where a
    token's heads are not adjacent it declines (False, nothing written) and the twin runs."""
    from kvcore_kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("the native extension is not built")
    num_blocks, heads, dim = 30 // block_size + 2, 3, 64  # at least 20 slots past the null block
    cache = torch.randn(num_blocks, 2, block_size, heads, dim, generator=gen).bfloat16()
    fused = torch.randn(20, 3, heads, dim, generator=gen).bfloat16()  # a fused QKV's output
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20] - block_size // 2
    want = expected_store(cache, key, value, slots)
    assert cpu_native.store(key, value, cache, slots)
    assert torch.equal(cache, want)
    apart = torch.randn(20, 2 * heads, dim, generator=gen).bfloat16()[:, ::2]  # heads apart
    before = cache.clone()
    assert not cpu_native.store(apart, apart, cache, slots)
    assert torch.equal(cache, before)
    kk.store_kv(apart, apart, cache, slots)  # auto: the twin takes it
    assert torch.equal(cache, expected_store(before, apart, apart, slots))


def test_store_triton_skips_slots_past_the_end(gen):
    backend_or_skip("triton")
    cache = kk.allocate_kv_cache(3, 8, 1, 64, torch.float32, "cpu")
    key = torch.randn(2, 1, 64, generator=gen)
    kk.store_kv(key, key, cache, torch.tensor([9, 24]), backend="triton")
    assert torch.equal(cache[1, 0, 1], key[0]) and torch.equal(cache[1, 1, 1], key[0])
    assert cache.count_nonzero() == 2 * 64  # slot 24 (one past the end) was skipped


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda k, v, c, s: (k.to(torch.float16), v, c, s), "dtype"),
        (lambda k, v, c, s: (k[:, :1], v, c, s), "num_tokens"),
        (lambda k, v, c, s: (k, v[:2], c, s), "tokens"),
        (lambda k, v, c, s: (k, v, c, s.float()), "int32 or int64"),
        (lambda k, v, c, s: (k, v, c, s[:2]), "slot_mapping must be"),
        (lambda k, v, c, s: (k, v, c[:, :1], s), "kv_cache must be"),
        (lambda k, v, c, s: (k, v, c.to(torch.int8), s), "dtype"),
        (lambda k, v, c, s: (k[..., ::2], v, c, s), "num_tokens"),
    ],
)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_store_bad_input(mutate, match, backend):
    cache = kk.allocate_kv_cache(3, 8, 2, 64, torch.float32, "cpu")
    key = torch.ones(3, 2, 64)
    args = mutate(key, key.clone(), cache, torch.tensor([8, 9, 10]))
    with pytest.raises(kk.KernelConfigError, match=match):
        kk.store_kv(*args, backend=backend)
    assert cache.count_nonzero() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_then_attend(gen, backend):
    """The engine's order: store the step's K/V through the slot mapping, then attend."""
    backend_or_skip(backend)
    reqs = [(21, 1), (0, 13), (7, 6)]
    b = make_batch(
        gen, reqs, block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )
    # Forget this step's tokens in the cache, then store them back through the slot mapping.
    slots, keys, values = [], [], []
    for r, (ctx, q_len) in enumerate(reqs):
        for p in range(ctx, ctx + q_len):
            slot = int(b.block_table[r, p // 8]) * 8 + p % 8
            b.kv_cache[slot // 8, :, slot % 8] = float("nan")
            slots.append(slot)
        keys.append(b.keys[r][ctx:])
        values.append(b.values[r][ctx:])
    kk.store_kv(
        torch.cat(keys), torch.cat(values), b.kv_cache, torch.tensor(slots), backend=backend
    )
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 8)
    out = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.125, backend=backend)
    assert (out.double() - reference_attention(b, scale=0.125)).abs().max() < 2e-5


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_cuda_matches_twin(gen, dtype):
    cache = torch.randn(40, 2, 16, 8, 128, generator=gen).to(dtype).cuda()
    slots = torch.randperm(40 * 16, generator=gen)[:300]
    slots[::5] = -1
    key = torch.randn(300, 8, 128, generator=gen).to(dtype).cuda()
    value = torch.randn(300, 8, 128, generator=gen).to(dtype).cuda()
    twin = cache.clone()
    kk.store_kv(key, value, twin, slots.cuda(), backend="torch")
    kk.store_kv(key, value, cache, slots.cuda(), backend="triton")
    assert torch.equal(cache, twin)
