"""MLA (DeepSeek's Multi-head Latent Attention): the paged latent cache, its store and attention.

One latent row per token (``cache`` module doc: ``[num_blocks, block_size, kv_lora_rank +
rope_dim]``, or the FP8 row layout). ``store_latent`` writes a step's latents, ``mla_attention``
attends over them in absorbed form, with the plain kernels' per-step ``plan_attention``
metadata. Modules, bottom to top: ``cache`` (layout, allocation, checks), ``attention_torch`` /
``attention_triton`` (backends: store and attention each), ``attention`` (the dispatcher).
The ``kvcore_kernels`` namespace re-exports the public names.
"""

from kvcore_kernels.mla.attention import mla_attention, store_latent
from kvcore_kernels.mla.attention_torch import mla_attention_torch, store_latent_torch
from kvcore_kernels.mla.cache import (
    allocate_latent_cache,
    allocate_latent_fp8_cache,
    fp8_row_bytes,
    latent_bytes_per_token,
)

__all__ = [
    "allocate_latent_cache",
    "allocate_latent_fp8_cache",
    "fp8_row_bytes",
    "latent_bytes_per_token",
    "mla_attention",
    "mla_attention_torch",
    "store_latent",
    "store_latent_torch",
]
