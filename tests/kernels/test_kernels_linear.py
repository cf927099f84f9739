"""The native small-batch bf16 linear (``kvcore_kernels.linear_cpu``) against a float64
reference: each output within one bf16 rounding of the exact sum (plus the fp32 sum's own error),
on AVX-512 BF16 and the portable path, for hypothesis-drawn shapes (ragged last panel, bias or
not, strided rows); each row's bits independent of the batch it runs in and of the thread mode;
gated packs (``silu(gate) * up``) with the bits of the plain product followed by
``ops_cpu.silu_and_mul``; and what it refuses, with nothing written."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_kernels import cpu_native, linear_cpu, ops_cpu
from kvcore_kernels.errors import KernelConfigError

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native extension not built")

PATHS = pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])


@contextlib.contextmanager
def _options(**kw):
    before = {k: getattr(cpu_native.OPTIONS, k) for k in kw}
    for k, v in kw.items():
        setattr(cpu_native.OPTIONS, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(cpu_native.OPTIONS, k, v)


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within one bf16 rounding (2^-8 relative) of the float64 result, plus the fp32 sum's
    error bound (K * 2^-23 of the sum of magnitudes)."""
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T + (0 if b is None else b.double())
    mag = x64.abs() @ w64.abs().T + (0 if b is None else b.double().abs())
    tol = want.abs() * 2**-8 + mag * x.shape[1] * 2**-23 + 1e-30
    diff = (got.double() - want).abs()
    assert bool((diff <= tol).all()), f"max excess {float((diff - tol).max())}"


@PATHS
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 40),
    n=st.integers(1, 130),
    k=st.integers(1, 160).map(lambda v: 2 * v),
    bias=st.booleans(),
    pad=st.integers(0, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_matches_float64_reference(portable, rows, n, k, bias, pad, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k + pad, generator=gen).bfloat16()[:, :k]  # row stride k + pad
    packed = linear_cpu.pack_linear(w)
    with _options(portable=portable):
        got = linear_cpu.linear(x, packed, b)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    _check(got, x, w, b)


@PATHS
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    i_out=st.integers(1, 100),
    k=st.integers(1, 120).map(lambda v: 2 * v),
    seed=st.integers(0, 2**31 - 1),
)
def test_gated_linear_is_the_plain_product_then_silu_and_mul(portable, rows, i_out, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(2 * i_out, k, generator=gen) * k**-0.5).bfloat16()  # [gate | up]
    x = torch.randn(rows, k, generator=gen).bfloat16()
    gated, plain = linear_cpu.pack_linear(w, glu=True), linear_cpu.pack_linear(w)
    # gate and up padded to whole panels each, then alternating
    assert gated.glu and gated.n_out == i_out and gated.nbytes == 2 * -(-i_out // 32) * k * 64
    # each path (AVX-512 BF16, AVX2, portable) gives the bits of its own plain product followed
    # by silu_and_mul (another path's plain product sums in another order)
    with _options(portable=portable):
        got = linear_cpu.linear(x, gated)
        want = ops_cpu.silu_and_mul(linear_cpu.linear(x, plain))
    assert got.shape == (rows, i_out) and torch.equal(got, want)
    # and against float64: silu(g) * u within the roundings of g, u, silu(g) and the product
    g, u = (x.double() @ w.double().T).split(i_out, dim=1)
    exact = torch.nn.functional.silu(g) * u
    mag = (x.double().abs() @ w.double().abs().T).split(i_out, dim=1)
    tol = exact.abs() * 2**-6 + (mag[0] * u.abs() + mag[1] * g.abs()) * 2**-7 + 1e-6
    assert bool(((got.double() - exact).abs() <= tol).all())


@pytest.mark.skipif(not linear_cpu.avx2_path(), reason="no AVX2 path here (the blocked GEMM)")
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(12, 300),
    n=st.integers(1, 130),
    k=st.integers(1, 400).map(lambda v: 2 * v),
    bias=st.booleans(),
    pad=st.integers(0, 5),
    mode=st.sampled_from(["omp", "rayon", "single"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_tall_rows_match_float64_and_the_small_row_bits(rows, n, k, bias, pad, mode, seed):
    """12 rows or more (``TALL_ROWS``) take the blocked AVX2 GEMM (``linear_cpu.tall_path()``):
    within the float64 bound, and the bits of the small-row panels (``OPTIONS.tall`` off), which sum
    each output in the same order, in every thread mode."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k + pad, generator=gen).bfloat16()[:, :k]
    packed = linear_cpu.pack_linear(w)
    with _options(mode=mode):
        got = linear_cpu.linear(x, packed, b)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_native.OPTIONS, "tall", False)
            assert not linear_cpu.tall_path()
            small = linear_cpu.linear(x, packed, b)
    _check(got, x, w, b)
    assert torch.equal(got, small)


@pytest.mark.skipif(not linear_cpu.avx2_path(), reason="no AVX2 path here (the blocked GEMM)")
@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(12, 200),
    i_out=st.integers(1, 100),
    k=st.integers(1, 300).map(lambda v: 2 * v),
    mode=st.sampled_from(["omp", "rayon", "single"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_tall_gated_is_the_plain_product_then_silu_and_mul(rows, i_out, k, mode, seed):
    """A gated pack on the blocked AVX2 GEMM (12 rows or more): the bits of the plain product
    on the same path followed by ``silu_and_mul``, and of the small-row path's gated call."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(2 * i_out, k, generator=gen) * k**-0.5).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    gated, plain = linear_cpu.pack_linear(w, glu=True), linear_cpu.pack_linear(w)
    with _options(mode=mode):
        got = linear_cpu.linear(x, gated)
        want = ops_cpu.silu_and_mul(linear_cpu.linear(x, plain))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_native.OPTIONS, "tall", False)
            small = linear_cpu.linear(x, gated)
    assert got.shape == (rows, i_out)
    assert torch.equal(got, want) and torch.equal(got, small)


@pytest.mark.skipif(not linear_cpu.amx_path(), reason="no AMX tiles for the kernel here")
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(linear_cpu.AMX_MIN_ROWS + 1, 130),
    n=st.integers(1, 100),
    k=st.integers(1, 12).map(lambda v: 32 * v),
    bias=st.booleans(),
    pad=st.integers(0, 5),
    mode=st.sampled_from(["omp", "rayon", "single"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_amx_tiles_match_float64_and_gate_the_same(rows, n, k, bias, pad, mode, seed):
    """Calls of more than ``AMX_MIN_ROWS`` rows on a CPU with AMX run on tiles (1-3 row tiles
    a group, a zero-padded last tile, a ragged last panel, strided rows): within the float64
    bound, and a gated pack gives the plain product followed by ``silu_and_mul``, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(2 * n, k, generator=gen) * k**-0.5).bfloat16()
    b = torch.randn(2 * n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k + pad, generator=gen).bfloat16()[:, :k]
    plain, gated = linear_cpu.pack_linear(w), linear_cpu.pack_linear(w, glu=True)
    with _options(mode=mode):
        got = linear_cpu.linear(x, plain, b)
        glu = linear_cpu.linear(x, gated)
        unbiased = linear_cpu.linear(x, plain)
    _check(got, x, w, b)
    assert torch.equal(glu, ops_cpu.silu_and_mul(unbiased))


@pytest.mark.parametrize("mode", ["omp", "rayon", "single"])
def test_rows_do_not_depend_on_the_batch_or_the_threads(gen, mode):
    """A row's bits are those it gets alone (one decode request or 64), in every thread mode.
    Where the kernel takes AMX tiles above ``AMX_MIN_ROWS`` rows (their sums run in another
    order), within each of its two paths: a call of up to 8 rows gives each row's bits alone,
    a longer one those of the whole batch."""
    w = torch.randn(200, 576, generator=gen).bfloat16()
    x = torch.randn(70, 576, generator=gen).bfloat16()
    packed = linear_cpu.pack_linear(w)
    full = linear_cpu.linear(x, packed)
    alone = torch.cat([linear_cpu.linear(x[i : i + 1], packed) for i in range(len(x))])
    amx = linear_cpu.amx_path()
    if not amx:
        assert torch.equal(alone, full)
    with _options(mode=mode):
        for lo, hi in [(0, 1), (3, 4), (5, 12), (0, 8), (60, 69), (9, 70), (0, 70)]:
            want = full if amx and hi - lo > linear_cpu.AMX_MIN_ROWS else alone
            assert torch.equal(linear_cpu.linear(x[lo:hi], packed), want[lo:hi])
    assert linear_cpu.linear(x[:0], packed).shape == (0, 200)
    # odd layouts are copied first: a transposed single row, broadcast rows, a column view
    col = x[:1].T.contiguous()  # [576, 1]
    assert torch.equal(linear_cpu.linear(col.T, packed), alone[:1])
    assert torch.equal(linear_cpu.linear(x[:1].expand(3, -1), packed), alone[:1].expand(3, -1))
    assert torch.equal(linear_cpu.linear(x.T.contiguous().T, packed), full)


@pytest.mark.parametrize("glu", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("mode", ["omp", "single"])
def test_many_rows_in_row_blocks_keep_each_rows_bits(gen, mode, glu):
    """A call of many rows runs in blocks of rows over pairs of panels (``linear.rs``'s
    ``row_blocks``; an odd panel count leaves a last task of one panel): every block size and
    thread count gives each row the bits it gets in a call of 8 rows (one block, one panel at a
    time), and the float64 reference holds (AMX tiles sum in another order: the reference
    only)."""
    k, n = 1536, 7 * 32 - 5  # ragged last panel; 7 panels (gated: 7 gate / up pairs)
    w = (torch.randn(2 * n if glu else n, k, generator=gen) * k**-0.5).bfloat16()
    packed = linear_cpu.pack_linear(w, glu=glu)
    for rows in (9, 25, 47, 48, 131, 333):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        with _options(mode=mode):
            full = linear_cpu.linear(x, packed)
        if not glu:
            _check(full, x, w, None)
        if linear_cpu.amx_path():
            continue
        eights = torch.cat([linear_cpu.linear(x[i : i + 8], packed) for i in range(0, rows, 8)])
        assert torch.equal(full, eights), rows


def test_smollm2_shapes_against_f_linear(gen):
    """SmolLM2's projections: the native result within one bf16 step of oneDNN's (``F.linear``),
    most outputs bit for bit."""
    for k, n in [(576, 960), (576, 576), (576, 3072), (1536, 576)]:
        w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
        x = torch.randn(48, k, generator=gen).bfloat16()
        got, want = linear_cpu.linear(x, linear_cpu.pack_linear(w)), linear_cpu.linear_torch(x, w)
        _check(got, x, w, None)
        assert float((got == want).float().mean()) > 0.9


def test_bad_input_is_refused_and_nothing_is_written(gen):
    w = torch.randn(40, 64, generator=gen).bfloat16()
    packed = linear_cpu.pack_linear(w)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    for bad in [
        lambda: linear_cpu.pack_linear(w.float()),
        lambda: linear_cpu.pack_linear(w[:, :63]),  # odd k
        lambda: linear_cpu.pack_linear(w[0]),
        lambda: linear_cpu.pack_linear(w[:0]),
        lambda: linear_cpu.linear(x.float(), packed),
        lambda: linear_cpu.linear(x[:, :62], packed),
        lambda: linear_cpu.linear(x[0], packed),
        lambda: linear_cpu.linear(x, packed, torch.zeros(39, dtype=torch.bfloat16)),
        lambda: linear_cpu.linear(x, packed, torch.zeros(40)),
        lambda: linear_cpu.pack_linear(w[:39], glu=True),  # odd rows: no [gate | up] halves
        lambda: linear_cpu.linear(
            x, linear_cpu.pack_linear(w, glu=True), torch.zeros(20, dtype=torch.bfloat16)
        ),
    ]:
        with pytest.raises(KernelConfigError):
            bad()
    before = packed.data.clone()
    assert torch.equal(linear_cpu.linear(x, packed), linear_cpu.linear(x, packed))
    assert torch.equal(packed.data, before)  # the packed weight is only read
    # the binding's own checks: a linear record (op 0) of x, x_stride, rows, k, w, n_out, bias,
    # out, out_stride, threads, mode, portable, glu, tall
    with pytest.raises(ValueError, match="even"):
        cpu_native._native.run_calls([(0, [0, 3, 1, 3, 0, 4, 0, 0, 4, 1, 0, 0, 0, 1], [])])
    with pytest.raises(ValueError, match="bias"):
        cpu_native._native.run_calls([(0, [0, 4, 1, 4, 0, 4, 8, 0, 4, 1, 0, 0, 1, 1], [])])
