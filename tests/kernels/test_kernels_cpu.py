"""The native CPU kernel (backend "cpu") against the torch twin, its reference.

Every layout the kernel serves (fp32 / bf16 / fp16 caches, int8 and fp8 quantized caches),
sliding windows, soft-capping, ALiBi, block sizes 8-128 (odd ones too), queries starting
mid-block, single tokens, requests with no query this step (empty rows), released blocks,
forced split-KV, every code path the CPU has (AVX-512, AVX2, the portable one) and the
three thread modes. Batches come from hypothesis; the cache's free slots hold NaN and the output
starts as NaN (``make_batch``), so a stray read or an unwritten row fails.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import kvcore_kernels as kk
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from kernel_reference import make_batch
from kvcore_kernels import attention_cpu, cpu_native
from kvcore_kernels.quant import allocate_kv_caches

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="extension not built")

TOL = {torch.float32: 3e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
HEADS = [(4, 4), (8, 2), (6, 1), (9, 3)]
BLOCK_SIZES = [8, 12, 16, 32, 64, 128]
QUANT = ["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_tensor"]


@pytest.fixture(params=["avx512", "avx512-noamx", "avx2", "portable"])
def path(request, monkeypatch):
    """Every code path this CPU has: "avx512" is the best one (AMX tiles on the prefill path
    where the CPU has them); "avx512-noamx" the same without the tiles (run where AMX is)."""
    feats = cpu_native.features()
    if request.param in ("avx512", "avx2") and not feats.get(request.param):
        pytest.skip(f"no {request.param} path on this CPU")
    if request.param == "avx512-noamx" and not feats.get("amx"):
        pytest.skip("no AMX here: the avx512 path is the one without tiles")
    isa = {"avx2": "avx2", "avx512-noamx": "noamx"}.get(request.param, "auto")
    monkeypatch.setattr(cpu_native.OPTIONS, "portable", request.param == "portable")
    monkeypatch.setattr(cpu_native.OPTIONS, "isa", isa)
    return request.param


@st.composite
def batches(draw):
    reqs = draw(
        st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), min_size=1, max_size=6).filter(
            lambda rs: any(q > 0 for _, q in rs)
        )
    )
    reqs = [(c, q) if c + q > 0 else (0, 1) for c, q in reqs]
    hq, hk = draw(st.sampled_from(HEADS))
    return {
        "reqs": reqs,
        "num_q_heads": hq,
        "num_kv_heads": hk,
        "block_size": draw(st.sampled_from(BLOCK_SIZES)),
        "head_dim": draw(st.sampled_from([16, 48, 64, 128])),
        "dtype": draw(st.sampled_from(list(TOL))),
        "window": draw(st.one_of(st.none(), st.integers(1, 100))),
        "soft_cap": draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
        "alibi": draw(st.booleans()),
        "split_keys": draw(st.sampled_from([None, None, 16, 48])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _features(b, draw, device="cpu"):
    gen = torch.Generator().manual_seed(draw["seed"] + 1)
    alibi = torch.rand(b.query.shape[1], generator=gen) * 0.3 if draw["alibi"] else None
    return {
        "scale": b.query.shape[2] ** -0.5,
        "sliding_window": draw["window"],
        "soft_cap": draw["soft_cap"],
        "alibi_slopes": alibi,
    }


def _quantized(b, fmt, rotate=None, keys=None, values=None, fp8_scales=None):
    """The batch's K/V (or ``keys`` / ``values`` of the same shapes) stored in a fresh ``fmt``
    cache through each request's own blocks (``rotate``, ``fp8_scales``: as
    ``allocate_kv_caches``'s; None keeps the format's own)."""
    keys, values = keys or b.keys, values or b.values
    nb, _, bs, hk, d = b.kv_cache.shape
    cache = allocate_kv_caches(
        fmt, 1, nb, bs, hk, d, b.kv_cache.dtype, "cpu", rotate=rotate, fp8_scales=fp8_scales
    )[0]
    kk.store_kv(torch.cat(keys), torch.cat(values), cache, _slots(b), backend="torch")
    return cache


def _slots(b):
    """The cache slot of every stored token, requests in order (their own blocks)."""
    bs, table = b.kv_cache.shape[2], b.block_table.long()
    return torch.cat(
        [table[r, torch.arange(len(k)) // bs] * bs + torch.arange(len(k)) % bs
         for r, k in enumerate(b.keys)]
    )  # fmt: skip


def _compare(native, twin, dtype):
    """Within ``TOL`` plus, for bf16 outputs, one bf16 rounding step of the value (both sides
    round their output to bf16: at |x| >= 4 one step is 2^-5, past the absolute bound)."""
    assert not torch.isnan(native).any(), "a row was left unwritten"
    diff = (native.float() - twin.float()).abs()
    rel = 2.0**-7 if dtype == torch.bfloat16 else 0.0
    excess = (diff - TOL[dtype] - twin.float().abs() * rel).max().item()
    assert excess <= 0, f"max error {diff.max().item()} exceeds the bound by {excess}"


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(draw=batches())
def test_plain_cache_matches_twin(draw, path, monkeypatch):
    monkeypatch.setattr(cpu_native.OPTIONS, "split_keys", draw["split_keys"])
    monkeypatch.setattr(cpu_native.OPTIONS, "fuse_heads", draw["seed"] % 2 == 0)
    gen = torch.Generator().manual_seed(draw["seed"])
    b = make_batch(
        gen, draw["reqs"], block_size=draw["block_size"], num_q_heads=draw["num_q_heads"],
        num_kv_heads=draw["num_kv_heads"], head_dim=draw["head_dim"], dtype=draw["dtype"],
    )  # fmt: skip
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, b.block_size)
    feats = _features(b, draw)
    out = torch.full_like(b.query, float("nan"))
    native = kk.paged_attention(b.query, b.kv_cache, meta, **feats, backend="cpu", out=out)
    assert native is out
    twin = kk.paged_attention(b.query, b.kv_cache, meta, **feats, backend="torch")
    _compare(native, twin, draw["dtype"])


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(draw=batches(), fmt=st.sampled_from(QUANT))
def test_quantized_cache_matches_twin(draw, fmt, path, monkeypatch):
    monkeypatch.setattr(cpu_native.OPTIONS, "split_keys", draw["split_keys"])
    gen = torch.Generator().manual_seed(draw["seed"])
    dtype, bs = draw["dtype"], draw["block_size"]
    b = make_batch(
        gen, draw["reqs"], block_size=bs, num_q_heads=draw["num_q_heads"],
        num_kv_heads=draw["num_kv_heads"], head_dim=draw["head_dim"], dtype=dtype,
    )  # fmt: skip
    cache = _quantized(b, fmt)
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, bs)
    feats = _features(b, draw)
    native = kk.paged_attention(b.query, cache, meta, **feats, backend="cpu")
    twin = kk.paged_attention(b.query, cache, meta, **feats, backend="torch")
    _compare(native, twin, dtype)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_quantized_decode_tiles_match_twin(fmt, block_size, gen, path):
    """bf16 decode over int8 / fp8 caches: K tiles converted in registers, int8 scales read 16
    at a time when a tile's keys fill one block (block size 16 / 32 and contexts that end
    mid-block) and key by key when a tile spans blocks (block size 8)."""
    b = make_batch(gen, [(37, 1), (160, 1), (15, 1), (250, 1)], block_size=block_size,
                   num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # fmt: skip
    cache = _quantized(b, fmt)
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, block_size)
    native = kk.paged_attention(b.query, cache, meta, scale=0.125, backend="cpu")
    twin = kk.paged_attention(b.query, cache, meta, scale=0.125, backend="torch")
    _compare(native, twin, torch.bfloat16)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    heads=st.sampled_from([(3, 3), (9, 3), (8, 2), (16, 2), (6, 1)]),
    head_dim=st.sampled_from([64, 128, 256]),
    block_size=st.sampled_from([8, 16, 32, 64]),
    ctx=st.lists(st.integers(0, 700), min_size=1, max_size=5),
    ntok=st.sampled_from([1, 1, 2]),
    window=st.one_of(st.none(), st.integers(1, 300)),
    soft_cap=st.one_of(st.none(), st.floats(1.0, 30.0)),
    alibi=st.booleans(),
    split_keys=st.sampled_from([None, 48]),
    isa=st.sampled_from(["auto", "novnni", "tileloop"]),
    fmt=st.sampled_from(["int8", "fp8_e4m3", "fp8_e5m2"]),
    fuse_heads=st.sampled_from([None, False, True]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantized_decode_matches_twin_on_both_avx512_paths(
    heads, head_dim, block_size, ctx, ntok, window, soft_cap, alibi, split_keys, isa, fmt,
    fuse_heads, seed, monkeypatch,
):  # fmt: skip
    """bf16 decode over an int8 / fp8 cache, few query rows per KV head: with AVX-512 VNNI and
    VBMI (``isa="auto"``) int8 scores and P.V are integer dot products of the codes (up to 8
    rows) and fp8 codes become bf16 by a shift and a mask, flushing subnormal codes (up to 4
    rows); without them (``"novnni"``) the codes are widened; both against the twin, every
    feature, forced splits, a task per KV head or per item (``fuse_heads``; None: the
    default)."""
    feats = cpu_native.features()
    if not (feats.get("avx512") and feats.get("avx512_bf16")):
        pytest.skip("no AVX-512 BF16 path on this CPU")
    monkeypatch.setattr(cpu_native.OPTIONS, "isa", isa)
    monkeypatch.setattr(cpu_native.OPTIONS, "split_keys", split_keys)
    monkeypatch.setattr(cpu_native.OPTIONS, "fuse_heads", fuse_heads)
    gen = torch.Generator().manual_seed(seed)
    b = make_batch(gen, [(c, ntok) for c in ctx], block_size=block_size, num_q_heads=heads[0],
                   num_kv_heads=heads[1], head_dim=head_dim, dtype=torch.bfloat16)  # fmt: skip
    cache = _quantized(b, fmt)
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, block_size)
    draw = {"window": window, "soft_cap": soft_cap, "alibi": alibi, "seed": seed}
    options = _features(b, draw)
    out = torch.full_like(b.query, float("nan"))
    native = kk.paged_attention(b.query, cache, meta, **options, backend="cpu", out=out)
    twin = kk.paged_attention(b.query, cache, meta, **options, backend="torch")
    _compare(native, twin, torch.bfloat16)


def _bf16_decode_batch(heads, head_dim, block_size, ctx, window, soft_cap, release, seed):
    """A bf16 decode batch (one query token per request of context ``ctx[i]``), its plan (with
    block 1 of long enough requests released, where ``release``) and attention options."""
    gen = torch.Generator().manual_seed(seed)
    b = make_batch(gen, [(c, 1) for c in ctx], block_size=block_size, num_q_heads=heads[0],
                   num_kv_heads=heads[1], head_dim=head_dim, dtype=torch.bfloat16)  # fmt: skip
    table = b.block_table.clone()
    if release:
        for r, c in enumerate(ctx):
            if (c + 1) // block_size >= 3:
                table[r, 1] = 0  # a released block inside the sequence
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, table, block_size)
    draw = {"window": window, "soft_cap": soft_cap, "alibi": False, "seed": seed}
    return b, meta, _features(b, draw)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    heads=st.sampled_from([(3, 3), (9, 3), (8, 2), (12, 4), (16, 1), (32, 2), (17, 1)]),
    head_dim=st.sampled_from([32, 64, 96, 128, 48]),
    block_size=st.sampled_from([8, 12, 16, 32, 64]),
    ctx=st.lists(st.integers(0, 700), min_size=1, max_size=5),
    window=st.one_of(st.none(), st.integers(1, 300)),
    soft_cap=st.one_of(st.none(), st.floats(1.0, 30.0)),
    split_keys=st.sampled_from([None, 16, 48]),
    release=st.booleans(),
    isa=st.sampled_from(["auto", "nodec", "onepass", "tileloop"]),
    fuse_heads=st.sampled_from([None, True]),
    seed=st.integers(0, 2**31 - 1),
)
def test_bf16_decode_on_amx_tiles_matches_twin(
    heads, head_dim, block_size, ctx, window, soft_cap, split_keys, release, isa, fuse_heads,
    seed, monkeypatch,
):  # fmt: skip
    """bf16 decode (one query token per request) over a bf16 cache: on a CPU with AMX
    (``isa="auto"``) the scores of a KV head's query rows (up to 16) are tile products over K
    rows read in place, the softmax takes two passes (``dec_amx.rs``); ``"nodec"`` runs the
    two-pass decode off AMX (on AVX-512 BF16, up to 4 rows per KV head: scores of every tile
    first, then one softmax and P.V, ``dec_lean.rs``; ``"tileloop"`` the same inside the tile
    loop, ``two_pass`` in ``attend.rs``); ``"onepass"`` the tile loop's online softmax; rows over
    16 (GQA 17/1) and head dim 48 fall back to it. Against the
    twin: tiles across blocks (block size 8, 12), partial tiles, windows, soft-capping, forced
    splits (the partial path), released blocks (never read: the null block is NaN)."""
    monkeypatch.setattr(cpu_native.OPTIONS, "isa", isa)
    monkeypatch.setattr(cpu_native.OPTIONS, "split_keys", split_keys)
    monkeypatch.setattr(cpu_native.OPTIONS, "fuse_heads", fuse_heads)
    b, meta, options = _bf16_decode_batch(heads, head_dim, block_size, ctx, window, soft_cap,
                                          release, seed)  # fmt: skip
    out = torch.full_like(b.query, float("nan"))
    native = kk.paged_attention(b.query, b.kv_cache, meta, **options, backend="cpu", out=out)
    twin = kk.paged_attention(b.query, b.kv_cache, meta, **options, backend="torch")
    _compare(native, twin, torch.bfloat16)


def _two_pass_off_amx() -> bool:
    feats = cpu_native.features()
    return bool(feats.get("avx512") and feats["avx512_bf16"] and not feats["amx"])


@pytest.mark.skipif(
    not _two_pass_off_amx(),
    reason="needs AVX-512 BF16 without AMX (where AMX is, `tileloop` runs AMX's decode)",
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    heads=st.sampled_from([(3, 3), (9, 3), (8, 2), (12, 4), (4, 4), (6, 1)]),
    head_dim=st.sampled_from([32, 64, 96, 128]),
    block_size=st.sampled_from([8, 12, 16, 32, 64]),
    ctx=st.lists(st.integers(0, 1200), min_size=1, max_size=5),
    window=st.one_of(st.none(), st.integers(1, 300)),
    soft_cap=st.one_of(st.none(), st.floats(1.0, 30.0)),
    split_keys=st.sampled_from([None, 16, 48, 4096]),
    release=st.booleans(),
    fuse_heads=st.sampled_from([None, True, False]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_lean_bf16_decode_is_bit_identical_to_the_tile_loop(
    heads, head_dim, block_size, ctx, window, soft_cap, split_keys, release, fuse_heads, threads,
    seed, monkeypatch,
):  # fmt: skip
    """``dec_lean.rs`` (the default bf16 decode off AMX) runs the tile loop's two passes
    (``isa="tileloop"``) without its bookkeeping: the same products, softmax and P.V in the same
    order, so the same bits, over segments of more than 32 tiles (contexts to 1,200), tiles
    across blocks (block size 8, 12), partial tiles, windows (masked tiles kept out of a
    segment), soft-capping, splits, released blocks, tasks of one or all KV heads and 1-2
    threads. (On a CPU with AMX both switches would run AMX's decode; the twin test above
    covers the lean path there with ``nodec``.)"""
    _lean_vs_tile_loop(heads, head_dim, block_size, ctx, window, soft_cap, split_keys, release,
                       fuse_heads, threads, seed, monkeypatch)  # fmt: skip


@pytest.mark.skipif(not _two_pass_off_amx(), reason="needs AVX-512 BF16 without AMX")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("block_size", "window", "soft_cap", "release"),
    [(16, None, None, False), (12, None, 5.0, True), (32, 700, None, False), (8, 900, 20.0, True)],
)
def test_lean_bf16_decode_is_bit_identical_over_many_segments(
    block_size, window, soft_cap, release, threads, monkeypatch
):
    """Items of more than one segment (32 kept tiles: 512 keys), unsplit: the running max,
    sum and accumulator rescaled between segments as the tile loop does, bit for bit."""
    _lean_vs_tile_loop((9, 3), 64, block_size, [1300, 700, 513, 40], window, soft_cap, 4096,
                       release, None, threads, 7, monkeypatch)  # fmt: skip


def _quant_lean() -> bool:
    feats = cpu_native.features()
    return bool(_two_pass_off_amx() and feats.get("avx512_vnni"))


@pytest.mark.skipif(not _quant_lean(), reason="needs AVX-512 BF16, VNNI and VBMI without AMX")
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    heads=st.sampled_from([(3, 3), (9, 3), (8, 2), (12, 4), (16, 2), (6, 1)]),
    head_dim=st.sampled_from([64, 128, 256]),
    block_size=st.sampled_from([8, 12, 16, 32, 64]),
    ctx=st.lists(st.integers(0, 1300), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(1, 700)),
    soft_cap=st.one_of(st.none(), st.floats(1.0, 30.0)),
    split_keys=st.sampled_from([None, 16, 48, 4096]),
    release=st.booleans(),
    fmt=st.sampled_from(["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_tensor"]),
    fuse_heads=st.sampled_from([None, True, False]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_lean_quantized_decode_matches_the_twin_and_the_tile_loop(
    heads, head_dim, block_size, ctx, window, soft_cap, split_keys, release, fmt, fuse_heads,
    threads, seed, monkeypatch,
):  # fmt: skip
    """int8 and fp8 decode on ``dec_lean.rs`` (the default off AMX with VNNI / VBMI: int8 up to
    8 rows per KV head, fp8 up to 4, else the tile loop): two passes per segment of 32 kept
    tiles, ``vnni.rs``'s dot products, against the twin and the tile loop's one-pass online
    softmax (``isa="tileloop"``; the two agree to rounding, not bit for bit): contexts to
    1,300 (items of several segments), tiles across blocks (block size 8, 12), windows,
    soft-capping, splits, released blocks (block 0 filled with NaN codes and scales: never
    read), per-head and per-tensor fp8 scales, tasks of one or all KV heads, 1-2 threads."""
    monkeypatch.setattr(cpu_native.OPTIONS, "split_keys", split_keys)
    monkeypatch.setattr(cpu_native.OPTIONS, "fuse_heads", fuse_heads)
    b, meta, options = _bf16_decode_batch(heads, head_dim, block_size, ctx, window, soft_cap,
                                          release, seed)  # fmt: skip
    cache = _quantized(b, fmt)
    cache.buffer[0] = 255  # the null block: int8 scales and e4m3 / e5m2 codes all NaN
    outs = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for isa in ("tileloop", "auto"):
            monkeypatch.setattr(cpu_native.OPTIONS, "isa", isa)
            out = torch.full_like(b.query, float("nan"))
            outs[isa] = kk.paged_attention(b.query, cache, meta, **options, backend="cpu",
                                           out=out)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    twin = kk.paged_attention(b.query, cache, meta, **options, backend="torch")
    _compare(outs["auto"], twin, torch.bfloat16)
    _compare(outs["auto"], outs["tileloop"], torch.bfloat16)


def _lean_vs_tile_loop(heads, head_dim, block_size, ctx, window, soft_cap, split_keys, release,
                       fuse_heads, threads, seed, monkeypatch):  # fmt: skip
    monkeypatch.setattr(cpu_native.OPTIONS, "split_keys", split_keys)
    monkeypatch.setattr(cpu_native.OPTIONS, "fuse_heads", fuse_heads)
    b, meta, options = _bf16_decode_batch(heads, head_dim, block_size, ctx, window, soft_cap,
                                          release, seed)  # fmt: skip
    outs = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for isa in ("tileloop", "auto"):
            monkeypatch.setattr(cpu_native.OPTIONS, "isa", isa)
            out = torch.full_like(b.query, float("nan"))
            outs.append(kk.paged_attention(b.query, b.kv_cache, meta, **options, backend="cpu",
                                           out=out))  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())


@pytest.mark.parametrize("fuse_heads", [False, True])
@pytest.mark.parametrize("mode", ["single", "omp", "rayon"])
def test_thread_modes_and_splits_agree(mode, fuse_heads, monkeypatch, gen):
    """Batch 1 over a long context splits the key range; every thread mode (and tasks of one
    or of all KV heads) gives one answer."""
    monkeypatch.setattr(cpu_native.OPTIONS, "mode", mode)
    monkeypatch.setattr(cpu_native.OPTIONS, "fuse_heads", fuse_heads)
    b = make_batch(gen, [(3000, 1), (0, 1), (700, 3)], block_size=16, num_q_heads=8,
                   num_kv_heads=2, head_dim=64, dtype=torch.float32)  # fmt: skip
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.125, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    twin = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.125, backend="torch")
    _compare(native, twin, torch.float32)


@pytest.mark.parametrize(
    ("q_lens", "threads", "tokens"),
    [([256], 1, [64] * 4), ([256], 2, [64] * 4), ([64], 2, [64]), ([100], 2, [64, 36]),
     ([1, 70], 1, [1, 64, 6])],
)  # fmt: skip
def test_prefill_chunks_are_cut_into_items_of_prefill_item_rows(q_lens, threads, tokens, gen):
    """A prefill chunk is cut into items of ``PREFILL_ITEM_ROWS`` query rows (64 tokens at GQA
    9/3) and a last short one, whatever the thread count; every token is in one item."""
    b = make_batch(gen, [(5, n) for n in q_lens], block_size=16, num_q_heads=9, num_kv_heads=3,
                   head_dim=64, dtype=torch.bfloat16)  # fmt: skip
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 16)
    work = cpu_native.work_for(meta, None, 3, 3, 64, threads, fuse=False).work
    assert sorted(work[:, 2].tolist()) == sorted(tokens)
    assert cpu_native.PREFILL_ITEM_ROWS // 3 == 64


@pytest.mark.parametrize("window", [None, 40])
def test_released_blocks_get_no_weight_and_are_not_read(window, gen, path):
    """Null entries inside a sequence (retention): the twin's answer, the null block unread."""
    b = make_batch(gen, [(200, 1), (90, 5), (130, 2)], block_size=16, num_q_heads=4,
                   num_kv_heads=2, head_dim=32, dtype=torch.float32)  # fmt: skip
    table = b.block_table.clone()
    table[0, [1, 2, 5]] = 0
    table[2, 0] = 0
    b.kv_cache[0] = float("nan")  # the null block: reading it would poison the output
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, table, 16)
    assert meta.num_released == 4
    native = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.2, sliding_window=window,
                                backend="cpu")  # fmt: skip
    twin = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.2, sliding_window=window,
                              backend="torch")  # fmt: skip
    _compare(native, twin, torch.float32)


def test_auto_picks_the_native_kernel_on_cpu_and_the_twin_for_block_mass(gen, monkeypatch):
    b = make_batch(gen, [(20, 1), (0, 6)], block_size=8, num_q_heads=4, num_kv_heads=2,
                   head_dim=32, dtype=torch.float32)  # fmt: skip
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 8)
    calls = []
    real = attention_cpu.paged_attention_cpu
    monkeypatch.setattr(
        attention_cpu, "paged_attention_cpu", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    kk.paged_attention(b.query, b.kv_cache, meta, scale=0.3)
    assert calls == [1]
    mass = torch.zeros(meta.block_table.shape, dtype=torch.float32)
    kk.paged_attention(b.query, b.kv_cache, meta, scale=0.3, block_mass=mass)
    kk.paged_attention(b.query, b.kv_cache, meta, scale=0.3, backend="cpu", block_mass=mass)
    kk.paged_attention(b.query, b.kv_cache, meta, scale=0.3, backend="torch")
    assert calls == [1], "block_mass and backend='torch' must run the twin"
    assert mass.sum() > 0


def test_cpu_backend_is_refused_for_cuda_tensors():
    from kvcore_kernels.cache import check_backend

    with pytest.raises(kk.KernelConfigError):
        check_backend("cpu", torch.device("cuda", 0))
    assert check_backend("cpu", torch.device("cpu")) == "cpu"


def test_heads_fuse_by_default_off_avx512_for_wide_elements_and_on_vnni_for_bytes(monkeypatch):
    """Defaults by path: the AVX2 path fuses every format; AVX-512 fuses bf16 where the
    two-pass decode runs (AVX-512 BF16 and no AMX decode, not ``onepass``), int8 / fp8 where
    its VNNI / VBMI decode runs, and nothing else."""
    opts = cpu_native.OPTIONS
    monkeypatch.setattr(opts, "fuse_heads", None)
    monkeypatch.setattr(opts, "isa", "avx2")
    avx2 = cpu_native.features()["avx2"]
    assert cpu_native.fuse_heads_for(cpu_native.FMT_BF16)
    assert cpu_native.fuse_heads_for(cpu_native.FMT_F32)
    # the AVX2 path fuses int8 / fp8 too, whatever the query's dtype
    for fmt in (cpu_native.FMT_INT8, cpu_native.FMT_E4M3, cpu_native.FMT_E5M2):
        for qdt in (None, torch.bfloat16, torch.float32):
            assert cpu_native.fuse_heads_for(fmt, qdt) == avx2
    monkeypatch.setattr(opts, "portable", True)
    assert not cpu_native.fuse_heads_for(cpu_native.FMT_INT8)
    monkeypatch.setattr(opts, "portable", False)
    monkeypatch.setattr(opts, "isa", "auto")
    feats = cpu_native.features()
    avx512 = feats["avx512"]
    two_pass = avx512 and feats["avx512_bf16"] and not feats["amx"]
    assert cpu_native.fuse_heads_for(cpu_native.FMT_BF16) == (not avx512 or two_pass)
    assert not cpu_native.fuse_heads_for(cpu_native.FMT_F32) or not avx512
    assert not cpu_native.fuse_heads_for(cpu_native.FMT_F16) or not avx512
    # AMX's decode off: the two-pass decode wherever AVX-512 BF16 is; one pass: never
    for isa in ("noamx", "nodec"):
        monkeypatch.setattr(opts, "isa", isa)
        want = not avx512 or bool(feats["avx512_bf16"])
        assert cpu_native.fuse_heads_for(cpu_native.FMT_BF16) == want
    monkeypatch.setattr(opts, "isa", "tileloop")  # the same two passes inside the tile loop
    assert cpu_native.fuse_heads_for(cpu_native.FMT_BF16) == (not avx512 or two_pass)
    monkeypatch.setattr(opts, "isa", "onepass")
    assert cpu_native.fuse_heads_for(cpu_native.FMT_BF16) == (not avx512)
    monkeypatch.setattr(opts, "isa", "auto")
    # int8 / fp8 on AVX-512: fused where the VNNI / VBMI decode runs (bf16 queries), not on the
    # widening path; without AVX-512, the AVX2 path's rule above
    vnni = cpu_native.features()["avx512_vnni"] and cpu_native.features()["avx512_bf16"]
    for fmt in (cpu_native.FMT_INT8, cpu_native.FMT_E4M3, cpu_native.FMT_E5M2):
        want_bf16 = (avx512 and vnni) or (not avx512 and avx2)
        assert cpu_native.fuse_heads_for(fmt, torch.bfloat16) == want_bf16
        assert cpu_native.fuse_heads_for(fmt, torch.float32) == (not avx512 and avx2)
    monkeypatch.setattr(opts, "isa", "novnni")
    assert cpu_native.fuse_heads_for(cpu_native.FMT_INT8, torch.bfloat16) == (not avx512 and avx2)
    # novnni keeps the AVX-512 path where the CPU has it (and its two-pass bf16 decode);
    # without AVX-512 it runs the AVX2 one
    assert cpu_native.fuse_heads_for(cpu_native.FMT_BF16) == (not avx512 or two_pass)
    monkeypatch.setattr(opts, "isa", "auto")
    monkeypatch.setattr(opts, "fuse_heads", False)  # KVCORE_NATIVE_FUSE_HEADS=0 wins
    assert not cpu_native.fuse_heads_for(cpu_native.FMT_BF16)
    assert not cpu_native.fuse_heads_for(cpu_native.FMT_INT8, torch.bfloat16)
    monkeypatch.setattr(opts, "fuse_heads", True)
    assert cpu_native.fuse_heads_for(cpu_native.FMT_INT8)


def test_an_unknown_instruction_set_is_refused(gen, monkeypatch):
    b = make_batch(gen, [(20, 1)], block_size=8, num_q_heads=4, num_kv_heads=2, head_dim=32,
                   dtype=torch.float32)  # fmt: skip
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 8)
    before = b.kv_cache.clone()
    monkeypatch.setattr(cpu_native.OPTIONS, "isa", "avx9")
    with pytest.raises(kk.KernelConfigError, match="KVCORE_NATIVE_ISA"):
        kk.paged_attention(b.query, b.kv_cache, meta, scale=0.3, backend="cpu")
    assert torch.equal(b.kv_cache.nan_to_num(), before.nan_to_num())


def test_odd_head_dim_falls_back_to_the_twin(gen):
    b = make_batch(gen, [(10, 2)], block_size=8, num_q_heads=2, num_kv_heads=1, head_dim=24,
                   dtype=torch.float32)  # fmt: skip
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 8)
    assert not attention_cpu.supports(b.kv_cache)
    native = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.3, backend="cpu")
    twin = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.3, backend="torch")
    assert torch.equal(native, twin)


@st.composite
def shared_prefix_batches(draw):
    """Decode requests whose block tables start with the same blocks (the radix cache's shared
    prefix), some sharing fewer blocks than the rest, with prefill requests around them."""
    bs = draw(st.sampled_from(BLOCK_SIZES))
    prefix = draw(st.integers(1, max(1, 256 // bs)))  # shared blocks
    n = draw(st.integers(2, 24))
    own = draw(st.lists(st.integers(1, 70), min_size=n, max_size=n))  # tokens after the prefix
    # blocks each request shares with the first (a few diverge early)
    shares = draw(st.lists(st.integers(0, prefix), min_size=n, max_size=n))
    shares = [prefix if draw(st.booleans()) else s for s in shares]
    before = draw(st.sampled_from([[], [(0, 9)], [(40, 3)]]))  # a prefill request first
    after = draw(st.sampled_from([[], [(100, 17)]]))
    hq, hk = draw(st.sampled_from(HEADS))
    return {
        "bs": bs, "prefix": prefix, "shares": shares, "before": before,
        "reqs": before + [(prefix * bs + o - 1, 1) for o in own] + after,
        "num_q_heads": hq, "num_kv_heads": hk,
        "head_dim": draw(st.sampled_from([16, 64, 128])),
        "dtype": draw(st.sampled_from(list(TOL))),
        "fmt": draw(st.sampled_from([None, None, "int8", "fp8_e4m3"])),
        "window": draw(st.sampled_from([None, None, None, 50])),
        "soft_cap": draw(st.sampled_from([None, None, 20.0])),
        "alibi": draw(st.sampled_from([False, False, False, True])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }  # fmt: skip


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(draw=shared_prefix_batches())
def test_cascade_over_a_shared_prefix_matches_twin(draw, path, monkeypatch):
    """Decode requests sharing cached blocks read them once (one cascade item per run of up to
    ITEM_ROWS rows) and merge with their own keys: the twin's answer, every row written."""
    monkeypatch.setattr(cpu_native.OPTIONS, "fuse_heads", draw["seed"] % 2 == 0)
    gen = torch.Generator().manual_seed(draw["seed"])
    dtype, bs, hk = draw["dtype"], draw["bs"], draw["num_kv_heads"]
    b = make_batch(gen, draw["reqs"], block_size=bs, num_q_heads=draw["num_q_heads"],
                   num_kv_heads=hk, head_dim=draw["head_dim"], dtype=dtype)  # fmt: skip
    table = b.block_table.clone()
    lead = len(draw["before"])
    for k, s in enumerate(draw["shares"]):
        table[lead + k, :s] = table[lead, :s]
    cache = _quantized(b, draw["fmt"]) if draw["fmt"] else b.kv_cache
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, table, bs)
    feats = _features(b, draw)
    out = torch.full_like(b.query, float("nan"))
    native = kk.paged_attention(b.query, cache, meta, **feats, backend="cpu", out=out)
    twin = kk.paged_attention(b.query, cache, meta, **feats, backend="torch")
    _compare(native, twin, dtype)
    work = cpu_native.work_for(meta, draw["window"], hk, draw["num_q_heads"] // hk,
                               draw["head_dim"], torch.get_num_threads(),
                               alibi=draw["alibi"])  # fmt: skip
    if draw["window"] or draw["alibi"]:
        assert work.cascade_requests == 0
    elif draw["prefix"] * bs >= cpu_native.MIN_CASCADE_KEYS and all(
        s == draw["prefix"] for s in draw["shares"]
    ):
        assert work.cascade_requests == len(draw["shares"])  # every decode request
    else:
        assert work.cascade_requests <= len(draw["shares"])


def test_cascade_switch_gives_the_same_answer(gen, monkeypatch):
    """48 decode requests over one 512-token prefix (the offline bench's shared job): the
    cascade on and off agree with each other and with the twin."""
    b = make_batch(gen, [(512 + 40 + r, 1) for r in range(48)], block_size=16, num_q_heads=9,
                   num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)  # fmt: skip
    table = b.block_table.clone()
    table[:, :32] = table[0, :32]
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, table, 16)
    on = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.125, backend="cpu")
    assert cpu_native.work_for(meta, None, 3, 3, 64, torch.get_num_threads()).cascade_requests == 48
    monkeypatch.setattr(cpu_native.OPTIONS, "cascade", False)
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, table, 16)
    off = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.125, backend="cpu")
    assert cpu_native.work_for(meta, None, 3, 3, 64, torch.get_num_threads()).cascade_requests == 0
    twin = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.125, backend="torch")
    _compare(on, twin, torch.bfloat16)
    _compare(off, twin, torch.bfloat16)


@pytest.mark.parametrize("heads", [(9, 3), (6, 1), (4, 4)])
@pytest.mark.parametrize("fmt", [None, "int8", "fp8_e4m3"])
@pytest.mark.parametrize("feature", ["plain", "window", "soft_cap", "alibi"])
def test_prefill_row_blocks_match_twin(heads, fmt, feature, gen, path):
    """bf16 prefill chunks with >= 16 rows per KV head take the transposed path (blocks of 16
    rows, a partial last block, queries starting mid-block, causal tiles cut by the diagonal,
    a chunk cut into several items of ``PREFILL_ITEM_ROWS`` rows and a last short one) on
    AVX-512 BF16: the twin's answer with every feature and quantized format."""
    hq, hk = heads
    dtype, bs, d = torch.bfloat16, 16, 64
    b = make_batch(gen, [(70, 37), (0, 1), (5, 23), (300, 1), (9, 211)], block_size=bs,
                   num_q_heads=hq, num_kv_heads=hk, head_dim=d, dtype=dtype)  # fmt: skip
    cache = _quantized(b, fmt) if fmt else b.kv_cache
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, bs)
    feats = {
        "scale": d**-0.5,
        "sliding_window": 29 if feature == "window" else None,
        "soft_cap": 5.0 if feature == "soft_cap" else None,
        "alibi_slopes": torch.rand(hq, generator=gen) * 0.3 if feature == "alibi" else None,
    }
    out = torch.full_like(b.query, float("nan"))
    native = kk.paged_attention(b.query, cache, meta, **feats, backend="cpu", out=out)
    twin = kk.paged_attention(b.query, cache, meta, **feats, backend="torch")
    _compare(native, twin, dtype)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("feature", ["plain", "window", "soft_cap", "split"])
def test_long_prefill_key_segments_match_twin(head_dim, feature, gen, path, monkeypatch):
    """bf16 prefill over key ranges of several 256-key segments (on AMX: ``cols::head_seg``,
    the keys gathered once per head, an online rescale between segments; odd tile counts leave
    the last 32-key chunk half empty; a window starts a row's keys past the item's first; a
    key split gives items whose range starts mid-sequence): the twin's answer, on every path."""
    if feature == "split":
        monkeypatch.setattr(cpu_native.OPTIONS, "split_keys", 304)
    b = make_batch(gen, [(600, 41), (0, 300), (333, 1), (17, 530)], block_size=16,
                   num_q_heads=6, num_kv_heads=2, head_dim=head_dim,
                   dtype=torch.bfloat16)  # fmt: skip
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, 16)
    feats = {
        "scale": head_dim**-0.5,
        "sliding_window": 300 if feature == "window" else None,
        "soft_cap": 8.0 if feature == "soft_cap" else None,
    }
    out = torch.full_like(b.query, float("nan"))
    native = kk.paged_attention(b.query, b.kv_cache, meta, **feats, backend="cpu", out=out)
    twin = kk.paged_attention(b.query, b.kv_cache, meta, **feats, backend="torch")
    _compare(native, twin, torch.bfloat16)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_subnormal_codes_count_on_every_path(fmt, gen, path):
    """fp8 codes over a wide range of magnitudes, over a tenth subnormal: AVX2 reads every
    code raw (its bits shifted into an fp32, the 2^bias factor moved onto the query, P and the
    output), so subnormal codes keep their values on the decode (scores from K rows in place)
    and prefill paths alike; fp32 queries, held to fp32's bound against the twin. A prefill of
    24 tokens has tiles that few of its rows see (P.V row by row) and tiles that all see."""
    bs, hk, d = 16, 3, 64
    b = make_batch(gen, [(200, 1), (37, 24), (0, 1), (300, 1)], block_size=bs, num_q_heads=9,
                   num_kv_heads=hk, head_dim=d, dtype=torch.float32)  # fmt: skip
    nb = b.kv_cache.shape[0]
    # |x| spread over 10^-4 .. 1 (E4M3's subnormals hold 2^-9 .. 2^-6) or 10^-3 .. 1 scaled
    # by 1/1000 (E5M2's: 2^-16 .. 2^-14)
    low, scale = (-3.0, 1000.0) if fmt == "fp8_e5m2" else (-4.0, 1.0)
    keys = [k * 10 ** (low * torch.rand(k.shape, generator=gen)) for k in b.keys]
    values = [v * 10 ** (low * torch.rand(v.shape, generator=gen)) for v in b.values]
    cache = _quantized(b, fmt, keys=keys, values=values, fp8_scales=scale)
    codes = cache.views["data"].view(torch.uint8)
    exp_mask, man_mask = (0x78, 0x07) if fmt == "fp8_e4m3" else (0x7C, 0x03)
    real = torch.zeros(nb, bs, dtype=torch.bool)
    real.view(-1)[_slots(b)] = True
    live = codes.permute(0, 2, 1, 3, 4)[real]
    subnormal = ((live & exp_mask) == 0) & ((live & man_mask) != 0)
    assert subnormal.float().mean() > 0.1
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, bs)
    native = kk.paged_attention(b.query, cache, meta, scale=d**-0.5, backend="cpu")
    twin = kk.paged_attention(b.query, cache, meta, scale=d**-0.5, backend="torch")
    _compare(native, twin, torch.float32)
    # the subnormal codes matter: read as zero, the answer moves past the bound
    flushed = codes.clone()
    flushed[(flushed & exp_mask) == 0] &= 0x80
    zeroed = dataclasses.replace(cache, views={"data": flushed.view(codes.dtype)})
    other = kk.paged_attention(b.query, zeroed, meta, scale=d**-0.5, backend="torch")
    assert (other - twin).abs().max() > 10 * TOL[torch.float32]


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_rotates_the_query_of_a_rotated_cache(fmt, dtype, gen, path, monkeypatch):
    """A cache storing K rotated (``rotate="k"``): the native kernel takes the query in the
    model's basis and rotates it once per call, before the items (decode, prefill rows on the
    transposed path, fused and per-head tasks); the answer is the twin's (which rotates the
    query by a torch matmul), the query tensor is left as it was, and ``rotate_in`` is no
    longer called."""
    bs, d = 16, 64
    b = make_batch(gen, [(70, 37), (0, 1), (300, 1), (9, 40)], block_size=bs, num_q_heads=9,
                   num_kv_heads=3, head_dim=d, dtype=dtype)  # fmt: skip
    cache = _quantized(b, fmt, rotate="k")
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, b.block_table, bs)
    query = b.query.clone()
    twin = kk.paged_attention(query, cache, meta, scale=d**-0.5, backend="torch")
    calls = []
    rotate_in = type(cache).rotate_in

    def counted(self, x, which):
        calls.append(which)
        return rotate_in(self, x, which)

    monkeypatch.setattr(type(cache), "rotate_in", counted)
    native = kk.paged_attention(query, cache, meta, scale=d**-0.5, backend="cpu")
    assert torch.equal(query, b.query)
    assert calls == []
    _compare(native, twin, dtype)
    # the same bytes read as unrotated K give another answer: the rotation is what agrees
    unrotated = dataclasses.replace(cache, rotate="")
    other = kk.paged_attention(query, unrotated, meta, scale=d**-0.5, backend="cpu")
    assert (other.float() - twin.float()).abs().max() > 10 * TOL[dtype]


def test_cascade_stops_at_a_released_block_and_at_the_last_token(gen):
    """A null (released) entry ends the shared run; a block holding a request's last token is
    never part of it; the answer stays the twin's."""
    bs = 16
    b = make_batch(gen, [(200, 1), (200, 1), (200, 1), (150, 1)], block_size=bs, num_q_heads=4,
                   num_kv_heads=2, head_dim=32, dtype=torch.float32)  # fmt: skip
    table = b.block_table.clone()
    table[1:, :13] = table[0, :13]  # request 3's last token (position 150) sits in block 9
    table[:, 6] = 0  # released for everyone: shared keys end at block 6
    b.kv_cache[0] = float("nan")
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, table, bs)
    runs = cpu_native._shared_runs(meta, np.diff(meta.host_query_start_loc), 48, 2)
    assert runs == [(0, 4, 6 * bs)]
    assert cpu_native._shared_runs(meta, np.diff(meta.host_query_start_loc), 3, 2) == [
        (0, 2, 6 * bs),
        (2, 2, 6 * bs),
    ]  # two even groups
    assert cpu_native._shared_runs(meta, np.diff(meta.host_query_start_loc), 48, 5) == []
    native = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.2, backend="cpu")
    twin = kk.paged_attention(b.query, b.kv_cache, meta, scale=0.2, backend="torch")
    _compare(native, twin, torch.float32)
    table[:, 6] = b.block_table[0, 6]  # no release: the run is cut by request 3's last token
    meta = kk.plan_attention(b.query_start_loc, b.seq_lens, table, bs)
    runs = cpu_native._shared_runs(meta, np.diff(meta.host_query_start_loc), 48, 2)
    assert runs == [(0, 4, (150 // bs) * bs)]
