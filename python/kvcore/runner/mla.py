"""MLA serving: DeepSeek-V2/V3 attention on kvcore's paged latent cache.

transformers' DeepSeek attention caches the compressed latent but then up-projects every cached
token to per-head K and V on every step (its attention interface takes K and V). kvcore instead
replaces each layer's ``self_attn`` at load time (the model file is untouched) with
``MLAAttention``, which shares the original's projections and:

1. computes the queries (``q_proj``, or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), the
   latent ``c_kv`` (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm``) and ``k_pe``, and applies the
   model's own RoPE function to ``q_pe`` and ``k_pe`` (so interleaved or not, YaRN or not, the
   rotation is bit-for-bit the model's);
2. writes ``[c_kv | k_pe]`` to the layer's latent cache (``kvcore_kernels.store_latent``);
3. attends with ``kvcore_kernels.mla_attention``: ``W_uk`` folded into the query and ``W_uv``
   applied to the latent output (decode never builds per-head K or V), long prefill chunks
   up-projected when that is cheaper; the softmax scale is the module's own ``scaling`` (YaRN's
   ``mscale`` included);
4. ``o_proj``.

Without kvcore's step context (e.g. transformers' ``generate`` on the same model object) the
module runs the original attention, so peers can share the model.

Cache layout, per layer: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` in the
model dtype (``kvcore_kernels.mla.cache``). Which configs are MLA, their latent dims and the
refused features are ``kvcore.models.mla``; bytes per block are ``kvcore.models.sizes``.
"""

from __future__ import annotations

import sys
from typing import Any

import kvcore_kernels
import torch
from kvcore_kernels.errors import KernelConfigError

from kvcore.errors import InvalidArgumentError
from kvcore.models.mla import check_mla_config, latent_dims
from kvcore.runner.attention import CTX_KWARG, AttentionContext

_PROJECTIONS = (
    "q_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
)


def allocate_latent_caches(
    config: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    formats: list[str] | None = None,
) -> list[torch.Tensor]:
    """One zeroed latent cache per layer (uint8 FP8 rows for an ``fp8_e4m3`` layer)."""
    num_layers, r, rope = latent_dims(config)
    return [
        kvcore_kernels.allocate_latent_fp8_cache(num_blocks, block_size, r, rope, device)
        if f == "fp8_e4m3"
        else kvcore_kernels.allocate_latent_cache(num_blocks, block_size, r, rope, dtype, device)
        for f in formats or ["auto"] * num_layers
    ]


def _rope_fn(attn: torch.nn.Module) -> Any:
    """The model file's own RoPE function for this attention module."""
    mod = sys.modules[type(attn).__module__]
    if attn.config.model_type == "deepseek_v2":
        return mod.apply_rotary_emb  # (q, k, freqs_cis)
    if getattr(attn.config, "rope_interleave", False):
        return mod.apply_rotary_pos_emb_interleave  # (q, k, cos, sin)
    return mod.apply_rotary_pos_emb


class MLAAttention(torch.nn.Module):
    """Drop-in ``self_attn`` of a DeepSeek-V2/V3 layer that runs on kvcore's latent cache."""

    def __init__(self, attn: torch.nn.Module):
        super().__init__()
        for name in _PROJECTIONS:  # the same modules under the same names: state_dict unchanged
            setattr(self, name, getattr(attn, name, None))
        object.__setattr__(self, "_original", attn)  # not a child: its parameters are ours
        self.config = attn.config
        self.layer_idx = attn.layer_idx
        self.num_heads = attn.num_heads
        self.nope = attn.qk_nope_head_dim
        self.rope = attn.qk_rope_head_dim
        self.v_dim = attn.v_head_dim
        self.rank = attn.kv_lora_rank
        self.scaling = float(attn.scaling)
        self._rope_fn = _rope_fn(attn)
        self._is_v2 = attn.config.model_type == "deepseek_v2"
        self._weights: tuple[Any, torch.Tensor, torch.Tensor] | None = None

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_uk [H, nope, r], W_uv [H, v, r])`` from ``kv_b_proj``, rebuilt if it changed."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version, w.device, w.dtype)
        if self._weights is None or self._weights[0] != key:
            per_head = w.detach().view(self.num_heads, self.nope + self.v_dim, self.rank)
            w_uk = per_head[:, : self.nope].contiguous()
            w_uv = per_head[:, self.nope :].contiguous()
            self._weights = (key, w_uk, w_uv)
        return self._weights[1], self._weights[2]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        ctx = kwargs.get(CTX_KWARG)
        if ctx is None:  # not a kvcore step: the model's own attention (e.g. generate)
            return self._original(
                hidden_states,
                attention_mask=attention_mask,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        if not isinstance(ctx, AttentionContext) or hidden_states.shape[0] != 1:
            raise InvalidArgumentError("MLA attention expects kvcore's step context and one row")
        x = hidden_states[0]  # [T, hidden]
        tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        c_kv, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [self.rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        # The model's RoPE on its own 4-D shapes: q [1, H, T, rope], k [1, 1, T, rope].
        q4, k4 = q_pe.transpose(0, 1)[None], k_pe[None, None]
        if self._is_v2:
            q4, k4 = self._rope_fn(q4, k4, position_embeddings)
        else:
            q4, k4 = self._rope_fn(q4, k4, *position_embeddings)
        q_pe = q4[0].transpose(0, 1)  # [T, H, rope]
        k_pe = k4[0, 0].contiguous()  # [T, rope]
        cache = ctx.kv_caches[self.layer_idx]
        kvcore_kernels.store_latent(
            c_kv.contiguous(), k_pe, cache, ctx.slot_mapping, backend=ctx.backend
        )
        w_uk, w_uv = self.absorbed_weights()
        out = kvcore_kernels.mla_attention(
            q_nope,
            q_pe.contiguous() if q_pe.stride(-1) != 1 else q_pe,
            cache,
            ctx.meta,
            w_uk=w_uk,
            w_uv=w_uv,
            scale=self.scaling,
            backend=ctx.backend,
        )  # [T, H, v]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))[None], None


def install_mla(model: Any) -> int:
    """Replace every decoder layer's ``self_attn`` with ``MLAAttention`` (idempotent);
    returns how many layers were replaced now."""
    check_mla_config(model.config)
    replaced = 0
    for layer in model.model.layers:
        if isinstance(layer.self_attn, MLAAttention):
            continue
        for name in ("kv_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj"):
            if getattr(layer.self_attn, name, None) is None:
                raise InvalidArgumentError(
                    f"MLA model: layer {layer.self_attn.layer_idx} has no {name} (not DeepSeek MLA)"
                )
        layer.self_attn = MLAAttention(layer.self_attn)
        replaced += 1
    return replaced


def check_runner_args(config: Any, kv_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
    """The latent cache holds the model's own dtype (the kernels take one dtype)."""
    if kv_dtype != model_dtype:
        raise KernelConfigError(
            f"MLA latent cache dtype {kv_dtype} must equal the model dtype {model_dtype}"
        )
