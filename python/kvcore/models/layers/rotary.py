"""Rotary position embedding (RoPE), computed once per step for the step's positions.

``Rotary.cos_sin(positions, dtype)`` gives the step's ``cos, sin`` ``[num_tokens, head_dim/2]``
once; every layer then rotates its query and key heads with them (transformers recomputes them
per forward too, but rotates with ``rotate_half``: a negation and two concatenations per tensor).
Here the two halves are rotated directly, the same products and sums as ``rotate_half``'s::

    x = [x1 | x2]  (head_dim/2 each)
    out = [x1*cos - x2*sin | x2*cos + x1*sin]

Query and key heads are rotated in one call: the fused QKV output's first ``Hq + Hk`` heads.

The inverse frequencies and the attention scaling are those of the transformers model the weights
come from (``rotary_from``), so every static RoPE variant (default, linear, llama3, yarn) is the
one its reference code computes; position-dependent ones (``dynamic``, ``longrope``) are refused.
"""

from __future__ import annotations

import torch
from kvcore_kernels import ops_cpu
from torch import nn


class Rotary(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        # a plain attribute, not a buffer: a module-wide .to(bfloat16) must not round it
        self.inv_freq = inv_freq.detach().float().clone()
        self.attention_scaling = float(attention_scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``cos, sin`` [T, D/2] in ``dtype`` (float32 math, then cast, as transformers does)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] (any view with unit stride on D) by ``cos, sin`` [T, D/2]; in bf16
    on a CPU (eager) in place by one native pass (the twin's bits), so callers use the result
    and never ``x`` again."""
    return ops_cpu.rotary_(x, cos, sin)


STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # no per-length update


def rotary_from(rotary_emb: nn.Module, layer_type: str | None = None) -> Rotary:
    """The ``Rotary`` of a transformers rotary module (its own ``inv_freq`` and scaling, per
    layer type for Gemma 3), or ValueError for a RoPE that changes with the sequence length."""
    rope_type = rotary_emb.rope_type
    if isinstance(rope_type, dict):  # Gemma 3: one per layer type
        rope_type = rope_type[layer_type]
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"RoPE type {rope_type!r} changes with the length: not supported")
    prefix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(rotary_emb, f"{prefix}inv_freq")
    scaling = getattr(rotary_emb, f"{prefix}attention_scaling")
    return Rotary(inv_freq, scaling)
