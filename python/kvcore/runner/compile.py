"""The compiled forward: ``torch.compile`` (inductor) over the unmodified transformers model.

The model runs with kvcore's attention through the custom op ``torch.ops.kvcore.paged_attention``
(``kvcore.runner.attention_op``), so dynamo traces everything else (embedding, RMSNorm, RoPE,
the MLP's SiLU-multiply, the LM head) into one graph that inductor fuses, with one opaque node per
layer for the cache write and the paged attention.

Shapes: every step packs a different number of tokens (and requests, and block-table columns),
so those dimensions are marked dynamic before each call and one graph serves all sizes. torch
still specialises a dimension of size 1 (a step with one token or one request compiles once
more), so a run compiles about two graphs; ``CompileStats`` counts them.

Compiled code is cached on disk (inductor's FX graph cache and AOTAutograd cache, both on by
default) under kvcore's cache directory (``$KVCORE_CACHE_DIR/inductor``; an explicit
``TORCHINDUCTOR_CACHE_DIR`` wins), so a second start of the same model only re-traces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class CompileStats:
    """Graphs compiled and seconds spent in calls that compiled (first calls of a shape)."""

    graphs: int = 0
    compile_seconds: float = 0.0


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (all models; take differences)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_model(model: Any, backend: str = "inductor") -> Any:
    """``torch.compile(model)``: inductor by default (``backend="aot_eager"`` traces and
    functionalises without generating code, which is what quick tests use)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # persistent, beside the converted models
        from kvcore.models.loader import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    # A compiled graph per dynamic shape family; steps vary in size, so allow a few.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    return torch.compile(model, backend=backend, dynamic=None, fullgraph=False)


def mark_step_dynamic(*tensors_and_dims: tuple[torch.Tensor | None, tuple[int, ...]]) -> None:
    """Mark the step-size dimensions dynamic (no error where torch specialises a size 1)."""
    for t, dims in tensors_and_dims:
        if t is not None:
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
