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
the weights in memory (the plain weight stays: transformers' modules share it). fp32 and fp16
weights, CUDA, and a compiled forward (inductor packs its own) keep ``F.linear``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn


def _linear(x: torch.Tensor, mod: MergedLinear | Linear) -> torch.Tensor:
    # is_compiling first: a traced forward never looks at the packed (mkldnn) tensor. One row
    # keeps F.linear: oneDNN takes another path for it, no faster packed, and not the same bits.
    if not torch.compiler.is_compiling() and mod.packed is not None and x.numel() > x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, mod.packed, mod.bias, "none", [], "")
    return F.linear(x, mod.weight, mod.bias)


def can_prepack() -> bool:
    """Whether this torch has oneDNN's packed linear (``KVCORE_PREPACK=0`` turns it off)."""
    if os.environ.get("KVCORE_PREPACK", "1") in ("0", ""):
        return False
    ops = torch.ops.mkldnn
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def prepack_linears(model: nn.Module) -> int:
    """Pack the weight of every ``Linear`` / ``MergedLinear`` of ``model`` that is bf16 on the
    CPU for oneDNN (see the module docstring); returns the bytes packed (0 when none or when
    ``can_prepack()`` is false). Packing again re-packs (after a weight changed)."""
    if not can_prepack():
        return 0
    total = 0
    for mod in model.modules():
        if not isinstance(mod, (MergedLinear, Linear)):
            continue
        w = mod.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2:
            mod.packed = None
            continue
        mod.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous())
        total += w.numel() * w.element_size()
    return total


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self)
