"""KV sizes of a transformers config: geometry, bytes per block, KIVI residual slots.

Re-exported by ``kvcore.runner.model_runner`` (where the engine and the planner tests import them).
"""

from __future__ import annotations

from typing import Any

import torch
from kvcore_kernels.quant import block_layout
from kvcore_kernels.quant import get_format as get_kv_format

from kvcore.runner.mla import check_mla_config, is_mla_config, latent_bytes_per_block


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers decoder config."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def kv_bytes_per_block(
    config: Any, block_size: int, dtype: torch.dtype, formats: list[str] | None = None
) -> int:
    """Bytes one block of KV takes over all layers (K and V): ``dtype`` for model-dtype layers,
    the format's block row (codes and scales) for quantized ones; an MLA model's latent rows."""
    if is_mla_config(config):  # c_kv + k_pe per token and layer (kvcore.runner.mla)
        check_mla_config(config, formats)
        return latent_bytes_per_block(config, block_size, dtype, formats)
    num_layers, num_kv_heads, head_dim = kv_geometry(config)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    plain = 2 * block_size * num_kv_heads * head_dim * itemsize
    total = 0
    for name in formats or ["auto"] * num_layers:
        fmt = get_kv_format(name)
        quantized = fmt.quantized
        total += (
            block_layout(fmt, block_size, num_kv_heads, head_dim).block_bytes
            if quantized
            else plain
        )
    return total


def kivi_residual_slots(
    max_num_seqs: int, max_num_batched_tokens: int, block_size: int, window: int = 0
) -> int:
    """KIVI residual slots the engine allocates: every block one step can write gets one,
    plus each running sequence's ``window`` recent full blocks.

    A step writes at most ``max_num_batched_tokens`` tokens for at most ``max_num_seqs``
    sequences; each sequence's span touches at most ``ceil(q / bs) + 1`` blocks, so the step
    writes at most ``2 * max_num_seqs + ceil(T / bs)`` blocks (and never more than T).
    Between steps a slot holds a running sequence's partial last block (KIVI's residual).
    """
    per_step = 2 * max_num_seqs + -(-max_num_batched_tokens // block_size)
    return min(max_num_batched_tokens, per_step) + max_num_seqs * window


def kivi_residual_bytes(
    config: Any, block_size: int, dtype: torch.dtype, formats: list[str], slots: int
) -> int:
    """Bytes of KIVI's model-dtype residual pool: ``slots`` blocks in every KIVI layer."""
    _, num_kv_heads, head_dim = kv_geometry(config)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    kivi_layers = sum(get_kv_format(name).kind == "kivi" for name in formats)
    return kivi_layers * slots * 2 * block_size * num_kv_heads * head_dim * itemsize
