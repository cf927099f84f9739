"""Quantized KV storage: formats, quantizing store, dequantizing paged attention.

Formats (``FORMATS``): ``auto`` (model dtype), ``fp8_e4m3`` / ``fp8_e5m2`` (per-head scale;
``*_tensor``: per-tensor), ``int8``, ``int4``, ``int2`` (plain per-token 2-bit) and ``kivi2`` /
``kivi4``. Byte layouts and metadata choices: ``kvcore_kernels.quant.formats``.

    caches = allocate_kv_caches("int8", num_layers, num_blocks, block_size, H, D, dtype, device)
    store_kv_quant(k, v, caches[layer], slot_mapping)          # quantize on write
    out = paged_attention_quant(q, caches[layer], meta, scale=...)   # dequantize on load
    copy_blocks(caches, src, dst)                              # copy-on-write, scales included

``allocate_kv_caches`` takes one format or one per layer and returns plain tensors for "auto"
layers (served by ``store_kv`` / ``paged_attention``), so a mixed list works unchanged.
"""

from kvcore_kernels.quant.attention import paged_attention_quant
from kvcore_kernels.quant.blocks import copy_blocks
from kvcore_kernels.quant.cache import QuantKVCache, allocate_kv_caches, resolve_formats
from kvcore_kernels.quant.formats import (
    FORMATS,
    KVFormat,
    block_layout,
    bytes_per_token,
    check_format,
    get_format,
)
from kvcore_kernels.quant.read_torch import read_tokens
from kvcore_kernels.quant.store import store_kv_quant

__all__ = [
    "FORMATS",
    "KVFormat",
    "QuantKVCache",
    "allocate_kv_caches",
    "block_layout",
    "bytes_per_token",
    "check_format",
    "copy_blocks",
    "get_format",
    "paged_attention_quant",
    "read_tokens",
    "resolve_formats",
    "store_kv_quant",
]
