"""kvcore's Llama-family decoder: Llama (SmolLM2), Mistral, Qwen2, Qwen3.

The four share one block; what differs is read from the config (``LlamaSpec``):

===========  ===========================================================================
llama        ``attention_bias`` on q/k/v/o, ``mlp_bias``; full attention (SmolLM2)
mistral      every layer windowed (``sliding_window``)
qwen2        bias on q/k/v only; per-layer windows from ``layer_types``
qwen3        per-head RMSNorm on q and k before RoPE; per-layer windows
===========  ===========================================================================

A decoder layer, packed tokens ``T`` (the step's every request in one row), hidden ``E``::

    h, res = input_layernorm(h, res)       # res += h; h = rmsnorm(res)          [T, E]
    qkv = qkv_proj(h)                      # one GEMM                             [T, (Hq+2Hk)*D]
    q, k = rope(q, k)                      # cos/sin computed once per step       [T, H, D]
    o = attn(q, k, v)                      # store K/V, paged attention           [T, Hq, D]
    h = o_proj(o)                                                                 [T, E]
    h, res = post_attention_layernorm(h, res)
    h = down_proj(silu(gate) * up)         # gate_up_proj: one GEMM              [T, E]

The residual add lives in the next norm's call (``layers.norm``); the LM head runs on the
sampled rows only (``keep``), and so do the last layer's o_proj and MLP: its attention stores
every row's K/V, after that only the sampled rows matter (llama.cpp's ``inp_out_ids``). Weights
come from the transformers model (``load_from``), whose tensors are shared, not copied: q/k/v
and gate/up are copied into the fused weights and the transformers parameters then point into
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvcore_kernels import cpu_native
from torch import nn

from kvcore.models.layers.activation import ActAndMul
from kvcore.models.layers.attention import Attention, StepAttention
from kvcore.models.layers.linear import Linear, MergedLinear, gate_up_act
from kvcore.models.layers.norm import RMSNorm
from kvcore.models.layers.rotary import Rotary, apply_rotary, rotary_from
from kvcore.models.step_graphs import StepGraphs
from kvcore.models.windows import layer_windows

# checkpoint projection -> (fused parameter, shard): vLLM's stacked_params_mapping
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class LlamaSpec:
    """What a Llama-family checkpoint's config says about its block."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, config: Any) -> LlamaSpec:
        kind = config.model_type
        attn_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
            intermediate=config.intermediate_size,
            eps=config.rms_norm_eps,
            act=config.hidden_act,
            qkv_bias=True if kind == "qwen2" else attn_bias,
            o_bias=False if kind == "qwen2" else attn_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=kind == "qwen3",
            windows=layer_windows(config),
        )


class LlamaAttention(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_idx: int):
        super().__init__()
        hq, hk, d = spec.heads, spec.kv_heads, spec.head_dim
        self.hq, self.hk, self.d = hq, hk, d
        self.qkv_proj = MergedLinear(spec.hidden, [hq * d, hk * d, hk * d], bias=spec.qkv_bias)
        self.o_proj = Linear(hq * d, spec.hidden, bias=spec.o_bias)
        self.q_norm = RMSNorm(d, spec.eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.eps) if spec.qk_norm else None
        self.attn = Attention(layer_idx, d**-0.5, spec.windows[layer_idx])

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
        v = qkv[:, (hq + hk) * d :].unflatten(1, (hk, d))  # [T, Hk, D]
        if self.q_norm is None:  # rotate q and k heads in one go
            qk = apply_rotary(qkv[:, : (hq + hk) * d].unflatten(1, (hq + hk, d)), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hk, D]
        else:  # Qwen3: per-head RMSNorm on q and k first
            q = apply_rotary(self.q_norm(qkv[:, : hq * d].unflatten(1, (hq, d))), cos, sin)
            k = apply_rotary(
                self.k_norm(qkv[:, hq * d : (hq + hk) * d].unflatten(1, (hk, d))), cos, sin
            )
        o = self.attn(q, k, v, step).flatten(1)  # [T, Hq * D]: every row's K/V is stored
        if keep is not None:  # last layer: only the sampled rows go on
            o = o.index_select(0, keep)  # [K, Hq * D]
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        i = spec.intermediate
        self.gate_up_proj = MergedLinear(spec.hidden, [i, i], bias=spec.mlp_bias)
        self.act = ActAndMul(spec.act)
        self.down_proj = Linear(i, spec.hidden, bias=spec.mlp_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_act(self.gate_up_proj, self.act, h))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.self_attn = LlamaAttention(spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.mlp = LlamaMLP(spec)

    def forward(
        self,
        h: torch.Tensor,
        res: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        step: StepAttention,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``keep`` (the last layer only): the rows whose logits are sampled; the attention
        still runs for every row (it stores their K/V), the rest for the kept rows only."""
        if res is None:  # first layer: the embedding is the residual
            res, h = h, self.input_layernorm(h)
        else:
            h, res = self.input_layernorm(h, res)
        h = self.self_attn(h, cos, sin, step, keep)
        if keep is not None:
            res = res.index_select(0, keep)
        h, res = self.post_attention_layernorm(h, res)
        return self.mlp(h), res


class LlamaModel(nn.Module):
    def __init__(self, spec: LlamaSpec, num_layers: int, vocab: int, rotary: Rotary):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, spec.hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, i) for i in range(num_layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.rotary = rotary
        self.graphs = StepGraphs()  # decode steps' recorded native calls (CPU)
        self._arange: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        step: StepAttention,
        keep: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden state and residual of the ``keep`` rows [K, E]."""
        h = self.embed_tokens(input_ids)  # [T, E]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)  # once per step
        res = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == 1 and last > 1 and self._defer(h, step):
                # The middle layers' native calls recorded and run in one crossing (the
                # first layer ran them one by one, resolving the step's checks; the last one
                # reads with torch, its kept rows): docs/engine.md, "Deferred native calls";
                # or replayed from an earlier step's record (step_graphs: the same calls, the
                # step's inputs and metadata patched in). Where every row is sampled (a
                # decode step), the last layer has no rows to drop and goes with them.
                every = keep.shape[0] == h.shape[0] and torch.equal(keep, self._rows(h))
                upto = last + 1 if every else last

                def middle(h, res, cos, sin, layers=self.layers[1:upto]):  # type: ignore[no-untyped-def]
                    for mid in layers:
                        h, res = mid(h, res, cos, sin, step)
                    return h, res

                h, res = self.graphs.run(step, (h, res, cos, sin), middle, tag=upto)
                return (h, res) if every else self.layers[last](h, res, cos, sin, step, keep)
            h, res = layer(h, res, cos, sin, step, keep if i == last else None)
        return h, res

    def _rows(self, h: torch.Tensor) -> torch.Tensor:
        """``arange(len(h))`` (int64), cached: what ``keep`` is when every row is sampled."""
        rows = self._arange
        if rows is None or rows.shape[0] < h.shape[0]:
            rows = self._arange = torch.arange(max(h.shape[0], 64))
        return rows[: h.shape[0]]

    @staticmethod
    def _defer(h: torch.Tensor, step: StepAttention) -> bool:
        return (
            h.device.type == "cpu"
            and cpu_native.defer_allowed(h.shape[0])
            and getattr(step, "native_calls", False)
            and not torch.compiler.is_compiling()
        )


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 on packed tokens; ``forward`` returns the kept logits."""

    stacked = STACKED

    def __init__(self, config: Any, rotary: Rotary):
        super().__init__()
        self.config = config
        self.spec = LlamaSpec.from_config(config)
        self.model = LlamaModel(self.spec, config.num_hidden_layers, config.vocab_size, rotary)
        self.lm_head = Linear(self.spec.hidden, config.vocab_size)

    @classmethod
    def from_hf(cls, hf_model: Any) -> LlamaForCausalLM:
        return cls(hf_model.config, rotary_from(hf_model.model.rotary_emb))

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        keep: torch.Tensor,  # int64 [K]: rows whose logits are sampled
        step: StepAttention,
    ) -> torch.Tensor:
        h, res = self.model(input_ids, positions, step, keep)  # [K, E]
        h, _ = self.model.norm(h, res)
        return self.lm_head(h)  # [K, vocab]
