"""kvcore's own model code (kvcore.models.llama, gemma): equal to transformers' modules.

The engine-level exactness tests (test_engine*.py, test_window_models.py, test_gemma3.py) run on
this path by default; here: every family's forward against transformers' in fp32 with a dense
reference attention, bf16 agreement, shared weights, the fallback and its switch, op counts.
"""

import contextlib
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import hf_greedy
from kvcore import InvalidArgumentError
from kvcore.entrypoints.llm import LLM
from kvcore.models.layers import linear as linear_mod
from kvcore.models.layers.linear import (
    Linear,
    MergedLinear,
    can_pack_small,
    can_prepack,
    gate_up_act,
    prepack_linears,
)
from kvcore.models.loader import auto_dtype, tiny_llama
from kvcore.models.native import native_model
from kvcore.models.tiny import tiny_window_model
from kvcore.params import SamplingParams
from kvcore.runner.model_runner import ModelRunner
from kvcore_kernels import cpu_native, linear_cpu
from test_engine import SMALL

FAMILIES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3"]
SHRINK = dict(hidden_size=64, intermediate_size=128, vocab_size=256, num_hidden_layers=3)


def _hf(name, dtype=torch.float32, **kw):
    if name == "tiny-llama":
        return tiny_llama(seed=1, dtype=dtype, **{**SHRINK, **kw})
    fields = (
        {**SHRINK, "head_dim": 32}
        if name in ("tiny-qwen3", "tiny-gemma2", "tiny-gemma3")
        else SHRINK
    )
    if name in ("tiny-gemma2", "tiny-gemma3"):
        fields = {**fields, "query_pre_attn_scalar": 32}
    return tiny_window_model(name, seed=1, dtype=dtype, **{**fields, "sliding_window": 8, **kw})


class DenseStep:
    """Reference attention for one packed sequence: causal, windowed, soft-capped, fp32."""

    def __call__(self, layer_idx, q, k, v, scale, window, soft_cap):
        t, hq, _ = q.shape
        k = k.repeat_interleave(hq // k.shape[1], 1)
        v = v.repeat_interleave(hq // v.shape[1], 1)
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        if soft_cap:
            s = torch.tanh(s / soft_cap) * soft_cap
        i = torch.arange(t)
        mask = i[None, :] <= i[:, None]
        if window:
            mask &= (i[:, None] - i[None, :]) < window
        s = s.masked_fill(~mask, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float()).to(q.dtype)


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_equals_transformers_fp32(name):
    hf = _hf(name)
    hf.set_attn_implementation("eager")
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        native, how = native_model(hf)
        keep = torch.tensor([3, 11, 19])
        got = native(ids[0], torch.arange(20), keep, DenseStep())
        again = hf(ids).logits[0]  # transformers' parameters now point into the fused weights
    assert how == "kvcore"
    torch.testing.assert_close(got, ref[keep], rtol=1e-4, atol=1e-4)
    assert torch.equal(again, ref)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2"])
def test_last_layer_runs_o_proj_and_mlp_on_the_sampled_rows_only(name):
    """Every layer's attention sees all 20 rows (it stores their K/V); the last layer's o_proj
    and MLP see only the 3 sampled rows, the other layers' all 20; the logits stay the ones a
    forward keeping every row gives for those rows."""
    hf = _hf(name)
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(0))
    native, _ = native_model(hf)
    rows: dict[str, list[int]] = {"qkv": [], "o": [], "down": []}
    hooks = [
        mod.register_forward_hook(lambda m, a, out, key=key: rows[key].append(a[0].shape[0]))
        for layer in native.model.layers
        for key, mod in (
            ("qkv", layer.self_attn.qkv_proj),
            ("o", layer.self_attn.o_proj),
            ("down", layer.mlp.down_proj),
        )
    ]
    keep = torch.tensor([3, 11, 19])
    with torch.no_grad():
        got = native(ids, torch.arange(20), keep, DenseStep())
        for h in hooks:
            h.remove()
        every = native(ids, torch.arange(20), torch.arange(20), DenseStep())
    assert rows["qkv"] == [20, 20, 20]
    assert rows["o"] == rows["down"] == [20, 20, 3]
    torch.testing.assert_close(got, every[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_forward_agrees_with_transformers_bf16(name):
    hf = _hf(name, dtype=torch.bfloat16)
    hf.set_attn_implementation("eager")
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
        native, _ = native_model(hf)
        got = native(ids[0], torch.arange(20), torch.arange(20), DenseStep()).float()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_weights_are_shared_not_copied():
    hf = _hf("tiny-llama")
    native, _ = native_model(hf)
    attn, layer = native.model.layers[0].self_attn, hf.model.layers[0].self_attn
    fused = attn.qkv_proj.weight
    q_rows = layer.q_proj.weight
    assert q_rows.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert native.model.embed_tokens.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert native.lm_head.weight.data_ptr() == hf.lm_head.weight.data_ptr()


def test_can_prepack_only_where_onednn_relays_a_bf16_weight():
    """An AVX2-only CPU (Zen 3) has oneDNN but refuses its bf16 re-lay; a bf16 engine failed
    to start there (from ``prepack_linears``)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16))
        takes = torch.backends.mkldnn.is_available()
    except (RuntimeError, AttributeError):
        takes = False
    assert can_prepack() == takes


def test_bf16_linears_run_in_fp32_where_the_cpu_has_no_bf16_gemm(monkeypatch):
    """Neither oneDNN's bf16 re-lay nor the native kernel: an fp32 copy of each bf16 weight,
    the product rounded to bf16 (torch's bf16 F.linear there is ~10x slower)."""
    monkeypatch.setattr(linear_mod, "_onednn_packs_bf16", lambda: False)
    monkeypatch.setattr(linear_mod, "can_pack_small", lambda: False)
    monkeypatch.setattr(linear_mod, "can_pack_small_avx2", lambda: False)
    model = tiny_llama(seed=3, dtype=torch.bfloat16, **SMALL)
    llm, got = _run(model, [[5, 6, 7, 8, 9], list(range(3, 20))])
    mods = [m for m in llm.engine.runner.native.modules() if isinstance(m, (Linear, MergedLinear))]
    assert mods and all(m.upcast is not None and m.packed is None for m in mods)
    # oneDNN's packed fp32 copy beside the plain one, where oneDNN packs fp32 (it does on x86)
    packs = linear_mod._onednn_packs_fp32()
    assert all((m.upcast[2] is not None) == packs for m in mods)
    fp32_bytes = sum(m.weight.numel() * 4 for m in mods)
    assert llm.engine.runner.prepacked_bytes == fp32_bytes * (2 if packs else 1)
    assert all(len(t) == 8 for t in got)
    gen = torch.Generator().manual_seed(0)
    # The tiny model's weights are below the packed copy's size bound: F.linear on the fp32
    # copy; then every call of up to numel rows on the packed copy.
    for per_row in (linear_mod.UPCAST_PACKED_ELEMS_PER_ROW, 1):
        monkeypatch.setattr(linear_mod, "UPCAST_PACKED_ELEMS_PER_ROW", per_row)
        for mod in mods[:4]:
            for rows in (1, 5):
                x = torch.randn(rows, mod.weight.shape[1], generator=gen).bfloat16()
                out = mod(x)
                assert out.dtype == torch.bfloat16
                exact = x.double() @ mod.weight.double().T  # bf16 products, summed exactly
                assert torch.allclose(out.double(), exact, rtol=2**-8, atol=1e-6)
    monkeypatch.setenv("KVCORE_PACK_FP32", "0")  # the fp32 copies alone
    assert prepack_linears(llm.engine.runner.native) == fp32_bytes
    assert all(m.upcast[2] is None for m in mods)
    monkeypatch.setenv("KVCORE_PREPACK", "0")  # no packing of any kind
    assert prepack_linears(llm.engine.runner.native) == 0


def test_fp32_linears_take_onednns_packed_copy_for_few_rows(monkeypatch):
    """An fp32 model: each weight gets oneDNN's packed fp32 copy (beside itself, not a copy of
    it), which takes the calls of up to ``numel / UPCAST_PACKED_ELEMS_PER_ROW`` rows."""
    if not linear_mod._onednn_packs_fp32():
        pytest.skip("oneDNN packs no fp32 weight here")
    model = tiny_llama(seed=4, dtype=torch.float32, **SMALL)
    llm, got = _run(model, [[5, 6, 7, 8, 9], list(range(3, 20))])
    mods = [m for m in llm.engine.runner.native.modules() if isinstance(m, (Linear, MergedLinear))]
    assert mods and all(m.upcast is not None and m.upcast[2] is not None for m in mods)
    assert all(m.upcast[0].data_ptr() == m.weight.data_ptr() for m in mods)  # no fp32 copy
    assert llm.engine.runner.prepacked_bytes == sum(m.weight.numel() * 4 for m in mods)
    assert all(len(t) == 8 for t in got)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        linear_mod.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a)
    )
    gen = torch.Generator().manual_seed(1)
    for per_row, packed in ((linear_mod.UPCAST_PACKED_ELEMS_PER_ROW, 0), (1, 1)):
        monkeypatch.setattr(linear_mod, "UPCAST_PACKED_ELEMS_PER_ROW", per_row)
        for mod in mods[:4]:
            calls.clear()
            x = torch.randn(3, mod.weight.shape[1], generator=gen)
            want = F.linear(x, mod.weight, mod.bias)
            assert torch.allclose(mod(x), want, rtol=1e-5, atol=1e-5)
            assert len(calls) == packed  # the tiny weights sit under the bound by default
    monkeypatch.setenv("KVCORE_PACK_FP32", "0")
    assert prepack_linears(llm.engine.runner.native) == 0
    assert all(m.upcast is None for m in mods)


@pytest.mark.skipif(not can_prepack(), reason="oneDNN packs no bf16 weight here")
def test_prepacked_bf16_linears_give_the_same_bits(monkeypatch):
    monkeypatch.setenv("KVCORE_SMALL_LINEAR", "0")  # oneDNN's packed copy alone (next test: both)
    hf = _hf("tiny-gemma3", dtype=torch.bfloat16)
    native, _ = native_model(hf)
    ids = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(2))
    keep = torch.arange(13)
    with torch.no_grad():
        plain = native(ids, torch.arange(13), keep, DenseStep())
        n = prepack_linears(native)
        mods = [m for m in native.modules() if isinstance(m, (Linear, MergedLinear))]
        assert n == sum(m.weight.numel() * 2 for m in mods) and all(
            m.packed is not None for m in mods
        )
        packed = native(ids, torch.arange(13), keep, DenseStep())
        assert torch.equal(packed, plain)
        assert native(ids[:0], torch.arange(0), keep[:0], DenseStep()).shape == (0, 256)

        def packed_calls(rows):
            with torch.profiler.profile() as prof:
                native(ids[:rows], torch.arange(rows), keep[:rows], DenseStep())
            return sum(e.count for e in prof.key_averages() if "_linear_pointwise" in e.key)

        # two rows or more take the packed weight; one row keeps F.linear (another oneDNN path)
        assert packed_calls(2) == len(mods) and packed_calls(1) == 0
    # fp32 weights get no bf16 pack: at most oneDNN's fp32 copy, for few-row calls (a later
    # change); the switch turns packing off
    fp32 = native_model(_hf("tiny-llama"))[0]
    mods32 = [m for m in fp32.modules() if isinstance(m, (Linear, MergedLinear))]
    want = sum(m.weight.numel() * 4 for m in mods32) if linear_mod._packs_fp32() else 0
    assert prepack_linears(fp32) == want
    assert all(getattr(m, a, None) is None for m in mods32 for a in ("packed", "small", "gated"))
    monkeypatch.setenv("KVCORE_PREPACK", "0")
    assert not can_prepack() and prepack_linears(native) == 0
    assert all(m.packed is not None for m in mods)  # it packs nothing new, undoes nothing


def _linear_calls(native, ids, rows):
    """oneDNN packed-linear calls and native small-batch calls of one forward over ``rows``."""
    keep = torch.arange(rows)
    with torch.profiler.profile() as prof:
        out = native(ids[:rows], torch.arange(rows), keep, DenseStep())
    count = {e.key: e.count for e in prof.key_averages()}
    return out, count.get("mkldnn::_linear_pointwise", 0)


@contextlib.contextmanager
def _no_dnn_silu_mul(monkeypatch):
    """``KVCORE_DNN_SILU_MUL=0`` (read once: its probe's cache cleared on entry and exit)."""
    monkeypatch.setenv("KVCORE_DNN_SILU_MUL", "0")
    linear_mod._dnn_fuses_silu_mul.cache_clear()
    try:
        yield
    finally:
        monkeypatch.delenv("KVCORE_DNN_SILU_MUL")
        linear_mod._dnn_fuses_silu_mul.cache_clear()


@pytest.mark.skipif(not can_pack_small(), reason="no AVX-512 BF16: the small-batch kernel is off")
def test_small_batches_take_the_native_linear_and_large_ones_onednn(monkeypatch):
    # oneDNN's gate-up with SiLU as post-ops has its own test: here the old bits above the limit
    with _no_dnn_silu_mul(monkeypatch):
        _small_native_large_onednn(monkeypatch)


def _small_native_large_onednn(monkeypatch):
    hf = _hf("tiny-qwen2", dtype=torch.bfloat16)  # q/k/v carry a bias
    native, _ = native_model(hf)
    ids = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(4))
    mods = [m for m in native.modules() if isinstance(m, (Linear, MergedLinear))]
    dnn_bytes = sum(m.weight.numel() * 2 for m in mods) if can_prepack() else 0
    with torch.no_grad():
        plain = native(ids, torch.arange(13), torch.arange(13), DenseStep()).float()
        for limit in (linear_mod.SMALL_ROWS, 4):  # this CPU's limit, then one below 13 rows
            monkeypatch.setattr(linear_mod, "SMALL_ROWS", limit)
            n = prepack_linears(native)
            packs = [m.small if m.small is not None else m.gated for m in mods]
            small_bytes = sum(p.nbytes for p in packs if p is not None)
            # every projection packed once: the SiLU MLPs' gate-up gated, the others plain
            assert all((m.small is None) != (m.gated is None) for m in mods)
            assert sum(m.gated is not None for m in mods) == hf.config.num_hidden_layers
            # no row limit (no AMX): the native copy replaces oneDNN's
            assert all((m.packed is None) == (limit is None) for m in mods)
            assert n == small_bytes + (0 if limit is None else dnn_bytes)
            got, onednn_calls = _linear_calls(native, ids, 13)
            if limit is None or limit >= 13:  # every projection: the native kernel
                assert onednn_calls == 0
                # bf16 logits: the same up to the last bits of each GEMM (another sum order)
                err = (got.float() - plain).abs().max() / plain.abs().max()
                assert err < 0.05
                assert (got.float().argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9
            elif can_prepack():  # above the limit oneDNN's copy runs: the old bits exactly
                assert onednn_calls == len(mods) and torch.equal(got.float(), plain)
    monkeypatch.setenv("KVCORE_SMALL_LINEAR", "0")
    assert not can_pack_small()


@pytest.mark.skipif(
    can_prepack() or not linear_mod.can_pack_small_avx2(),
    reason="not an AVX2 CPU without a bf16 GEMM (the AVX2 small-batch path is off)",
)
def test_upcast_bf16_few_rows_take_the_native_avx2_linear(monkeypatch):
    """No bf16 GEMM here (Zen 3): bf16 weights run as fp32 copies, but calls of up to
    ``UPCAST_SMALL_ROWS`` rows take the native kernel's AVX2 path on a bf16 pack (half the
    bytes streamed); more rows keep oneDNN's fp32 GEMM, bit for bit as before. (With the
    blocked AVX2 GEMM off, ``cpu_native.OPTIONS.tall``: the next test has it on.)"""
    monkeypatch.setattr(cpu_native.OPTIONS, "tall", False)
    hf = _hf("tiny-qwen2", dtype=torch.bfloat16)  # q/k/v carry a bias
    native, _ = native_model(hf)
    mods = [m for m in native.modules() if isinstance(m, (Linear, MergedLinear))]
    # oneDNN's packed fp32 copy only where it takes calls the native pack does not: none of the
    # tiny weights at the default bound, every one at one element per row
    fp32 = sum(m.weight.numel() * 4 for m in mods)
    for per_row, packs in ((linear_mod.UPCAST_PACKED_ELEMS_PER_ROW, False), (1, True)):
        monkeypatch.setattr(linear_mod, "UPCAST_PACKED_ELEMS_PER_ROW", per_row)
        n = prepack_linears(native)
        assert all((m.upcast[2] is not None) == packs for m in mods)
        assert n == fp32 * (2 if packs else 1) + sum(m.small.nbytes for m in mods)
    assert mods and all(m.upcast is not None and m.small is not None for m in mods)
    # without the blocked GEMM no gated pack (its small-row path would take prefill chunks)
    assert all(m.gated is None for m in mods)
    limit = linear_mod.UPCAST_SMALL_ROWS
    gen = torch.Generator().manual_seed(6)
    for rows in (1, limit, limit + 1, 13):
        x = torch.randn(rows, hf.config.hidden_size, generator=gen).bfloat16()
        for mod in (m for m in mods if m.weight.shape[1] == hf.config.hidden_size):
            got = linear_mod._linear(x, mod)
            w, b, _ = mod.upcast
            fp32 = F.linear(x.float(), w, b).to(torch.bfloat16)
            if rows > limit:  # oneDNN's fp32 GEMM (packed: rows <= numel), as before
                packed = torch.ops.mkldnn._linear_pointwise(
                    x.float(), mod.upcast[2], b, "none", [], ""
                )
                assert torch.equal(got, packed.to(torch.bfloat16))
                continue
            # the native kernel: exact bf16 products summed in fp32 in another order
            assert torch.equal(got, linear_cpu.linear(x, mod.small, mod.bias))
            err = (got.float() - fp32.float()).abs().max() / fp32.float().abs().max()
            assert err < 0.02
    ids = torch.randint(3, 256, (3,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        fast = native(ids, torch.arange(3), torch.arange(3), DenseStep()).float()
        monkeypatch.setattr(linear_mod, "UPCAST_SMALL_ROWS", 0)
        slow = native(ids, torch.arange(3), torch.arange(3), DenseStep()).float()
    assert (fast - slow).abs().max() / slow.abs().max() < 0.05
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() >= 0.6
    monkeypatch.setenv("KVCORE_SMALL_LINEAR", "0")
    assert not linear_mod.can_pack_small_avx2()


@pytest.mark.skipif(
    can_prepack() or not linear_mod.can_pack_small_avx2() or not linear_cpu.tall_path(),
    reason="not an AVX2 CPU without a bf16 GEMM (the blocked AVX2 GEMM is off)",
)
def test_upcast_bf16_all_rows_take_the_native_avx2_kernel_without_fp32_copies(monkeypatch):
    """With the blocked AVX2 GEMM (``linear_cpu.tall_path()``), every row count of a bf16 weight
    runs the native kernel on its bf16 pack: no fp32 copy is made (the weights' memory once more,
    not three times), prefill-sized calls give the small-row bits, and the forward stays within
    bf16's reach of the one on oneDNN's fp32 GEMMs (``cpu_native.OPTIONS.tall`` off). The SiLU
    MLPs' gate-up is packed gated (``test_silu_gate_up_runs_gated_with_the_two_step_bits``)."""
    hf = _hf("tiny-qwen2", dtype=torch.bfloat16)  # q/k/v carry a bias
    native, _ = native_model(hf)
    mods = [m for m in native.modules() if isinstance(m, (Linear, MergedLinear))]
    n = prepack_linears(native)
    gate_ups = {id(m.gate_up_proj) for m in native.modules() if hasattr(m, "gate_up_proj")}
    assert len(gate_ups) == hf.config.num_hidden_layers
    assert all((m.gated is not None) == (id(m) in gate_ups) for m in mods)
    mods = [m for m in mods if m.gated is None]
    assert mods and all(m.small is not None and m.upcast is None for m in mods)
    assert n == sum(m.small.nbytes for m in mods) + sum(
        m.gate_up_proj.gated.nbytes for m in native.modules() if hasattr(m, "gate_up_proj")
    )
    gen = torch.Generator().manual_seed(8)
    for rows in (1, 47, 48, 130):
        x = torch.randn(rows, hf.config.hidden_size, generator=gen).bfloat16()
        for mod in (m for m in mods if m.weight.shape[1] == hf.config.hidden_size):
            got = linear_mod._linear(x, mod)
            assert torch.equal(got, linear_cpu.linear(x, mod.small, mod.bias))
            if rows >= 48:  # the small-row panels' bits
                monkeypatch.setattr(cpu_native.OPTIONS, "tall", False)
                assert torch.equal(got, linear_cpu.linear(x, mod.small, mod.bias))
                monkeypatch.setattr(cpu_native.OPTIONS, "tall", True)
            b32 = None if mod.bias is None else mod.bias.float()
            fp32 = F.linear(x.float(), mod.weight.float(), b32)
            err = (got.float() - fp32).abs().max() / fp32.abs().max()
            assert err < 0.02
    ids = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        fast = native(ids, torch.arange(60), torch.arange(60), DenseStep()).float()
        monkeypatch.setattr(cpu_native.OPTIONS, "tall", False)
        prepack_linears(native)
        assert all(m.upcast is not None for m in mods)  # the fp32 copies again
        slow = native(ids, torch.arange(60), torch.arange(60), DenseStep()).float()
    assert (fast - slow).abs().max() / slow.abs().max() < 0.05
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() >= 0.6


@pytest.mark.skipif(
    not (can_pack_small() or (linear_mod.can_pack_small_avx2() and linear_cpu.tall_path())),
    reason="no AVX-512 BF16 and no blocked AVX2 GEMM: no gated pack",
)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2"])
def test_silu_gate_up_runs_gated_with_the_two_step_bits(name):
    """A SiLU MLP's gate-up is packed gated (AVX-512 BF16, or AVX2 with the blocked GEMM) and
    ``gate_up_act`` gives the bits of the plain product on the same kernel path and the
    activation, decode-sized and prefill-sized."""
    hf = _hf(name, dtype=torch.bfloat16)
    native, _ = native_model(hf)
    prepack_linears(native)
    mlps = [m for m in native.modules() if hasattr(m, "gate_up_proj")]
    silu = name != "tiny-gemma2"  # Gemma's tanh-GELU keeps the plain product + activation
    assert mlps and all((m.gate_up_proj.gated is not None) == silu for m in mlps)
    gen = torch.Generator().manual_seed(5)
    limit = linear_mod.SMALL_ROWS  # AMX CPUs: oneDNN takes more rows (the next test)
    for rows in (r for r in (1, 7, 13, 40, 48, 130) if limit is None or r <= limit):
        x = torch.randn(rows, hf.config.hidden_size, generator=gen).bfloat16()
        for mlp in mlps:
            got = gate_up_act(mlp.gate_up_proj, mlp.act, x)
            plain = linear_cpu.linear(x, linear_cpu.pack_linear(mlp.gate_up_proj.weight.detach()))
            assert torch.equal(got, mlp.act(plain))  # the same roundings as the two steps
            assert got.shape == (rows, mlp.gate_up_proj.output_sizes[0])


@pytest.mark.skipif(
    not (can_pack_small() and can_prepack()), reason="needs the native kernel and oneDNN's bf16"
)
def test_silu_gate_up_above_small_rows_runs_on_onednn_post_ops(monkeypatch):
    # on an AMX CPU calls of more than SMALL_ROWS rows go to oneDNN; elsewhere set the split here
    monkeypatch.setattr(linear_mod, "SMALL_ROWS", 16)
    hf = _hf("tiny-llama", dtype=torch.bfloat16)
    native, _ = native_model(hf)
    prepack_linears(native)
    mlps = [m for m in native.modules() if hasattr(m, "gate_up_proj")]
    assert mlps
    for mlp in mlps:  # the gate and up halves packed apart, no packed copy of the whole
        assert mlp.gate_up_proj.packed_silu is not None and mlp.gate_up_proj.packed is None
    gen = torch.Generator().manual_seed(6)
    for rows in (16, 17, 40, 130):
        x = torch.randn(rows, hf.config.hidden_size, generator=gen).bfloat16()
        for mlp in mlps:
            got = gate_up_act(mlp.gate_up_proj, mlp.act, x)
            w = mlp.gate_up_proj.weight.detach().float()
            g, u = F.linear(x.float(), w).chunk(2, dim=-1)
            want = F.silu(g) * u
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            # one bf16 rounding of SiLU(gate) and one of the result (the two steps round four
            # times: gate, up, SiLU, product)
            assert ((got.float() - want).abs() / (want.abs() + 1e-2)).max() < 0.02
            two_step = mlp.act(F.linear(x, mlp.gate_up_proj.weight))
            assert (got.float() - two_step.float()).abs().max() <= 0.02 * want.abs().max()
    # the switch: the whole weight packed once, the two steps with their bits again
    with _no_dnn_silu_mul(monkeypatch):
        prepack_linears(native)
        x = torch.randn(40, hf.config.hidden_size, generator=gen).bfloat16()
        for mlp in mlps:
            assert mlp.gate_up_proj.packed_silu is None and mlp.gate_up_proj.packed is not None
            got = gate_up_act(mlp.gate_up_proj, mlp.act, x)
            assert torch.equal(got, mlp.act(mlp.gate_up_proj(x)))


@pytest.mark.skipif(not can_prepack(), reason="oneDNN packs no bf16 weight here")
def test_engine_prepacks_bf16_on_the_cpu_and_keeps_its_tokens(monkeypatch):
    model = tiny_llama(seed=3, dtype=torch.bfloat16, **SMALL)
    prompts = [np.random.default_rng(i).integers(3, 128, 9 + 5 * i).tolist() for i in range(3)]
    packed, got = _run(model, prompts)
    assert packed.engine.runner.prepacked_bytes > 0
    monkeypatch.setenv("KVCORE_PREPACK", "0")
    plain, want = _run(model, prompts)
    assert plain.engine.runner.prepacked_bytes == 0
    assert got == want


def test_rms_norm_kernel_has_transformers_bits_in_fp32():
    x, w = torch.randn(7, 576), torch.randn(576)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(F.rms_norm(x, (576,), w, 1e-5), ref)


def _run(model, prompts, **kw):
    llm = LLM(model, num_blocks=24, block_size=4, max_num_batched_tokens=16, **kw)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_cpu_attention_takes_the_fused_outputs_strided_views(monkeypatch):
    """On a plain CPU cache the model's q / k / v (views into the fused QKV and rotary outputs,
    rows strided by all heads) reach the native store and kernel as they are, not copied; the
    greedy tokens stay transformers'."""
    strided = {"q": 0, "kv": 0}
    real_run, real_store = cpu_native.run, cpu_native.store

    def run(query, *args, **kwargs):
        strided["q"] += not query.is_contiguous()
        return real_run(query, *args, **kwargs)

    def store(key, value, *args, **kwargs):
        strided["kv"] += not (key.is_contiguous() or value.is_contiguous())
        return real_store(key, value, *args, **kwargs)

    monkeypatch.setattr(cpu_native, "run", run)
    monkeypatch.setattr(cpu_native, "store", store)
    model = tiny_llama(seed=3, **SMALL)
    prompts = [np.random.default_rng(i).integers(3, 128, 9 + 5 * i).tolist() for i in range(3)]
    _, got = _run(model, prompts)
    assert strided["q"] > 0 and strided["kv"] > 0
    assert got == [hf_greedy(model, p, 8, pad_token_id=0) for p in prompts]


def test_fallback_switch_gives_the_same_tokens(monkeypatch, caplog):
    model = tiny_llama(seed=3, **SMALL)
    prompts = [np.random.default_rng(i).integers(3, 128, 9 + 5 * i).tolist() for i in range(3)]
    with caplog.at_level(logging.INFO, logger="kvcore"):
        native, got = _run(model, prompts)
    assert native.engine.runner.model_impl == "kvcore"
    assert "model code: kvcore (LlamaForCausalLM)" in caplog.text
    monkeypatch.setenv("KVCORE_MODEL_IMPL", "transformers")
    hf, want = _run(model, prompts)
    assert hf.engine.runner.model_impl == "transformers" and hf.engine.runner.native is None
    assert got == want == [hf_greedy(model, p, 8, pad_token_id=0) for p in prompts]


def test_unsupported_falls_back_or_refuses():
    model = tiny_llama(seed=0, **SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    native, reason = native_model(model)
    assert native is None and "dynamic" in reason
    runner = ModelRunner(model, num_blocks=8, block_size=4)
    assert runner.model_impl == "transformers"
    with pytest.raises(InvalidArgumentError, match="dynamic"):
        ModelRunner(model, num_blocks=8, block_size=4, model_impl="kvcore")
    with pytest.raises(InvalidArgumentError, match="model_impl"):
        native_model(model, "vllm")


def test_auto_dtype_follows_the_declared_dtype_where_the_cpu_computes_it(monkeypatch):
    from kvcore.models import dtype as cpu_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(cpu_dtype, "cpu_has_native_bf16", lambda: True)
    assert auto_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert auto_dtype(torch.float16, cpu) == torch.float32
    monkeypatch.setattr(cpu_dtype, "cpu_has_native_bf16", lambda: False)
    assert auto_dtype(torch.bfloat16, cpu) == torch.float32
    assert auto_dtype(torch.bfloat16, cuda) == torch.bfloat16
    # no native bf16: bf16 only for kvcore's eager forward where the AVX2 linear runs (Zen 3)
    linear_path = not linear_mod.can_prepack() and linear_mod.can_pack_small_avx2()
    assert cpu_dtype.cpu_runs_bf16(True) == linear_path and not cpu_dtype.cpu_runs_bf16(False)
    want = torch.bfloat16 if linear_path else torch.float32
    assert auto_dtype(torch.bfloat16, cpu, kvcore_eager=True) == want
    assert auto_dtype(torch.bfloat16, cpu) == torch.float32  # the model's own modules
    assert auto_dtype(torch.float16, cpu, kvcore_eager=True) == torch.float32
    monkeypatch.setattr(linear_mod, "can_pack_small_avx2", lambda: True)
    monkeypatch.setattr(linear_mod, "can_prepack", lambda: False)
    assert auto_dtype(torch.bfloat16, cpu, kvcore_eager=True) == torch.bfloat16
    monkeypatch.setenv("KVCORE_PREPACK", "0")  # no packing: torch's slow bf16 GEMM
    assert auto_dtype(torch.bfloat16, cpu, kvcore_eager=True) == torch.float32
