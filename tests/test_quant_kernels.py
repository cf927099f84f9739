"""Quantizing store and dequantizing attention: torch twin against a float64 oracle over the
decoded cache, Triton (interpreter on CPU) against the twin, copies carrying their scales."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton module of kvcore_kernels is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kvcore_kernels as kk  # noqa: E402
from kvcore_kernels.errors import KernelConfigError  # noqa: E402
from kvcore_kernels.quant import (  # noqa: E402
    allocate_kv_caches,
    copy_blocks,
    paged_attention_quant,
    read_tokens,
    store_kv_quant,
)


@pytest.fixture
def gen(request):
    """A fresh seed per run (KVCORE_TEST_SEED replays one; it is in the test's report)."""
    seed = int(os.environ.get("KVCORE_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)


QUANT = [
    "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_tensor", "int8", "int4", "int4_k8", "int2", "kivi4", "kivi2"
]  # fmt: skip
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS, H, HQ, D = 16, 2, 6, 64


def _run(name, dtype, backend, gen, lens=(37, 20), chunk=13, window=0, store_backend=None):
    """Chunked prefill of two requests; returns (cache, outputs, K, V, table). The store runs
    on ``store_backend`` (default: ``backend``), the attention on ``backend``."""
    table = torch.tensor([[1, 2, 3, 4], [6, 7, 8, 0]], dtype=torch.int32)
    cache = allocate_kv_caches(
        name, 1, 10, BS, H, D, dtype, DEVICE, num_residual_blocks=6, kivi_window=window
    )[0]
    keys = [torch.randn(n, H, D, generator=gen) * 2 for n in lens]
    for k in keys:
        k[:, :, 5] += 6.0  # an outlier channel, as real keys have
    values = [torch.randn(n, H, D, generator=gen) for n in lens]
    queries = [torch.randn(n, HQ, D, generator=gen) for n in lens]
    outs = []
    for a in range(0, max(lens), chunk):
        parts = [(r, a, min(n, a + chunk)) for r, n in enumerate(lens) if a < n]
        pos = [torch.arange(lo, hi) for _, lo, hi in parts]
        slots = torch.cat(
            [
                table[r].long()[p // BS] * BS + p % BS
                for (r, _, _), p in zip(parts, pos, strict=True)
            ]
        )

        def cat(xs, parts=parts):
            return torch.cat([xs[r][lo:hi] for r, lo, hi in parts]).to(dtype).to(DEVICE)

        q_lens = torch.tensor([0] + [hi - lo for _, lo, hi in parts])
        rows = [r for r, _, _ in parts]
        meta = kk.plan_attention(
            torch.cumsum(q_lens, 0).int(),
            torch.tensor([hi for _, _, hi in parts], dtype=torch.int32),
            table[rows],
            BS,
            device=DEVICE,
        )
        store_kv_quant(
            cat(keys), cat(values), cache, slots.to(DEVICE), meta=meta,
            backend=store_backend or backend,
        )  # fmt: skip
        outs.append(
            paged_attention_quant(cat(queries), cache, meta, scale=D**-0.5, backend=backend)
        )
    return cache, outs, keys, values, queries, table


def _oracle(cache, table, lens, queries):
    """float64 causal attention of whole sequences over the decoded cache (the oracle)."""
    res = []
    for r, n in enumerate(lens):
        blocks = table[r, : (n + BS - 1) // BS].long().to(DEVICE)
        k = cache.rotate_out(read_tokens(cache, blocks, 0), "k").reshape(-1, H, D)[:n].double()
        v = cache.rotate_out(read_tokens(cache, blocks, 1), "v").reshape(-1, H, D)[:n].double()
        q = queries[r].double().to(DEVICE)
        kq = k.repeat_interleave(HQ // H, 1)
        vq = v.repeat_interleave(HQ // H, 1)
        s = torch.einsum("qhd,khd->hqk", q, kq) * D**-0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEVICE).triu(1), -torch.inf)
        res.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vq))
    return res


@pytest.mark.parametrize("name", QUANT)
def test_torch_twin_matches_oracle_on_decoded_cache(name, gen):
    lens = (37, 20)
    cache, outs, keys, values, queries, table = _run(
        name, torch.float32, "torch", gen, lens, chunk=lens[0]
    )
    # One chunk covers everything, so the single step's output is the whole causal attention.
    want = _oracle(cache, table, lens, queries)
    got = outs[0]
    assert torch.allclose(got[: lens[0]].double(), want[0], atol=1e-4)
    assert torch.allclose(got[lens[0] :].double(), want[1], atol=1e-4)
    # The decoded cache is close to what was stored (loose: 2-bit formats are coarse).
    blocks = table[0, :3].long().to(DEVICE)
    k = cache.rotate_out(read_tokens(cache, blocks, 0), "k").reshape(-1, H, D)[: lens[0]]
    rel = float((k - keys[0].to(DEVICE)).norm() / keys[0].norm())
    bound = 0.08 if "e5m2" in name else {8: 0.04, 4: 0.15, 2: 0.6}[cache.fmt.bits]
    assert rel < bound, rel


@pytest.mark.parametrize(
    "name,dtype",
    [("int8", torch.float32), ("fp8_e4m3", torch.bfloat16), ("int4", torch.float16),
     ("int2", torch.float32), ("kivi2", torch.float32), ("kivi4", torch.float16)],
)  # fmt: skip
def test_triton_matches_torch_twin(name, dtype, gen):
    seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
    a = _run(name, dtype, "torch", torch.Generator().manual_seed(seed), lens=(29, 18), chunk=11)
    b = _run(name, dtype, "triton", torch.Generator().manual_seed(seed), lens=(29, 18), chunk=11)
    if DEVICE == "cpu":  # the interpreter computes in IEEE fp32 like torch: identical bytes
        assert torch.equal(a[0].buffer, b[0].buffer)
    else:  # GPU division may differ in the last ulp: a code may flip at a rounding tie
        assert (a[0].buffer != b[0].buffer).float().mean() < 0.01
        # A flipped code moves a value by a whole step (at 4 bits, far past the tolerance
        # below): the attention kernel is compared on the twin's stored bytes instead.
        gen_b = torch.Generator().manual_seed(seed)
        b = _run(name, dtype, "triton", gen_b, lens=(29, 18), chunk=11, store_backend="torch")
        assert torch.equal(a[0].buffer, b[0].buffer)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.allclose(x.float(), y.float(), atol=tol, rtol=tol)


def test_store_skips_padding_and_null_slots_and_rejects_out_of_range(gen):
    cache = allocate_kv_caches("int8", 1, 4, BS, H, D, torch.float32, DEVICE)[0]
    k = torch.randn(3, H, D, generator=gen).to(DEVICE)
    store_kv_quant(k, k, cache, torch.tensor([-1, 3, 20], device=DEVICE))
    assert not cache.buffer[0].any()  # null block untouched
    assert cache.buffer[1].any()  # slot 20 = block 1, offset 4
    before = cache.buffer.clone()
    with pytest.raises(KernelConfigError, match="past the cache"):
        store_kv_quant(k, k, cache, torch.tensor([17, 18, 64], device=DEVICE), backend="torch")
    assert torch.equal(before, cache.buffer)
    with pytest.raises(KernelConfigError, match="the cache stores"):
        store_kv_quant(k.half(), k.half(), cache, torch.tensor([17, 18, 19], device=DEVICE))


@pytest.mark.parametrize("name", ["int4", "fp8_e4m3", "kivi2"])
def test_copy_blocks_carries_scales_and_residual(name, gen):
    cache, _, _, _, _, table = _run(name, torch.float32, "torch", gen, lens=(37, 20), chunk=37)
    plain = kk.allocate_kv_cache(10, BS, H, D, torch.float32, DEVICE)
    plain[3] = 1.0
    src, dst = [1, 3, 7], [5, 9, 4]  # block 3 (request 0's partial last block) and 7 (partial)
    copy_blocks([plain, cache], src, dst)
    # (KIVI: the full block 1 was quantized by the copy; the partial ones stay in the residual.)
    expect = {b: read_tokens(cache, torch.tensor([b], device=DEVICE), 0) for b in src}
    assert torch.equal(plain[9], plain[3])
    for s, d in zip(src, dst, strict=True):
        got = read_tokens(cache, torch.tensor([d], device=DEVICE), 0)
        n = 16 if s == 1 else (5 if s == 3 else 4)  # valid rows of each source block
        assert torch.equal(got[:, :n], expect[s][:, :n])


def test_generic_entry_points_dispatch_on_quantized_caches(gen):
    """``kk.store_kv`` / ``kk.paged_attention`` serve a QuantKVCache like a plain cache."""
    cache = allocate_kv_caches("int8", 1, 4, BS, H, D, torch.float32, DEVICE)[0]
    k = torch.randn(5, H, D, generator=gen).to(DEVICE)
    q = torch.randn(5, HQ, D, generator=gen).to(DEVICE)
    slots = torch.arange(BS, BS + 5, device=DEVICE)
    kk.store_kv(k, k, cache, slots)
    meta = kk.plan_attention(
        torch.tensor([0, 5], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32),
        torch.tensor([[1]], dtype=torch.int32),
        BS,
        device=DEVICE,
    )
    out = kk.paged_attention(q, cache, meta, scale=D**-0.5)
    assert torch.equal(out, paged_attention_quant(q, cache, meta, scale=D**-0.5))
    with pytest.raises(KernelConfigError):
        kk.paged_attention(q[:, :5], cache, meta, scale=D**-0.5)  # 5 query heads, 2 KV heads
