"""Gated activations on a fused gate-up projection's output ``[T, 2 * I] -> [T, I]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvcore_kernels import cpu_native, ops_cpu
from torch import nn


class ActAndMul(nn.Module):
    """``act(gate) * up`` where ``gate_up = [gate | up]`` (SiLU: Llama/Qwen; tanh-GELU: Gemma)."""

    FUNCTIONS = {
        "silu": F.silu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    }

    def __init__(self, name: str):
        super().__init__()
        if name not in self.FUNCTIONS:
            raise ValueError(f"activation {name!r} has no fused gate-up form here")
        self.name = name
        self.fn = self.FUNCTIONS[name]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":  # native in bf16 on a CPU (eager): one pass, no temporaries
            return ops_cpu.silu_and_mul(gate_up)
        cpu_native.flush()  # torch reads gate_up: calls recorded by cpu_native.deferred first
        gate, up = gate_up.chunk(2, dim=-1)
        return self.fn(gate) * up
