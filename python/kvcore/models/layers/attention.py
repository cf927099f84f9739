"""The attention layer: one call per layer with the step's metadata.

The model knows nothing of caches or steps: its forward receives a ``StepAttention`` from the
runner (``kvcore.runner.native``), and each layer hands it its packed query/key/value with its
own constants (scale, window, soft-cap). The runner's implementation stores K/V into the layer's
paged cache and runs ``kvcore_kernels.paged_attention`` (or the custom op
``kvcore::paged_attention`` when compiled)::

    q [T, Hq, D], k/v [T, Hk, D]  (unit-stride views of the fused QKV output)
    -> out [T, Hq, D]
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class StepAttention(Protocol):
    """What the runner passes to a forward: paged attention of one layer over the step."""

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
    ) -> torch.Tensor: ...


class Attention(nn.Module):
    """Per-layer constants of the paged attention call (no weights)."""

    def __init__(
        self,
        layer_idx: int,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = float(scale)
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepAttention
    ) -> torch.Tensor:
        return step(self.layer_idx, q, k, v, self.scale, self.sliding_window, self.soft_cap)
