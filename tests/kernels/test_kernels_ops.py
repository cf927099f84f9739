"""The native bf16 element-wise ops (``kvcore_kernels.ops_cpu``) against their torch twins:
rotary bit for bit, RMSNorm's residual sum bit for bit, and its output and SiLU-and-mul within
one bf16 step of their intermediate (``exp`` and the fp32 sum order may differ), on the CPU's best
path (AVX-512 or AVX2), AVX2 and the portable path, for hypothesis-drawn shapes, strided rows
and odd sizes; plus what the dispatcher refuses."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_kernels import cpu_native, ops_cpu
from kvcore_kernels.errors import KernelConfigError

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native extension not built")


# the best path of this CPU (AVX-512 or AVX2), at most AVX2, portable
PATHS = pytest.mark.parametrize("isa", ["auto", "avx2", "portable"])


@contextlib.contextmanager
def _path(isa: str):
    before = cpu_native.OPTIONS.portable, cpu_native.OPTIONS.isa
    cpu_native.OPTIONS.portable, cpu_native.OPTIONS.isa = False, isa
    try:
        yield
    finally:
        cpu_native.OPTIONS.portable, cpu_native.OPTIONS.isa = before


def _bf16(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, or apart by what one bf16 step of the intermediate (normalised value, SiLU) makes
    after the final product (relative 2^-6), on at most 1% of the elements (2 in a small
    tensor)."""
    assert got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    tol = want.float().abs() * 2**-6 + 1e-30
    assert bool((diff <= tol).all()), f"max diff {diff.max().item()}"
    assert int((got != want).sum()) <= max(2, want.numel() // 100)


SIZES = dict(rows=st.integers(0, 70), seed=st.integers(0, 2**31 - 1))


@PATHS
@settings(max_examples=25, deadline=None)
@given(
    width=st.sampled_from([16, 48, 576, 1024]),
    residual=st.booleans(),
    pad=st.integers(0, 3),
    **SIZES,
)
def test_rms_norm_matches_twin(isa, rows, seed, width, residual, pad):
    gen = torch.Generator().manual_seed(seed)
    # rows `pad * 16` elements apart beyond the width: strided views, as a slice of a wider buffer
    x = _bf16(gen, rows, width + 16 * pad, scale=3.0)[:, :width]
    res = _bf16(gen, rows, width + 16 * pad)[:, :width] if residual else None
    w = _bf16(gen, width)
    want, want_res = ops_cpu.rms_norm_torch(x, res, w, 1e-6)
    buf = torch.zeros(rows, width + 16 * pad, dtype=torch.bfloat16)
    buf[:, :width] = x
    x2 = buf[:, :width]  # the same values, rows as far apart as x's
    res2 = None if res is None else res.clone()
    with _path(isa):
        got, got_res = ops_cpu.rms_norm(x2, res2, w, 1e-6, backend="cpu")
    _close_bf16(got, want)
    if residual:
        assert torch.equal(got_res, want_res)
        assert got.data_ptr() == x2.data_ptr() and got_res.data_ptr() == res2.data_ptr()
    else:
        assert got_res is None and torch.equal(x2, x)  # the input is left alone


@PATHS
@settings(max_examples=25, deadline=None)
@given(inter=st.sampled_from([16, 64, 1536]), **SIZES)
def test_silu_and_mul_matches_twin(isa, rows, seed, inter):
    gen = torch.Generator().manual_seed(seed)
    gate_up = _bf16(gen, rows, 2 * inter, scale=4.0)
    want = ops_cpu.silu_and_mul_torch(gate_up)
    with _path(isa):
        got = ops_cpu.silu_and_mul(gate_up, backend="cpu")
    assert got.shape == want.shape
    _close_bf16(got, want)


@PATHS
@settings(max_examples=25, deadline=None)
@given(heads=st.integers(1, 12), d=st.sampled_from([32, 64, 128]), extra=st.integers(0, 3), **SIZES)
def test_rotary_is_bit_exact_in_place(isa, rows, seed, heads, d, extra):
    gen = torch.Generator().manual_seed(seed)
    # q and k heads as a view of a fused QKV row: `extra` more heads after them (the V heads)
    qkv = _bf16(gen, rows, (heads + extra) * d, scale=2.0)
    x = qkv[:, : heads * d].unflatten(1, (heads, d))
    pos = torch.randint(0, 4096, (rows,), generator=gen).float()
    freqs = pos[:, None] * (10000.0 ** (-torch.arange(0, d, 2).float() / d))[None, :]
    cos, sin = freqs.cos().bfloat16(), freqs.sin().bfloat16()
    tail = qkv[:, heads * d :].clone()
    want = ops_cpu.rotary_torch(x, cos, sin)
    with _path(isa):
        got = ops_cpu.rotary_(x, cos, sin, backend="cpu")
    assert got.data_ptr() == qkv.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, heads * d :], tail)  # the V heads untouched


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 6),
    n=st.integers(1, 3000),
    pad=st.integers(0, 40),
    specials=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_argmax_rows_matches_torch_argmax(rows, n, pad, specials, seed):
    """bf16 rows with many ties (and, drawn, -0 / +0, infinities, NaN), strided inside a wider
    tensor: the native argmax gives ``torch.argmax``'s index (the first on ties, the first
    NaN) of the values widened to fp32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (rows, n + pad), generator=gen).float()
    if specials:
        pick = torch.randint(0, 200, x.shape, generator=gen)
        x[pick == 0] = -0.0
        x[pick == 1] = float("inf")
        x[pick == 2] = float("-inf")
        x[pick == 3] = float("nan") if seed % 3 == 0 else 0.0
    x = x.bfloat16()[:, :n]
    got = ops_cpu.argmax_rows(x, backend="cpu")
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x.float(), dim=-1))


def test_argmax_rows_refuses_what_it_cannot_do():
    with pytest.raises(KernelConfigError):
        ops_cpu.argmax_rows(torch.zeros(2, 3), backend="cpu")  # fp32: the twin's job
    with pytest.raises(KernelConfigError):
        ops_cpu.argmax_rows(torch.zeros(2, 0, dtype=torch.bfloat16), backend="cpu")
    x = torch.zeros(2, 3)
    assert torch.equal(ops_cpu.argmax_rows(x), torch.argmax(x, dim=-1))  # auto: the twin


def test_auto_takes_the_twin_where_native_cannot():
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(4, 64, generator=gen)
    w32 = torch.randn(64, generator=gen)
    out, _ = ops_cpu.rms_norm(x32, None, w32, 1e-6)  # fp32: the twin, transformers' bits
    assert torch.equal(out, ops_cpu.rms_norm_torch(x32, None, w32, 1e-6)[0])
    odd = _bf16(gen, 4, 40)  # width not a multiple of 16
    assert torch.equal(ops_cpu.silu_and_mul(odd), ops_cpu.silu_and_mul_torch(odd))
    x = _bf16(gen, 3, 2, 48)  # head dim not a multiple of 32
    cs = _bf16(gen, 3, 24)
    assert torch.equal(ops_cpu.rotary_(x, cs, cs), ops_cpu.rotary_torch(x, cs, cs))


def test_cpu_backend_refuses_what_it_cannot_do_and_changes_nothing():
    gen = torch.Generator().manual_seed(1)
    x32 = torch.randn(4, 64, generator=gen)
    before = x32.clone()
    with pytest.raises(KernelConfigError, match="bf16"):
        ops_cpu.rms_norm(x32, x32.clone(), torch.ones(64), 1e-6, backend="cpu")
    assert torch.equal(x32, before)
    with pytest.raises(KernelConfigError, match="multiple of 16"):
        ops_cpu.silu_and_mul(_bf16(gen, 2, 40), backend="cpu")
    with pytest.raises(KernelConfigError, match="unknown backend"):
        ops_cpu.silu_and_mul(_bf16(gen, 2, 64), backend="cuda-ish")
    with pytest.raises(ValueError, match="multiple of 16"):  # the binding checks too
        cpu_native.elementwise(ops_cpu.OP_SILU_MUL, 1, 8, 0, 0, 0, 0, 0, 0, 0)


def test_aliased_or_overlapping_rows_take_the_twin():
    """In-place passes over rows that share memory would race: those calls take the twin (and
    ``backend="cpu"`` refuses them), so the result is the twin's."""
    gen = torch.Generator().manual_seed(3)
    w = _bf16(gen, 64)
    x = _bf16(gen, 4, 64)
    want = ops_cpu.rms_norm_torch(x.clone(), x.clone(), w, 1e-6)
    got = ops_cpu.rms_norm(x, x, w, 1e-6)  # the residual is x itself
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    row = _bf16(gen, 1, 64).expand(4, 64)  # four rows, one memory row
    res = _bf16(gen, 4, 64)
    want = ops_cpu.rms_norm_torch(row, res.clone(), w, 1e-6)
    got = ops_cpu.rms_norm(row, res, w, 1e-6)
    assert torch.equal(got[0], want[0])
    with pytest.raises(KernelConfigError, match="residual apart from x"):
        ops_cpu.rms_norm(row, res, w, 1e-6, backend="cpu")
    heads = _bf16(gen, 3, 1, 64).expand(3, 4, 64)  # four heads, one memory head
    cs = _bf16(gen, 3, 32)
    assert torch.equal(ops_cpu.rotary_(heads, cs, cs), ops_cpu.rotary_torch(heads, cs, cs))


def test_compiled_forward_takes_the_twin():
    """Under torch.compile the dispatcher returns the twin's traceable ops (no opaque call)."""
    gen = torch.Generator().manual_seed(2)
    gate_up = _bf16(gen, 8, 128)

    @torch.compile(backend="eager", fullgraph=True)
    def f(t):
        return ops_cpu.silu_and_mul(t)

    assert torch.equal(f(gate_up), ops_cpu.silu_and_mul_torch(gate_up))
