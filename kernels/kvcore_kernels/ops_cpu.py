"""Row-wise element-wise ops of a model's forward: the pure-torch formulation (the twin) and, for
bf16 on the CPU, one native pass each (``cpu_native.elementwise``, ``kernels/native/src/ops.rs``).

In an eager bf16 forward each of these is several torch ops, each a pass over the rows and a
temporary (RMSNorm after a residual add: add, cast up, normalise, cast down, weight product;
SiLU-and-mul: a chunk, SiLU, product; rotary: four products, two sums, a concatenation). The
native pass computes in fp32 and rounds to bf16 exactly where those ops round, so rotary gives
the twin's bits and the other two differ from it only where ``exp`` or the order of the fp32 sum
of squares do (one bf16 step, rarely).

    rms_norm(x, residual, weight, eps)  -> (out, residual')  # Llama/Qwen RMSNorm (no Gemma 1 + w)
        with a residual: s = x + residual; residual' = s; out = norm(s). bf16 native: x and
        residual are overwritten (out is x, residual' is residual), as vLLM's fused_add_rms_norm.
    silu_and_mul(gate_up)               -> silu(gate) * up, gate_up = [gate | up]
    rotary_(x, cos, sin)                -> x [T, H, D] rotated by cos, sin [T, D/2]
        ([x1 | x2] -> [x1 c - x2 s | x2 c + x1 s]); bf16 native: in place, x is returned.
    argmax_rows(x)                      -> int64 [rows]: each row's first index of its largest
        value, NaN above all (as ``torch.argmax``); bf16 native without widening to fp32
        (``kernels/native/src/argmax.rs``: greedy sampling over a step's bf16 logits).

``backend``: "auto" (native for bf16 CPU tensors of a layout it takes, outside ``torch.compile``;
else the twin), "torch" (the twin), "cpu" (native, ``KernelConfigError`` where it cannot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcore_kernels import cpu_native
from kvcore_kernels.errors import KernelConfigError

OP_RMS_NORM, OP_SILU_MUL, OP_ROTARY = range(3)


def rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:  # half precision: normalise in fp32, cast, then scale (Llama's rounding)
        out = weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return out, residual


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _native_ok(*tensors: torch.Tensor) -> bool:
    return (
        cpu_native.available()
        and not torch.compiler.is_compiling()
        and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of two row-major 2-D tensors (unit-stride rows) intersect."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + ((a.shape[0] - 1) * a.stride(0) + a.shape[1]) * a.element_size()
    b1 = b0 + ((b.shape[0] - 1) * b.stride(0) + b.shape[1]) * b.element_size()
    return a0 < b1 and b0 < a1


def _pick(backend: str, ok: bool, what: str) -> bool:
    """Whether the native op runs; where the torch one will, calls recorded by
    ``cpu_native.deferred`` run first (it reads their outputs)."""
    if not _pick_native(backend, ok, what):
        cpu_native.flush()
        return False
    return True


def _pick_native(backend: str, ok: bool, what: str) -> bool:
    if backend == "torch":
        return False
    if backend == "cpu" and not ok:
        raise KernelConfigError(
            f"the native {what} needs the extension and bf16 CPU tensors with unit-stride, "
            "non-overlapping rows of a width that is a multiple of 16 (rotary: head dim a "
            "multiple of 32) and, for RMSNorm, a residual apart from x"
        )
    if backend not in ("auto", "cpu"):
        raise KernelConfigError(f"unknown backend {backend!r}: auto, torch or cpu")
    return ok


def rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    h = x.shape[-1]
    ok = (
        _native_ok(x, weight, *(() if residual is None else (residual,)))
        and x.dim() == 2
        and x.stride(1) == 1
        and h % 16 == 0
        and weight.shape == (h,)
        and weight.is_contiguous()
        and x.stride(0) >= h  # rows written in place must not overlap
        and (
            residual is None
            or (
                residual.shape == x.shape
                and residual.stride(1) == 1
                and residual.stride(0) >= h
                and not _overlap(x, residual)
            )
        )
    )
    if not _pick(backend, ok, "RMSNorm"):
        return rms_norm_torch(x, residual, weight, eps)
    if residual is None:
        out = torch.empty_like(x)
        res_ptr, res_stride = 0, 0
    else:
        out = x
        res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
    cpu_native.elementwise(
        OP_RMS_NORM, x.shape[0], h, x.data_ptr(), x.stride(0), res_ptr, res_stride,
        weight.data_ptr(), out.data_ptr(), out.stride(0), eps,
        keep=(x, residual, weight, out),
    )  # fmt: skip
    return out, residual


def silu_and_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    i = gate_up.shape[-1] // 2
    ok = (
        _native_ok(gate_up)
        and gate_up.dim() == 2
        and gate_up.stride(1) == 1
        and i % 16 == 0
        and gate_up.shape[-1] == 2 * i
    )
    if not _pick(backend, ok, "SiLU-and-mul"):
        return silu_and_mul_torch(gate_up)
    t = gate_up.shape[0]
    out = torch.empty((t, i), dtype=gate_up.dtype)
    cpu_native.elementwise(
        OP_SILU_MUL, t, i, gate_up.data_ptr(), gate_up.stride(0), 0, 0, 0, out.data_ptr(), i,
        keep=(gate_up, out),
    )  # fmt: skip
    return out


def rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    d = x.shape[-1]
    ok = (
        _native_ok(x, cos, sin)
        and x.dim() == 3
        and x.stride(2) == 1
        and d % 32 == 0
        and x.stride(1) >= d  # heads and rows rotated in place must not overlap
        and x.stride(0) >= (x.shape[1] - 1) * x.stride(1) + d
        and cos.shape == sin.shape == (x.shape[0], d // 2)
        and cos.is_contiguous()
        and sin.is_contiguous()
    )
    if not _pick(backend, ok, "rotary"):
        return rotary_torch(x, cos, sin)
    cpu_native.elementwise(
        OP_ROTARY, x.shape[0], d, x.data_ptr(), x.stride(0), cos.data_ptr(), d // 2,
        sin.data_ptr(), 0, 0, 0.0, x.shape[1], x.stride(1), keep=(x, cos, sin),
    )  # fmt: skip
    return x


def argmax_rows_torch(x: torch.Tensor) -> torch.Tensor:
    """The reference: ``torch.argmax`` over the last dim of a 2-D tensor."""
    return torch.argmax(x, dim=-1)


def argmax_rows_native_ok(x: torch.Tensor) -> bool:
    """Whether ``argmax_rows`` runs natively on ``x``: bf16 CPU, 2-D, non-empty unit-stride rows."""
    return _native_ok(x) and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1


def argmax_rows(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Each row's first index of its largest value (NaN above all) of a 2-D ``x``, int64."""
    ok = argmax_rows_native_ok(x)
    if not _pick(backend, ok, "argmax"):
        return argmax_rows_torch(x)
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        cpu_native.argmax_bf16(
            x.data_ptr(), rows, n, x.stride(0) if rows > 1 else n, out.data_ptr()
        )
    return out
