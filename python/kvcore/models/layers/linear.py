"""Linear layers whose weight is several checkpoint projections stacked along the output dim.

``MergedLinear([q, k, v])`` holds ``W = cat(W_q, W_k, W_v)`` ``[q + k + v, in]``: one GEMM per
block instead of three (and ``gate_up``: one instead of two). The checkpoint's shards are loaded
into their row ranges by ``load_shard``::

    rows  0 ........ q | q ...... q+k | q+k ...... q+k+v
          W_q            W_k            W_v

**Prepacked bf16 weights on the CPU** (``prepack_linears``, called by the runner for the eager
CPU forward): ``F.linear`` on bf16 hands the weight to oneDNN, which re-lays it into its blocked
format on every call; for the few rows of a decode step that copy costs more than the product
(2-thread Zen 4, SmolLM2's gate/up, K 576 x N 3072: 84 us at 4 rows against 43 us prepacked, 256
against 213 us at 48). ``prepack_linears`` re-lays each weight once
(``torch.ops.mkldnn._reorder_linear_weight``, as inductor's CPU freezing and vLLM's CPU linear
do) and ``forward`` calls oneDNN's linear on the packed copy when there are two rows or more:
the same outputs bit for bit (the same kernel). A single row keeps ``F.linear``: oneDNN takes
another path there, no faster packed, and 8-10 of the LM head's 49,152 logits would round
differently (``benches/bench_linear_cpu.py`` times and counts both). The cost: one more copy of
the weights in memory (the plain weight stays: transformers' modules share it). fp16 weights,
CUDA, and a compiled forward (inductor packs its own) keep ``F.linear``.

**fp32 weights** (an fp32 model, or the fp32 copies below): ``F.linear`` re-lays them on every
call too (MKL's GEMM packs the weight per call), which for few rows costs more than the product.
``prepack_linears`` adds oneDNN's packed fp32 copy, and a call of up to
``numel / UPCAST_PACKED_ELEMS_PER_ROW`` rows runs on it: decode steps; prefill chunks keep
``F.linear`` (oneDNN's packed fp32 GEMM is 5-11 % slower there). ``KVCORE_PACK_FP32=0`` turns it
off.

**kvcore's own kernel for bf16 on CPUs with AVX-512 BF16** (``kvcore_kernels.linear_cpu``). A
decode step's GEMMs have a few rows and read every weight once, so they run at the speed the
weights stream from memory; oneDNN reaches 8-22 GB/s there on a 2-core Zen 4 against the ~35 GB/s
the cores can read. ``prepack_linears`` packs each bf16 weight into the native kernel's panels
(one sequential stream per 32 output columns): a decode step's GEMMs (SmolLM2's 30 layers and LM
head) take 0.66-0.88x oneDNN's time at 1-192 rows, and prefill chunks about the same
(``benches/bench_linear_cpu.py``, docs/kernels.md). Without AMX it runs every call and replaces
oneDNN's packed copy (the same memory as before); with AMX it takes calls of up to ``SMALL_ROWS``
rows beside oneDNN's copy. A row's result does not depend on the batch it runs in (one order of
the sum per row); its bits may differ from oneDNN's in the last place. ``KVCORE_SMALL_LINEAR=0``
turns it off (oneDNN's packed copy again).

**Gate-up with SiLU, fused** (``gate_up_act``): where an MLP's activation is SiLU and its gate-up
projection has no bias, ``prepack_linears`` packs that weight gated (gate panel ``i`` next to up
panel ``i``) in place of the plain native copy, and the kernel writes ``silu(gate) * up`` from
its sums: the ``[T, 2I]`` product is neither written nor read again, and the bits are those of
the plain product followed by ``ops_cpu.silu_and_mul`` (the same roundings).
``KVCORE_FUSED_GATE_UP=0`` keeps the two steps. Where oneDNN takes the calls above ``SMALL_ROWS``
(AMX CPUs: prefill chunks), such a gate-up is packed for it as its gate and up halves
(``packed_silu``, in place of the whole weight's copy) and runs as two GEMMs with oneDNN's
post-ops (as inductor's CPU linear fusions): SiLU on the gate's fp32 sums, the product with that
on the up's. No ``[T, 2I]`` product is written and read again (2-core Xeon, SmolLM2's gate-up, 1
thread: 0.98-1.20x the two steps at 65-2,048 rows; in the offline job the prefill steps' GEMMs
3-12 % faster). Two roundings to bf16 instead of four: closer to fp32 (max error 2.7-4.9e-3
against 4.5-6.4e-3), not the two steps' bits. ``KVCORE_DNN_SILU_MUL=0`` keeps the two steps there.

**No bf16 GEMM on this CPU** (oneDNN refuses the bf16 re-lay: no AVX-512, no AVX-NE-CONVERT, e.g.
an AVX2-only Zen 3): ``prepack_linears`` keeps an fp32 copy of each bf16 weight and ``_linear``
runs the fp32 GEMM on the upcast rows, rounding the product to bf16 (``_upcast_linears``): ~9x
torch's bf16 ``F.linear`` there, three times the weights' memory with the packed fp32 copy.
Calls of up to ``UPCAST_SMALL_ROWS`` rows take the native kernel's AVX2 path on a bf16 pack of
the weight instead (``linear_cpu.avx2_path``): bf16 widened to fp32 in registers, so a step of a
few rows streams half the bytes of the fp32 copy (2 threads, Zen 3, SmolLM2's shapes: 2.0-3.3x
oneDNN's best fp32 GEMM at 1-4 rows, 1.05-1.2x at 48-64, even at 128, where the GEMM is
compute-bound). ``KVCORE_SMALL_LINEAR=0`` turns it off too. Calls of 12 rows or more (prefill
chunks, decode steps of 12+ requests) take the kernel's blocked AVX2 GEMM on the same pack
(``linear_cpu.tall_path()``), so there every row count runs native and the fp32 copies are not
made (SmolLM2: peak RSS 3.13 -> 2.53 GB); ``KVCORE_NATIVE_TALL=0`` keeps the copies and oneDNN /
MKL above 64 rows. There a SiLU MLP's gate-up is packed gated too (``gate_up_act`` above, both
kernel paths): the same bits as the two steps (2026-12-05, a Zen 3: docs/engine.md).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from kvcore_kernels import cache as kv_cache
from kvcore_kernels import cpu_native, linear_cpu
from torch import nn

# Rows up to which the native kernel runs (None: every call). Without AMX it measured faster
# than oneDNN at every row count up to 256 (a decode step's weights streaming: 1.1-1.5x) and
# about equal on prefill chunks (2,048 rows: 0.95-1.07x by shape; whole prefill steps of 300-1,000
# tokens 0-11 % faster), so it runs every call and oneDNN's copy is not made. With AMX, oneDNN's
# tiles win once a GEMM is compute-bound (prefill chunks: 1.6-2.3x the native kernel), so only
# decode-sized calls take the kernel, itself on AMX tiles above 8 rows (a decode step's GEMMs in
# two runs: 1.12-1.34x oneDNN's speed at 48 rows, 1.00-1.19x at 64, 0.88-1.08x at 128; 2-core
# Xeon with AMX, one thread, ``benches/bench_linear_cpu.py``), and oneDNN keeps its copy for
# the rest. Where the CPU has AMX but the kernel cannot use it (not granted), 16: its AVX-512
# path lost above that.
SMALL_ROWS: int | None = 64 if linear_cpu.amx_path() else 16 if linear_cpu.has_amx() else None


# Rows up to which a bf16 weight upcast to fp32 (no bf16 GEMM here) runs on the native kernel's
# AVX2 path: 2.0-3.3x oneDNN's best fp32 GEMM at 1-4 rows on every SmolLM2 shape (2-thread Zen 3),
# 1.05-1.11x at 64, 0.94-1.01x at 128 (benches/tools/linear_avx2_bf16.py).
UPCAST_SMALL_ROWS = 64


def _linear(x: torch.Tensor, mod: MergedLinear | Linear) -> torch.Tensor:
    # is_compiling first: a traced forward never looks at the packed (mkldnn) tensor. One row
    # keeps F.linear: oneDNN takes another path for it, no faster packed, and not the same bits.
    if not torch.compiler.is_compiling():
        rows = x.shape[0]
        limit = SMALL_ROWS if mod.upcast is None else UPCAST_SMALL_ROWS
        if mod.small is not None and x.dim() == 2 and (limit is None or rows <= limit):
            return linear_cpu.linear(x, mod.small, mod.bias)
    cpu_native.flush()  # torch reads x: calls recorded by cpu_native.deferred run first
    if not torch.compiler.is_compiling():
        if mod.packed is not None and x.numel() > x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, mod.packed, mod.bias, "none", [], "")
        if mod.upcast is not None:  # fp32 GEMM: an fp32 model, or bf16 without bf16 GEMMs
            w, b, packed = mod.upcast
            if packed is not None and rows * UPCAST_PACKED_ELEMS_PER_ROW <= w.numel():
                y = torch.ops.mkldnn._linear_pointwise(x.float(), packed, b, "none", [], "")
                return y.to(x.dtype)
            return F.linear(x.float(), w, b).to(x.dtype)
    return F.linear(x, mod.weight, mod.bias)


#: ``_upcast_linears``' per-module fp32 weight, fp32 bias, and oneDNN's packed fp32 weight (None
#: where oneDNN cannot pack or ``KVCORE_PACK_FP32=0``).
UpcastWeights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]

# Where bf16 runs on fp32 copies (``_upcast_linears``), a call of up to ``numel / this`` rows
# takes oneDNN's packed fp32 copy: ``F.linear`` re-lays the weight on every call, which costs
# more than the product for few rows and large weights (AVX2 Zen 3, two threads, packed vs
# F.linear: 1.45-3.6x at 2-16 rows on every SmolLM2 shape, the LM head 1.2-2x up to 256 rows,
# but 0.9-0.95x on prefill chunks; ``benches/tools/linear_fp32_onednn.py``).
UPCAST_PACKED_ELEMS_PER_ROW = 24_576


def prepack_on() -> bool:
    """Whether packing of any kind is allowed (``KVCORE_PREPACK=0`` turns all of it off)."""
    return os.environ.get("KVCORE_PREPACK", "1") not in ("0", "")


def can_prepack() -> bool:
    """Whether oneDNN's packed bf16 linear runs here (``KVCORE_PREPACK=0`` turns it off)."""
    return prepack_on() and _onednn_packs_bf16()


def _onednn_packs_bf16() -> bool:
    """Whether this torch has oneDNN's packed linear and this CPU lets it re-lay a bf16 weight:
    oneDNN refuses without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT (an AVX2-only Zen 3 raises
    "bf16 path needs the cpu support ..."), and ``F.linear`` then stays."""
    return _onednn_packs(torch.bfloat16)


def _onednn_packs_fp32() -> bool:
    """Whether this torch has oneDNN's packed linear and it re-lays an fp32 weight."""
    return _onednn_packs(torch.float32)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Probed once per dtype, on a 16 x 16 weight: the call this module makes, so no CPU-flag
    list to keep in step."""
    ops = torch.ops.mkldnn
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    ):
        return False
    try:
        ops._reorder_linear_weight(torch.ones(16, 16, dtype=dtype), 64)
    except RuntimeError:
        return False
    return True


@functools.cache
def _dnn_fuses_silu_mul() -> bool:
    """Whether this torch's oneDNN linear takes the post-ops ``gate_up_act`` uses above
    ``SMALL_ROWS`` (SiLU, and a product with another tensor) on a packed bf16 weight; probed
    once on a 16 x 16 weight. ``KVCORE_DNN_SILU_MUL=0`` keeps the product and
    ``silu_and_mul`` as two steps."""
    if os.environ.get("KVCORE_DNN_SILU_MUL", "1") in ("0", "") or not _onednn_packs_bf16():
        return False
    ops = torch.ops.mkldnn
    try:
        w = ops._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16))
        x = torch.ones(2, 16, dtype=torch.bfloat16)
        g = ops._linear_pointwise(x, w, None, "swish", [], "")
        ops._linear_pointwise.binary(x, g, w, None, "mul")
    except (RuntimeError, AttributeError):
        return False
    return True


def _small_linear_on() -> bool:
    return os.environ.get("KVCORE_SMALL_LINEAR", "1") not in ("0", "")


def can_pack_small() -> bool:
    """Whether the native small-batch linear runs here (AVX-512 BF16; ``KVCORE_SMALL_LINEAR=0``
    turns it off)."""
    return _small_linear_on() and linear_cpu.fast_path()


def can_pack_small_avx2() -> bool:
    """Whether the native small-batch linear's AVX2 path runs here, for the few-row calls of
    bf16 weights upcast to fp32 (``KVCORE_SMALL_LINEAR=0`` turns it off)."""
    return _small_linear_on() and linear_cpu.avx2_path()


def prepack_linears(model: nn.Module) -> int:
    """Pack the weight of every ``Linear`` / ``MergedLinear`` of ``model`` that is bf16 on the
    CPU for the native kernel where ``can_pack_small()`` (gated, for a SiLU MLP's gate-up:
    ``gate_up_act``), and for oneDNN where rows are left to it (``SMALL_ROWS``; see the module
    docstring), or, where neither runs, into an fp32 copy (``_upcast_linears``); fp32 weights get
    oneDNN's packed fp32 copy for few-row calls (``_pack_fp32_linears``). Returns the bytes
    packed (0 when none). Packing again re-packs (after a weight changed). ``KVCORE_PREPACK=0``
    turns all of it off."""
    if not prepack_on():
        return 0
    dnn, small = can_prepack(), can_pack_small()
    if not (dnn or small):
        return _upcast_linears(model) + _pack_fp32_linears(model)
    return _pack_bf16_linears(model, dnn, small) + _pack_fp32_linears(model)


def _pack_bf16_linears(model: nn.Module, dnn: bool, small: bool) -> int:
    """``prepack_linears`` where oneDNN's bf16 re-lay or the native kernel runs."""
    gated = _gated_gate_ups(model)
    total = 0
    for mod in model.modules():
        if not isinstance(mod, (MergedLinear, Linear)):
            continue
        mod.gated = mod.upcast = None
        w = mod.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2:
            mod.packed = mod.small = mod.packed_silu = None
            continue
        fits = small and w.shape[1] % 2 == 0 and (mod.bias is None or mod.bias.dtype == w.dtype)
        mod.small = linear_cpu.pack_linear(w.detach()) if fits else None
        if mod.small is not None and id(mod) in gated:
            mod.gated, mod.small = linear_cpu.pack_linear(w.detach(), glu=True), None
        # oneDNN's copy: for the rows the native kernel does not take (all, if it cannot run);
        # a gated weight's as its gate and up halves, for gate_up_act's post-op fusion
        mod.packed = mod.packed_silu = None
        if dnn and (not fits or SMALL_ROWS is not None):
            if mod.gated is not None and _dnn_fuses_silu_mul():
                gate, up = w.detach().chunk(2)
                mod.packed_silu = (
                    torch.ops.mkldnn._reorder_linear_weight(gate.contiguous()),
                    torch.ops.mkldnn._reorder_linear_weight(up.contiguous()),
                )
            else:
                mod.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())
            total += w.numel() * w.element_size()
        for packed in (mod.small, mod.gated):
            total += packed.nbytes if packed is not None else 0
    return total


def _upcast_linears(model: nn.Module) -> int:
    """Where this CPU has no bf16 GEMM (oneDNN refuses the bf16 re-lay: no AVX-512, no
    AVX-NE-CONVERT), an fp32 copy of every bf16 CPU weight (and bias) for ``_linear``: torch's bf16
    ``F.linear`` there runs ~9 GFLOP/s against fp32's ~88 (AVX2 Zen 3, one thread, SmolLM2's
    gate-up at 48-2,048 rows; 2.4x at one row). The products of bf16 values are exact in fp32 and
    oneDNN's bf16 GEMM sums in fp32 too, so only the order of the sums differs; the output is
    rounded to bf16 as before. Costs twice the bf16 weights' memory, four times with oneDNN's
    packed copy of them (``_packs_fp32``), five with the native kernel's bf16 pack for calls of
    up to ``UPCAST_SMALL_ROWS`` rows (``can_pack_small_avx2``). Where the native kernel's blocked
    AVX2 GEMM runs (``linear_cpu.tall_path()``), a weight it packs takes every row count there
    and gets no fp32 copy: the bf16 pack alone, the weights' memory once more; a SiLU MLP's
    gate-up is packed gated there (``gate_up_act``; ``KVCORE_FUSED_GATE_UP=0``: plain). Returns
    the bytes made."""
    mods = []
    small, tall = can_pack_small_avx2(), linear_cpu.tall_path()
    gated = _gated_gate_ups(model) if tall else set()
    total = 0
    for mod in model.modules():
        if not isinstance(mod, (MergedLinear, Linear)):
            continue
        mod.packed = mod.small = mod.gated = mod.upcast = mod.packed_silu = None
        w = mod.weight
        if not (w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 2):
            continue
        if small and w.shape[1] % 2 == 0 and (mod.bias is None or mod.bias.dtype == w.dtype):
            if id(mod) in gated:  # gate_up_act: silu(gate) * up in one call, every row count
                mod.gated = linear_cpu.pack_linear(w.detach(), glu=True)
                total += mod.gated.nbytes
                continue
            mod.small = linear_cpu.pack_linear(w.detach())
            total += mod.small.nbytes
            if tall:  # the blocked AVX2 GEMM takes every row count: no fp32 copy
                continue
        mods.append(mod)
    # One arena for all copies (in 2 MiB pages where Linux lends them, as the KV cache: a decode
    # step streams every weight), each copy starting on a 64-byte line.
    sizes = [-(-m.weight.numel() // 16) * 16 for m in mods]
    if not mods:
        return total
    arena = kv_cache.zeros((sum(sizes),), torch.float32, torch.device("cpu"))
    pack = _packs_fp32()
    start = 0
    for mod, size in zip(mods, sizes, strict=True):
        w = mod.weight
        copy = arena[start : start + w.numel()].view(w.shape)
        copy.copy_(w.detach())
        start += size
        bias = None if mod.bias is None else mod.bias.detach().float()
        total += w.numel() * 4
        # oneDNN's packed copy for few-row calls (``UPCAST_PACKED_ELEMS_PER_ROW``) where the
        # native pack leaves it a range as wide as its own (SmolLM2: the LM head, 65-1,152 rows);
        # not where it would take none (qkv, o, down: 13-36 rows) or a sliver (gate-up: 65-72
        # rows, 212 MB for them)
        few = w.numel() // UPCAST_PACKED_ELEMS_PER_ROW
        packed = None
        if pack and (mod.small is None or few >= 2 * UPCAST_SMALL_ROWS):
            packed = torch.ops.mkldnn._reorder_linear_weight(copy, 64)
            total += w.numel() * 4
        mod.upcast = (copy, bias, packed)
    return total


def _packs_fp32() -> bool:
    return _onednn_packs_fp32() and os.environ.get("KVCORE_PACK_FP32", "1") not in ("0", "")


def _pack_fp32_linears(model: nn.Module) -> int:
    """oneDNN's packed copy of every fp32 CPU weight (an fp32 model: ``mod.upcast`` is the weight
    itself, the bias, the packed copy) for the few-row calls ``UPCAST_PACKED_ELEMS_PER_ROW``
    sends there; returns the bytes packed. Nothing where oneDNN cannot pack fp32 or
    ``KVCORE_PACK_FP32=0``."""
    if not _packs_fp32():
        return 0
    total = 0
    for mod in model.modules():
        if not isinstance(mod, (MergedLinear, Linear)):
            continue
        w = mod.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
            continue
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 64)
        mod.upcast = (w.detach(), None if mod.bias is None else mod.bias.detach(), packed)
        total += w.numel() * 4
    return total


def _gated_gate_ups(model: nn.Module) -> set[int]:
    """Ids of the gate-ups ``prepack_linears`` packs gated (``gate_up_act``): those of SiLU MLPs,
    unless ``KVCORE_FUSED_GATE_UP=0``."""
    if os.environ.get("KVCORE_FUSED_GATE_UP", "1") in ("0", ""):
        return set()
    return {id(m.gate_up_proj) for m in model.modules() if _silu_gate_up(m)}


def _silu_gate_up(mlp: nn.Module) -> bool:
    """Whether ``mlp`` is ``act(gate_up_proj(x))`` with SiLU on a bias-free two-way gate-up."""
    gate_up, act = getattr(mlp, "gate_up_proj", None), getattr(mlp, "act", None)
    return (
        isinstance(gate_up, MergedLinear)
        and gate_up.bias is None
        and len(gate_up.output_sizes) == 2
        and gate_up.output_sizes[0] == gate_up.output_sizes[1]
        and getattr(act, "name", None) == "silu"
    )


def gate_up_act(gate_up: MergedLinear, act: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``act(gate_up(x))``: one call of the native kernel on the gated weight where
    ``prepack_linears`` made one (and the rows are the kernel's), else the two steps."""
    gated = getattr(gate_up, "gated", None)
    if gated is not None and not torch.compiler.is_compiling() and x.dim() == 2:
        if SMALL_ROWS is None or x.shape[0] <= SMALL_ROWS:
            return linear_cpu.linear(x, gated)
        cpu_native.flush()  # torch reads x: calls recorded by cpu_native.deferred run first
        split = getattr(gate_up, "packed_silu", None)
        if split is not None:
            # oneDNN's post-ops (as inductor's CPU linear fusions): SiLU on the gate GEMM's
            # sums, the product with it on the up GEMM's; no [T, 2I] product and no pass over it
            g = torch.ops.mkldnn._linear_pointwise(x, split[0], None, "swish", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(x, g, split[1], None, "mul")
    return act(gate_up(x))


class MergedLinear(nn.Module):
    """``y = x @ cat(W_0..W_n).T (+ b)``; ``split(y)`` gives the per-shard outputs as views."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
        out = self.offsets[-1]
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # prepack_linears: oneDNN's copy of weight
        self.small: linear_cpu.PackedLinear | None = None  # ... and the native kernel's
        self.gated: linear_cpu.PackedLinear | None = None  # ... or its gated one (gate_up_act)
        # ... and then oneDNN's copies of its gate and up halves (gate_up_act above SMALL_ROWS)
        self.packed_silu: tuple[torch.Tensor, torch.Tensor] | None = None
        self.upcast: UpcastWeights | None = None  # fp32 copies (and oneDNN's packed one)

    def load_shard(self, shard: int, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy checkpoint tensor ``tensor`` (``name``: weight or bias) into shard ``shard``'s
        rows; returns the view it now lives in (the source can then point at it: no copy)."""
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"{name} of a linear without it"
        rows = param.data[self.offsets[shard] : self.offsets[shard + 1]]
        if rows.shape != tensor.shape:
            raise ValueError(f"shard {shard} {name}: {tuple(tensor.shape)} != {tuple(rows.shape)}")
        rows.copy_(tensor)
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self)


class Linear(nn.Module):
    """A plain linear (o_proj, down_proj, lm_head); the weight may be shared with the source."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None  # prepack_linears: oneDNN's copy of weight
        self.small: linear_cpu.PackedLinear | None = None  # ... and the native kernel's
        self.gated: linear_cpu.PackedLinear | None = None  # never set on a plain Linear
        self.packed_silu: tuple[torch.Tensor, torch.Tensor] | None = None  # nor this
        self.upcast: UpcastWeights | None = None  # fp32 copies (and oneDNN's packed one)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self)
