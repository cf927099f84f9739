"""Linear layers whose weight is several checkpoint projections stacked along the output dim.

``MergedLinear([q, k, v])`` holds ``W = cat(W_q, W_k, W_v)`` ``[q + k + v, in]``: one GEMM per
block instead of three (and ``gate_up``: one instead of two). The checkpoint's shards are loaded
into their row ranges by ``load_shard``::

    rows  0 ........ q | q ...... q+k | q+k ...... q+k+v
          W_q            W_k            W_v
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    """``y = x @ cat(W_0..W_n).T (+ b)``; ``split(y)`` gives the per-shard outputs as views."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes) + 1)]
        out = self.offsets[-1]
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

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
        return F.linear(x, self.weight, self.bias)


class Linear(nn.Module):
    """A plain linear (o_proj, down_proj, lm_head); the weight may be shared with the source."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
