"""kvcore_kernels: paged KV-cache kernels (Triton) and their pure-torch twins.

Knows nothing of kvcore: it takes tensors, block tables, slot mappings and sequence metadata.
The cache layout is documented once, in ``kvcore_kernels.cache``::

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 1: 0 = K, 1 = V)

Per step: ``store_kv`` writes the new tokens' K/V; ``plan_attention`` builds the metadata every
layer shares; per layer ``paged_attention`` runs. ``backend="auto"`` picks Triton on CUDA and the
torch twin elsewhere; ``*_torch`` / ``*_triton`` name one explicitly (same signatures; the
Triton ones import triton on first access, so this package imports without it).

DeepSeek-style MLA caches one latent per token (subpackage ``mla``; ``mla.cache``:
``[num_blocks, block_size, kv_lora_rank + rope_dim]``): ``store_latent`` writes it,
``mla_attention`` attends over it (absorbed form), with the same per-step ``plan_attention``
metadata.
"""

from kvcore_kernels.attention import paged_attention
from kvcore_kernels.attention_torch import paged_attention_torch
from kvcore_kernels.cache import NULL_BLOCK, allocate_kv_cache
from kvcore_kernels.device import normalize_device
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.mla.attention import mla_attention, store_latent
from kvcore_kernels.mla.attention_torch import mla_attention_torch, store_latent_torch
from kvcore_kernels.mla.cache import (
    allocate_latent_cache,
    allocate_latent_fp8_cache,
    latent_bytes_per_token,
)
from kvcore_kernels.plan import AttentionMetadata, plan_attention
from kvcore_kernels.store import store_kv
from kvcore_kernels.store_torch import store_kv_torch

__version__ = "0.1.0"

_LAZY = {
    "paged_attention_triton": "kvcore_kernels.attention_triton",
    "store_kv_triton": "kvcore_kernels.store_triton",
    "mla_attention_triton": "kvcore_kernels.mla.attention_triton",
    "store_latent_triton": "kvcore_kernels.mla.attention_triton",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvcore_kernels' has no attribute {name!r}")


__all__ = [
    "__version__",
    "NULL_BLOCK",
    "AttentionMetadata",
    "KernelConfigError",
    "allocate_kv_cache",
    "allocate_latent_cache",
    "allocate_latent_fp8_cache",
    "latent_bytes_per_token",
    "mla_attention",
    "mla_attention_torch",
    "mla_attention_triton",
    "paged_attention",
    "paged_attention_torch",
    "paged_attention_triton",
    "plan_attention",
    "store_kv",
    "store_kv_torch",
    "store_kv_triton",
    "store_latent",
    "store_latent_torch",
    "store_latent_triton",
    "normalize_device",
]
