"""MLA (latent cache) entry points: pick a backend and call it. The top layer of ``mla``.

Layers (each imports only from those below it, never a private name)::

    mla.attention         store_latent, mla_attention            (this dispatcher)
    mla.attention_torch   store_latent_torch, mla_attention_torch
    mla.attention_triton  store_latent_triton, mla_attention_triton (same contract)
    mla.cache             layout, allocation, argument checks, absorb/unabsorb helpers
    errors, cache (backend choice), plan (AttentionMetadata)

The metadata is the plain kernels' ``plan_attention`` output: one plan per step serves plain,
quantized and latent caches alike.
"""

from __future__ import annotations

import torch

from kvcore_kernels.cache import check_backend
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.mla.attention_torch import mla_attention_torch, store_latent_torch
from kvcore_kernels.plan import AttentionMetadata


def store_latent(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Write a step's latents (``c_kv`` [T, r], ``k_pe`` [T, rope]) into ``cache`` in place.

    Slots in the null block and negative slots (padding) are skipped."""
    if not isinstance(cache, torch.Tensor):
        raise KernelConfigError(f"latent cache must be a torch.Tensor, got {type(cache).__name__}")
    if backend == "auto" and cache.dtype == torch.uint8:
        backend = "torch"  # FP8 latents: the Triton kernels do not write them yet
    if check_backend(backend, cache.device) == "triton":
        from kvcore_kernels.mla.attention_triton import store_latent_triton

        store_latent_triton(c_kv, k_pe, cache, slot_mapping)
    else:
        store_latent_torch(c_kv, k_pe, cache, slot_mapping)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """MLA over the paged latent cache for a whole step (prefill, chunked prefill, prefix hits,
    decode, mixed); returns ``out`` [T, H, v_dim], what goes into ``o_proj``.

    ``q_nope`` [T, H, nope] and ``q_pe`` [T, H, rope] (after RoPE) are the model's queries;
    ``w_uk`` [H, nope, r] and ``w_uv`` [H, v_dim, r] the per-head slices of ``kv_b_proj``.
    Decode always runs the absorbed form; the torch twin up-projects long prefill chunks when
    that is cheaper (see ``mla.attention_torch``). Raises ``KernelConfigError`` on bad input."""
    if not isinstance(cache, torch.Tensor):
        raise KernelConfigError(f"latent cache must be a torch.Tensor, got {type(cache).__name__}")
    if getattr(meta, "num_released", 0):
        raise KernelConfigError(
            "released blocks (null block-table entries) are not supported by MLA attention"
        )
    if backend == "auto" and cache.dtype == torch.uint8:
        backend = "torch"  # FP8 latents: the Triton kernels do not read them yet
    if check_backend(backend, cache.device) == "triton":
        from kvcore_kernels.mla.attention_triton import mla_attention_triton as run
    else:
        run = mla_attention_torch
    return run(q_nope, q_pe, cache, meta, w_uk=w_uk, w_uv=w_uv, scale=scale, out=out)
