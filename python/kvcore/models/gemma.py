"""kvcore's Gemma decoder: Gemma 2 and Gemma 3 (text).

Gemma's block differs from Llama's in its norms and scalings (all from the config):

* four RMSNorms per layer, each ``(1 + w) * x / rms(x)`` in float32 (``RMSNorm(offset=1)``): the
  attention and MLP outputs are normalised again before they join the residual;
* the embedding is scaled by ``sqrt(hidden)`` (rounded to the model dtype, as the reference);
* attention scale ``query_pre_attn_scalar ** -0.5``; tanh-GELU gate;
* Gemma 2: attention logit soft-capping and final logit soft-capping; alternating windows;
* Gemma 3: per-head q/k RMSNorms, local layers' RoPE theta (10k) apart from the global layers'
  (1M): both cos/sin pairs are computed once per step, each layer takes its type's pair.

A decoder layer (packed tokens ``T``, hidden ``E``)::

    h, res = input_layernorm(h, res)               # res += h; h = norm(res)      [T, E]
    qkv = qkv_proj(h)                              # one GEMM               [T, (Hq+2Hk)*D]
    q, k = rope(q_norm(q), k_norm(k))              # Gemma 3 norms q and k        [T, H, D]
    h = o_proj(attn(q, k, v))                      # paged attention              [T, E]
    h = post_attention_layernorm(h)
    h, res = pre_feedforward_layernorm(h, res)
    h = post_feedforward_layernorm(down_proj(gelu(gate) * up))

The last layer runs its o_proj and MLP on the sampled rows only (``keep``), as ``llama.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvcore.models.layers.activation import ActAndMul
from kvcore.models.layers.attention import Attention, StepAttention
from kvcore.models.layers.linear import Linear, MergedLinear, gate_up_act
from kvcore.models.layers.norm import RMSNorm
from kvcore.models.layers.rotary import Rotary, apply_rotary, rotary_from
from kvcore.models.llama import STACKED
from kvcore.models.windows import layer_windows

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, window: int | None):
        super().__init__()
        hq, hk = config.num_attention_heads, config.num_key_value_heads
        d = config.head_dim
        self.hq, self.hk, self.d = hq, hk, d
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedLinear(config.hidden_size, [hq * d, hk * d, hk * d], bias=bias)
        self.o_proj = Linear(hq * d, config.hidden_size, bias=bias)
        qk_norm = config.model_type == "gemma3_text"
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(d, eps, offset=1.0) if qk_norm else None
        self.k_norm = RMSNorm(d, eps, offset=1.0) if qk_norm else None
        softcap = getattr(config, "attn_logit_softcapping", None)
        self.attn = Attention(layer_idx, config.query_pre_attn_scalar**-0.5, window, softcap)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepAttention,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hq, hk, d = self.hq, self.hk, self.d
        qkv = self.qkv_proj(h)  # [T, (Hq + 2Hk) * D]
        v = qkv[:, (hq + hk) * d :].unflatten(1, (hk, d))
        if self.q_norm is None:  # Gemma 2: rotate q and k heads in one go
            qk = apply_rotary(qkv[:, : (hq + hk) * d].unflatten(1, (hq + hk, d)), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, : hq * d].unflatten(1, (hq, d))), cos, sin)
            k = apply_rotary(
                self.k_norm(qkv[:, hq * d : (hq + hk) * d].unflatten(1, (hk, d))), cos, sin
            )
        o = self.attn(q, k, v, step).flatten(1)  # [T, Hq * D]: every row's K/V is stored
        if keep is not None:  # last layer: only the sampled rows go on
            o = o.index_select(0, keep)
        return self.o_proj(o)


class GemmaMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [i, i])
        self.act = ActAndMul(config.hidden_activation)
        self.down_proj = Linear(i, config.hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_act(self.gate_up_proj, self.act, h))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, window: int | None):
        super().__init__()
        e, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = SLIDING if window else FULL
        self.input_layernorm = RMSNorm(e, eps, offset=1.0)
        self.self_attn = GemmaAttention(config, layer_idx, window)
        self.post_attention_layernorm = RMSNorm(e, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(e, eps, offset=1.0)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(e, eps, offset=1.0)

    def forward(
        self,
        h: torch.Tensor,
        res: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepAttention,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``keep`` (the last layer only): the sampled rows, as ``LlamaDecoderLayer``."""
        if res is None:
            res, h = h, self.input_layernorm(h)
        else:
            h, res = self.input_layernorm(h, res)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, step, keep))
        if keep is not None:
            res = res.index_select(0, keep)
        h, res = self.pre_feedforward_layernorm(h, res)
        return self.post_feedforward_layernorm(self.mlp(h)), res


class GemmaModel(nn.Module):
    def __init__(self, config: Any, rotaries: dict[str, Rotary]):
        super().__init__()
        windows = layer_windows(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, w) for i, w in enumerate(windows))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)
        self.rotaries = nn.ModuleDict(rotaries)  # layer type -> Rotary (one entry for Gemma 2)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepAttention,
        keep: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden state and residual of the ``keep`` rows [K, E]."""
        h = self.embed_tokens(input_ids) * self.normalizer.to(self.embed_tokens.weight.dtype)
        tables = {t: r.cos_sin(positions, h.dtype) for t, r in self.rotaries.items()}  # per step
        res = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            cos, sin = tables.get(layer.layer_type) or tables[FULL]
            h, res = layer(h, res, cos, sin, step, keep if i == last else None)
        return h, res


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text on packed tokens; ``forward`` returns the kept logits."""

    stacked = STACKED

    def __init__(self, config: Any, rotaries: dict[str, Rotary]):
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, rotaries)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def from_hf(cls, hf_model: Any) -> GemmaForCausalLM:
        emb = hf_model.model.rotary_emb
        if isinstance(emb.rope_type, dict):  # Gemma 3: one RoPE per layer type
            rotaries = {t: rotary_from(emb, t) for t in emb.rope_type}
        else:
            rotaries = {FULL: rotary_from(emb)}
        return cls(hf_model.config, rotaries)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        keep: torch.Tensor,  # int64 [K]
        step: StepAttention,
    ) -> torch.Tensor:
        h, res = self.model(input_ids, positions, step, keep)  # [K, E]
        h, _ = self.model.norm(h, res)
        logits = self.lm_head(h)  # [K, vocab]
        if self.final_softcap:
            cap = self.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
