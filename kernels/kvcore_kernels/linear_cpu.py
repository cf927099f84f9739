"""Small-batch bf16 linear layers on the CPU: a decode step's GEMMs, over a weight packed once.

A decode step multiplies a few rows by every weight of the model once, so its GEMMs run at the
speed the weights stream from memory. oneDNN's bf16 GEMM, tuned for many rows, reaches a
fraction of that at a few rows (SmolLM2 on a 2-core Zen 4: 8-22 GB/s of weight against ~35 GB/s
the cores can read). The native kernel (``kernels/native/src/linear.rs``) reads a weight packed
into panels of 32 output columns, each one sequential stream of bf16 pairs, and does one AVX-512
BF16 dot product per 64 bytes loaded and row::

    packed = pack_linear(weight)          # [N, K] bf16 -> PackedLinear (once, at load time)
    y = linear(x, packed, bias)           # x [M, K] bf16 -> [M, N] bf16

    gated = pack_linear(gate_up, glu=True)  # [2I, K] = [gate | up] -> PackedLinear(n_out=I)
    h = linear(x, gated)                  # bf16(silu(x gate^T)) * (x up^T): [M, I]

A gated weight keeps gate panel ``i`` next to up panel ``i``, and the kernel writes
``silu(g) * u`` from its fp32 sums, rounding ``g``, ``u``, ``silu(g)`` and the product to bf16
where the plain product followed by ``ops_cpu.silu_and_mul`` rounds them: the same bits as those
two calls on the native kernel, without the ``[M, 2I]`` intermediate (written, then read again).

Results are fp32 sums of bf16 products rounded once to bf16, as oneDNN's; the order of the sum
differs, so a value may differ from ``F.linear``'s in its last bit. ``linear_torch`` is the
reference (``F.linear`` on the unpacked weight). ``fast_path()`` says whether this CPU has the
AVX-512 BF16 path; without it ``linear`` still runs (a portable loop, for tests) but callers
should keep their own GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcore_kernels import cpu_native
from kvcore_kernels.errors import KernelConfigError

NB = 32  # output columns per panel (linear.rs)


@dataclass(eq=False)
class PackedLinear:
    """A ``[n_out, k]`` bf16 weight in the kernel's panels (``int32 [panels, k / 2, 32]``)."""

    data: torch.Tensor
    n_out: int
    k: int
    #: gated: ``data`` holds gate and up panels alternately and ``n_out`` is ``I`` (half the
    #: weight's rows); ``linear`` returns ``silu(gate) * up``
    glu: bool = False

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def has_amx() -> bool:
    """Whether the CPU has AMX bf16 tiles (Linux ``/proc/cpuinfo``). oneDNN's bf16 GEMM uses
    them, far faster than AVX-512 BF16 once enough rows make a GEMM compute-bound, so callers
    should keep the native kernel to the rows where the weight's stream is the bound."""
    global _AMX
    if _AMX is None:
        try:
            with open("/proc/cpuinfo") as f:
                _AMX = any("amx_bf16" in line.split() for line in f if line.startswith("flags"))
        except OSError:
            _AMX = False
    return _AMX


_AMX: bool | None = None


def amx_path() -> bool:
    """Whether the native kernel runs calls of more than ``AMX_MIN_ROWS`` rows on AMX tiles:
    the CPU has them and Linux granted this process their state (``cpu_native.features()``'s
    ``amx``), ``KVCORE_NATIVE_NO_AMX`` unset. There a decode step's GEMMs run at 1.0-1.5x
    oneDNN's speed at 9-64 rows (``benches/bench_linear_cpu.py``)."""
    return bool(fast_path() and cpu_native.features().get("amx"))


#: Rows above which the native kernel takes its AMX tiles (below: AVX-512 BF16 dot products),
#: ``linear.rs``'s ``AMX_MIN_ROWS``.
AMX_MIN_ROWS = 8


def fast_path() -> bool:
    """Whether the native kernel has its AVX-512 BF16 path on this CPU."""
    return cpu_native.linear_fast_path()


def avx2_path() -> bool:
    """Whether the native kernel has its AVX2 path here (AVX2 and FMA, no AVX-512 BF16): plain
    and gated weights, bf16 widened to fp32 in registers, so the fp32 FMAs read half the bytes
    of an fp32 copy."""
    return cpu_native.linear_avx2_path()


def tall_path() -> bool:
    """Whether calls of many rows (48 or more) take the native kernel's blocked AVX2 GEMM here:
    the AVX2 path, and ``cpu_native.OPTIONS.tall`` (``KVCORE_NATIVE_TALL`` is not ``0`` at
    import). On a 2-core Zen 3, inside the offline SmolLM2 job, it matches MKL's fp32 GEMM on an
    fp32 copy at one thread and is 6-9 % faster at two (docs/engine.md), on the bf16 pack alone
    (no fp32 copy), with the small-row path's bits (one fp32 ``fma`` chain over ``k`` ascending
    per output): a row's result does not depend on the batch it runs in."""
    return avx2_path() and cpu_native.linear_tall_allowed()


def pack_linear(weight: torch.Tensor, glu: bool = False) -> PackedLinear:
    """Pack a 2-D bf16 CPU weight ``[n_out, k]`` (``k`` even) for ``linear``; a new tensor. With
    ``glu``, ``weight`` is a fused gate-up ``[2I, k]`` (gate rows first) and ``linear`` returns
    ``silu(gate) * up`` ``[M, I]``."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise KernelConfigError(
            f"pack_linear takes a 2-D bf16 CPU weight, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    n, k = weight.shape
    if n == 0 or k == 0 or k % 2:
        raise KernelConfigError(f"pack_linear needs n_out > 0 and an even k > 0, got {n} x {k}")
    if glu and n % 2:
        raise KernelConfigError(f"a gated pack_linear needs [gate | up] rows, got {n}")
    parts = weight.chunk(2) if glu else (weight,)
    out = parts[0].shape[0]
    panels = -(-out // NB)
    padded = torch.zeros(len(parts), panels * NB, k, dtype=torch.bfloat16)
    for i, part in enumerate(parts):
        padded[i, :out] = part
    # [part, panels, 32 columns, k/2 pairs, 2] -> [panels, part, k/2, 32, 2]: a dword per
    # (column, pair); gated, gate panel i and up panel i adjacent
    data = padded.view(len(parts), panels, NB, k // 2, 2).permute(1, 0, 3, 2, 4).contiguous()
    return PackedLinear(data.view(torch.int32).view(len(parts) * panels, k // 2, NB), out, k, glu)


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The reference: ``F.linear``."""
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for bf16 CPU ``x [M, k]`` (any strides: other layouts are copied
    first) on the packed weight; a new ``[M, n_out]`` bf16 tensor. Raises ``KernelConfigError``
    for anything else."""
    if not cpu_native.available():
        raise KernelConfigError("the native linear needs the kvcore_kernels extension")
    if (
        x.dim() != 2
        or x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or x.shape[1] != packed.k
    ):
        raise KernelConfigError(
            f"linear takes bf16 CPU x [M, {packed.k}], got {tuple(x.shape)} {x.dtype} on {x.device}"
        )
    if bias is not None and packed.glu:
        raise KernelConfigError("a gated linear takes no bias")
    if bias is not None and (
        bias.shape != (packed.n_out,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()
    ):
        raise KernelConfigError(f"bias must be contiguous bf16 [{packed.n_out}]")
    rows = x.shape[0]
    if x.stride(1) != 1 or (rows > 1 and x.stride(0) < packed.k):  # the kernel reads whole rows
        cpu_native.flush()  # x may be a recorded call's output
        x = x.contiguous()
    out = torch.empty(rows, packed.n_out, dtype=torch.bfloat16)
    if rows == 0:
        return out
    cpu_native.linear(
        x.data_ptr(), x.stride(0) if rows > 1 else packed.k, rows, packed.k,
        packed.data.data_ptr(), packed.n_out,
        0 if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), packed.glu,
        keep=(x, packed.data, bias, out),
    )  # fmt: skip
    return out
