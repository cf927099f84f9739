"""RMSNorm, fused with the residual add that precedes it.

``norm(x, residual)`` returns ``(rms_norm(x + residual), x + residual)``: the block's two
residual adds become part of the next norm's call (vLLM's ``fused_add_rms_norm``), so a layer
reads ``h, res = norm(h, res)`` instead of keeping ``residual = h`` copies around.

Two weight conventions, both computed in float32 as the checkpoints' own code does:

* Llama/Qwen (``offset=0``): ``w * (x / rms(x))``;
* Gemma (``offset=1``): ``(1 + w) * (x / rms(x))``, the ``1 + w`` folded into the weight once at
  load time (``fold_offset``).

``F.rms_norm`` is one fused kernel on the CPU; in float32 it gives the bits of transformers'
unfused ``x * rsqrt(mean(x^2) + eps) * w`` (checked in tests/test_native_models.py). The
Llama/Qwen form is ``kvcore_kernels.ops_cpu.rms_norm``: in bf16 on a CPU (eager) one native
pass per row that also writes the residual sum, in place of the add, the casts and the product
(the caller's ``x`` and ``residual`` are overwritten: a layer never reads them again).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvcore_kernels import cpu_native, ops_cpu
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.dim = dim
        self.eps = float(eps)
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        # Gemma: the effective fp32 weight (1 + w), made by fold_offset after loading
        self.register_buffer("w32", None, persistent=False)

    def fold_offset(self) -> None:
        """After loading: Gemma's ``1 + w`` in float32 (what its forward computes every call)."""
        if self.offset:
            self.w32 = self.offset + self.weight.data.float()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.offset:  # Llama/Qwen: the kernels' formulation (native in bf16 on a CPU)
            out, res = ops_cpu.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, res)
        cpu_native.flush()  # torch reads x: calls recorded by cpu_native.deferred run first
        if residual is not None:
            x = x + residual
            residual = x
        # Gemma: (x / rms(x)) * (1 + w) in fp32, then cast
        out = F.rms_norm(x.float(), (self.dim,), self.w32, self.eps).to(x.dtype)
        return out if residual is None else (out, residual)
