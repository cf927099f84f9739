"""Paged attention for a whole step: the entry point, which picks the cache layout's variant.

One call serves prefill, chunked prefill, prefix hits (queries starting deep into the sequence,
mid-block), decode and any mix of them: query token ``i`` of request ``r`` sits at position
``seq_len - q_len + i`` and attends causally to its request's keys through the block table.

Scores, in this order (all optional features off by default)::

    s = scale * q.k
    s = soft_cap * tanh(s / soft_cap)             if soft_cap
    s = s + slope[head] * (k_pos - q_pos)         if alibi_slopes  (<= 0: farther is lower)
    masked out: k_pos > q_pos, and q_pos - k_pos >= sliding_window if sliding_window
    masked out: keys of released blocks (block table entry 0 inside the sequence, ``plan``)

``block_mass`` (H2O's accumulated attention, optional): a float32 ``[num_reqs, max_blocks]``
tensor (the block table's shape) to which the call *adds*, per request and logical block, the
attention probability its keys received in this call, summed over query heads and the step's
query rows. Pass one tensor to every layer of a step to sum over layers (what
``kvcore.eval_retention`` does), or one per layer. Off (None), the call costs what it did.
"""

from __future__ import annotations

import functools

import torch

from kvcore_kernels.cache import check_backend, check_kv_cache
from kvcore_kernels.plan import AttentionMetadata


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    block_mass: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a step's packed queries ``[num_tokens, num_q_heads, head_dim]`` over the cache.

    Returns ``out`` (allocated if None), same shape and dtype as ``query``. GQA/MQA follow from
    the head counts. ``backend``: "auto" (Triton on CUDA; on the CPU the native kernel,
    ``attention_cpu``, where it serves the call, else the torch twin), "triton", "torch", "cpu"
    (the native kernel, the twin for what it does not serve: ``attention_cpu.supports``).
    Raises ``KernelConfigError`` for inputs or feature combinations it does not support.
    A ``kvcore_kernels.quant.QuantKVCache`` is dequantized as it is loaded
    (``paged_attention_quant``, same contract; ``block_mass`` on plain caches only). The
    backends take these keywords as ``**options`` (``checks.check_attention_call``).
    """
    options = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                   alibi_slopes=alibi_slopes, out=out, block_mass=block_mass)  # fmt: skip
    if not isinstance(kv_cache, torch.Tensor):
        quant_cache, paged_attention_quant = _quant()
        if isinstance(kv_cache, quant_cache):
            return paged_attention_quant(query, kv_cache, meta, backend=backend, **options)
    check_kv_cache(kv_cache)
    resolved = check_backend(backend, kv_cache.device)
    if resolved == "triton":
        from kvcore_kernels.attention_triton import paged_attention_triton as run
    else:
        from kvcore_kernels import attention_cpu
        from kvcore_kernels.attention_torch import paged_attention_torch as run

        native = resolved == "cpu" or (backend == "auto" and kv_cache.device.type == "cpu")
        if native and attention_cpu.supports(kv_cache, block_mass):
            run = attention_cpu.paged_attention_cpu
    return run(query, kv_cache, meta, **options)


@functools.cache
def _quant():
    """``QuantKVCache`` and ``paged_attention_quant``, imported on the first quantized call
    (an import statement per call cost ~1 us each)."""
    from kvcore_kernels.quant.attention import paged_attention_quant
    from kvcore_kernels.quant.cache import QuantKVCache

    return QuantKVCache, paged_attention_quant
