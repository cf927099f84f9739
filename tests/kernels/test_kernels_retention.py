"""Released blocks (null block-table entries) and the attention-mass side output (H2O).

A released logical block has table entry 0; its keys get exactly zero weight and the null block
(NaN here, like every free slot) is never read. ``block_mass`` gets, per (request, logical
block), the probability its keys received, summed over query heads and rows. Plain caches and
quantized ones (released blocks, sliding windows and the KV splits a window bounds), torch twin
always; Triton through the interpreter at small shapes (or on CUDA).
"""

from __future__ import annotations

import kvcore_kernels as kk
import pytest
import torch
from kernel_reference import make_batch, triton_interpreted

BACKENDS = ["torch"] + (
    ["triton"] if triton_interpreted() or torch.cuda.is_available() else []
)  # fmt: skip
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (cached tokens, query tokens) per request: decode, chunked prefill mid-block, a mixed batch
CASES = {
    "decode": [(70, 1), (45, 1), (9, 1)],
    "chunk": [(53, 11), (64, 16)],
    "mixed": [(70, 1), (37, 9), (0, 12), (90, 1)],
}
FEATURES = {"plain": {}, "window": {"sliding_window": 40}, "softcap": {"soft_cap": 4.0}}
HQ, HK, D, BS = 4, 2, 64, 8


def released_batch(gen, reqs, release=True):
    """A batch with some earlier blocks of each request released (entry 0), never the blocks
    this step writes; returns (batch, released [num_reqs, max_blocks] bool). ``release=False``:
    the blocks to release are picked, the table is left whole."""
    b = make_batch(gen, reqs, block_size=BS, num_q_heads=HQ, num_kv_heads=HK, head_dim=D,
                   dtype=torch.float32)  # fmt: skip
    released = torch.zeros(b.block_table.shape, dtype=torch.bool)
    for r, (ctx, _) in enumerate(reqs):
        first_written = ctx // BS
        if first_written > 1:
            drop = torch.rand(first_written, generator=gen) < 0.5
            drop[0] = False  # a sink stays
            drop[torch.randint(1, first_written, (1,), generator=gen)] = True
            released[r, :first_written] = drop
    if release:
        b.block_table[released] = 0
    return b, released


def oracle(b, released, scale, sliding_window=None, soft_cap=None):
    """float64 dense attention without the released keys; also the per-block mass."""
    qsl = b.query_start_loc.tolist()
    out = torch.zeros(b.query.shape, dtype=torch.float64)
    mass = torch.zeros(b.block_table.shape, dtype=torch.float64)
    for r, (k, v) in enumerate(zip(b.keys, b.values, strict=True)):
        lo, hi = qsl[r], qsl[r + 1]
        seq = k.shape[0]
        k = k.double().repeat_interleave(HQ // HK, dim=1)
        v = v.double().repeat_interleave(HQ // HK, dim=1)
        q_pos = torch.arange(seq - (hi - lo), seq)[:, None]
        k_pos = torch.arange(seq)[None, :]
        s = torch.einsum("qhd,khd->hqk", b.query[lo:hi].double(), k) * scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        ok = (k_pos <= q_pos) & ~released[r][k_pos // BS]
        if sliding_window is not None:
            ok &= q_pos - k_pos < sliding_window
        p = torch.softmax(s.masked_fill(~ok[None], float("-inf")), dim=-1)  # [H, q, k]
        out[lo:hi] = torch.einsum("hqk,khd->qhd", p, v)
        mass[r].index_add_(0, torch.arange(seq) // BS, p.sum(dim=(0, 1)))
    return out, mass


def run(b, backend, block_mass=None, **feats):
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, BS, device=DEV)
    out = torch.full(b.query.shape, float("nan"), device=DEV)
    kk.paged_attention(b.query.to(DEV), b.kv_cache.to(DEV), meta, scale=D**-0.5, out=out,
                       backend=backend, block_mass=block_mass, **feats)  # fmt: skip
    return out.cpu(), meta


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_released_keys_get_zero_weight(gen, backend, case, feature):
    b, released = released_batch(gen, CASES[case])
    assert released.any()
    out, meta = run(b, backend, **FEATURES[feature])
    assert meta.num_released == int(released.sum())
    want, _ = oracle(b, released, D**-0.5, **FEATURES[feature])
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_mass_matches_oracle(gen, backend, case):
    b, released = released_batch(gen, CASES[case])
    mass = torch.ones(b.block_table.shape, dtype=torch.float32, device=DEV)  # it adds
    out, _ = run(b, backend, block_mass=mass)
    want_out, want_mass = oracle(b, released, D**-0.5)
    torch.testing.assert_close(out.double(), want_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(mass.cpu().double() - 1, want_mass, atol=1e-4, rtol=1e-4)
    assert (mass.cpu()[released] == 1).all()  # released blocks get nothing
    q_lens = torch.diff(b.query_start_loc).double()
    torch.testing.assert_close((mass.cpu().double() - 1).sum(1), q_lens * HQ, atol=1e-4, rtol=1e-5)


def test_torch_and_triton_mass_agree_with_window(gen):
    if "triton" not in BACKENDS:
        pytest.skip("needs Triton (interpreter or CUDA)")
    b, _ = released_batch(gen, CASES["mixed"])
    masses = []
    for backend in ("torch", "triton"):
        m = torch.zeros(b.block_table.shape, dtype=torch.float32, device=DEV)
        run(b, backend, block_mass=m, sliding_window=30, soft_cap=5.0)
        masses.append(m.cpu())
    torch.testing.assert_close(masses[0], masses[1], atol=1e-4, rtol=1e-4)


def test_no_release_is_unchanged_by_the_mass_path(gen):
    b = make_batch(gen, [(20, 1), (5, 9)], block_size=BS, num_q_heads=HQ, num_kv_heads=HK,
                   head_dim=D, dtype=torch.float32)  # fmt: skip
    plain, meta = run(b, "torch")
    assert meta.num_released == 0
    with_mass, _ = run(b, "torch", block_mass=torch.zeros(b.block_table.shape))
    torch.testing.assert_close(plain, with_mass, atol=2e-6, rtol=2e-6)


def test_written_block_released_is_an_error():
    with pytest.raises(kk.KernelConfigError, match="null block .released. but this step"):
        kk.plan_attention([0, 1], [17], [[1, 2, 0]], 8)  # position 16 is written in block 2


@pytest.mark.parametrize("bad", [torch.zeros(2, 3), torch.zeros(1, 3, dtype=torch.float64),
                                 torch.zeros(1, 6)[:, ::2]])  # fmt: skip
def test_bad_block_mass(bad):
    meta = kk.plan_attention([0, 1], [17], [[1, 0, 2]], 8)
    cache = kk.allocate_kv_cache(3, 8, HK, D, torch.float32, "cpu")
    with pytest.raises(kk.KernelConfigError, match="block_mass must be"):
        kk.paged_attention(torch.randn(1, HQ, D), cache, meta, scale=0.1, block_mass=bad,
                           backend="torch")  # fmt: skip


QUANT = ["int8", "fp8_e4m3", "int4", "kivi2"]


def quant_batch(gen, reqs, fmt):
    """``released_batch``'s sequences stored in a ``fmt`` cache (torch store), the null block
    poisoned (0xFF bytes: NaN scales and codes), then the blocks released; the batch's keys and
    values become what the cache decodes them to (what the oracle reads)."""
    from kvcore_kernels.quant import allocate_kv_caches, read_tokens, store_kv_quant

    b, released = released_batch(gen, reqs, release=False)
    (cache,) = allocate_kv_caches(fmt, 1, b.kv_cache.shape[0], BS, HK, D, torch.float32, DEV,
                                  num_residual_blocks=b.block_table.shape[1] + 1)  # fmt: skip
    lens = [k.shape[0] for k in b.keys]
    tables = [b.block_table[r, : (n + BS - 1) // BS].long() for r, n in enumerate(lens)]
    for k, v, n, blocks in zip(b.keys, b.values, lens, tables, strict=True):
        pos = torch.arange(n)
        slots = (blocks[pos // BS] * BS + pos % BS).to(DEV)
        store_kv_quant(k.to(DEV), v.to(DEV), cache, slots, backend="torch")
    for r, (n, blocks) in enumerate(zip(lens, tables, strict=True)):  # after every store: KIVI
        for which, xs in ((0, b.keys), (1, b.values)):  # moves blocks out of its residual
            x = read_tokens(cache, blocks.to(DEV), which)
            xs[r] = cache.rotate_out(x, "kv"[which]).reshape(-1, HK, D)[:n].cpu()
    cache.buffer[0] = 255
    b.block_table[released] = 0
    return cache, b, released


def run_quant(cache, b, backend, **feats):
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, BS, device=DEV)
    out = kk.paged_attention(b.query.to(DEV), cache, meta, scale=D**-0.5, backend=backend,
                             **feats)  # fmt: skip
    return out.cpu(), meta


@pytest.mark.parametrize("feature", ["plain", "window"])
@pytest.mark.parametrize("case", ["decode", "mixed"])
@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_released_keys_get_zero_weight(gen, backend, fmt, case, feature):
    cache, b, released = quant_batch(gen, CASES[case], fmt)
    assert released.any()
    out, meta = run_quant(cache, b, backend, **FEATURES[feature])
    assert meta.num_released == int(released.sum())
    want, _ = oracle(b, released, D**-0.5, **FEATURES[feature])
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "kivi2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_window_with_kv_splits(gen, backend, fmt):
    # A long decode and a chunk: with a 600-key window the Triton launch splits the window's
    # keys (2 splits under the interpreter's 4 "SMs"); released blocks lie inside the window.
    cache, b, released = quant_batch(gen, [(1200, 1), (1100, 5)], fmt)
    out, meta = run_quant(cache, b, backend, sliding_window=600)
    want, _ = oracle(b, released, D**-0.5, sliding_window=600)
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


def test_quantized_splits_honour_the_window(gen):
    # The split count is taken over the keys a tile can see: the window (plus its queries and,
    # for a quantized cache, the block its first tile starts in), as for a plain cache.
    pytest.importorskip("triton")
    if "triton" not in BACKENDS:
        pytest.skip("needs Triton (interpreter or CUDA)")
    from kvcore_kernels.checks import check_attention_call
    from kvcore_kernels.paged_triton import plan_launch
    from kvcore_kernels.quant.checks import shape_proxy

    cache, b, _ = quant_batch(gen, [(2000, 1)], "int8")
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, BS, device=DEV)
    q = b.query.to(DEV)
    splits = {}
    for window in (None, 64, 600):
        for name, kv in (("plain", b.kv_cache.to(DEV)), ("quant", shape_proxy(cache))):
            call = check_attention_call(q, kv, meta, dict(scale=0.1, sliding_window=window))
            slack = BS if name == "quant" else 0
            splits[name, window] = plan_launch(q, meta, call, key_slack=slack).splits
    if DEV == "cpu":
        assert splits["quant", None] > 2 and splits["quant", 64] == 1
        assert splits["quant", 600] == 2
    for window in (None, 64, 600):
        assert splits["quant", window] == splits["plain", window]


def test_quantized_cache_refuses_block_mass():
    from kvcore_kernels.quant import allocate_kv_caches

    meta = kk.plan_attention([0, 1], [17], [[1, 0, 2]], 8)
    (cache,) = allocate_kv_caches("int8", 1, 3, 8, HK, D, torch.float32, "cpu")
    with pytest.raises(kk.KernelConfigError, match="plain caches only"):
        kk.paged_attention(torch.randn(1, HQ, D), cache, meta, scale=0.1, backend="torch",
                           block_mass=torch.zeros(1, 3))  # fmt: skip
