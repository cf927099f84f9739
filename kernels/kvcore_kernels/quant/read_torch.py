"""Torch decode of whole blocks of a quantized cache (the attention twin's loader, and tests')."""

from __future__ import annotations

import torch

from kvcore_kernels.quant.cache import QuantKVCache
from kvcore_kernels.quant.codecs import decode_tokens, kivi_decode_blocks
from kvcore_kernels.quant.formats import token_regions


def read_tokens(cache: QuantKVCache, blocks: torch.Tensor, which: int) -> torch.Tensor:
    """Decode K (0) or V (1) of whole blocks: float32 ``[n, bs, H, D]`` (test and twin helper),
    in the stored basis (``cache.rotate_out`` undoes a rotation). KIVI blocks held in the
    residual are read from it (model dtype), as attention does.
    """
    parts = cache.read_blocks(blocks)
    if cache.fmt.kind == "kivi":
        out = kivi_decode_blocks(cache.fmt, parts, which)
        assert cache.residual is not None and cache.residual_state is not None
        stage = cache.residual_state.device_map.index_select(0, blocks).to(torch.int64)
        staged = torch.nonzero(stage >= 0).squeeze(1)
        if staged.numel():
            rows = cache.residual[:, which].index_select(0, stage[staged]).float()
            out.index_copy_(0, staged, rows)
        return out
    n, bs = blocks.numel(), cache.block_size
    flat = {}
    for part, (name, per_kv) in token_regions(cache.fmt, which).items():
        t = parts[name][:, which] if per_kv else parts[name]  # [n, bs, H, ...]
        flat[part] = t.reshape(n * bs, *t.shape[2:])
    scale = cache.fp8_scale[which] if cache.fp8_scale is not None else None
    out = decode_tokens(cache.fmt, flat, scale, which)
    return out.view(n, bs, cache.num_kv_heads, cache.head_dim)
