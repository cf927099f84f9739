"""Which model code runs: kvcore's own (``llama``, ``gemma``) or transformers' modules.

``native_model(hf_model)`` builds kvcore's model for a supported family from the loaded
transformers model and returns it with ``None``; for anything else it returns ``None`` and the
reason, and the runner keeps transformers' modules (with kvcore's attention backend)::

    model_impl="auto"          kvcore's code for a family in NATIVE_FAMILIES, else transformers'
    model_impl="kvcore"        kvcore's code or an error saying why not
    model_impl="transformers"  transformers' modules always (vLLM's option of the same name)

Weights: every parameter of kvcore's model is the transformers model's tensor (shared), except
the fused q/k/v and gate/up weights, which are built by copying the shards (``STACKED``); the
transformers parameters are then pointed at their rows of the fused weight, so a model is never
held twice and the transformers path (a peer run, a test's reference ``generate``) still works.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvcore.errors import InvalidArgumentError
from kvcore.models.gemma import GemmaForCausalLM
from kvcore.models.layers.norm import RMSNorm
from kvcore.models.llama import LlamaForCausalLM

NATIVE_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
}
MODEL_IMPLS = ("auto", "kvcore", "transformers")
_ACTS = {"llama": "hidden_act", "gemma": "hidden_activation"}


def unsupported_reason(hf_model: Any) -> str | None:
    """Why kvcore's own code cannot run ``hf_model`` (None: it can)."""
    config = hf_model.config
    kind = getattr(config, "model_type", None)
    if kind not in NATIVE_FAMILIES:
        return f"no kvcore model code for {kind!r}"
    act_field = "hidden_activation" if kind.startswith("gemma") else "hidden_act"
    act = getattr(config, act_field, None)
    if act not in ("silu", "gelu_pytorch_tanh"):
        return f"activation {act!r}"
    rope = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
    if rope is None:
        return "no rotary embedding module"
    types = rope.rope_type.values() if isinstance(rope.rope_type, dict) else [rope.rope_type]
    from kvcore.models.layers.rotary import STATIC_ROPE_TYPES

    bad = [t for t in types if t not in STATIC_ROPE_TYPES]
    if bad:
        return f"RoPE type {bad[0]!r} (changes with the sequence length)"
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return "partial rotary"
    return None


@torch.no_grad()
def load_from(native: nn.Module, hf_model: Any) -> None:
    """Point ``native``'s parameters at ``hf_model``'s tensors (fused ones: copy the shards in,
    then point the transformers parameters at their rows). Every parameter must be filled."""
    params = dict(native.named_parameters())
    filled: set[str] = set()
    for name, tensor in hf_model.named_parameters(remove_duplicate=False):
        parts = name.split(".")
        proj = parts[-2] if len(parts) > 1 else ""
        if proj in native.stacked:  # q/k/v, gate/up -> rows of the fused weight
            fused, shard = native.stacked[proj]
            owner = native.get_submodule(".".join(parts[:-2] + [fused]))
            tensor.data = owner.load_shard(shard, parts[-1], tensor.data)
            filled.add(".".join(parts[:-2] + [fused, parts[-1]]))
            continue
        if name not in params:
            raise InvalidArgumentError(f"checkpoint tensor {name} has no place in kvcore's model")
        if params[name].shape != tensor.shape:
            raise InvalidArgumentError(
                f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(params[name].shape)}"
            )
        params[name].data = tensor.data  # shared, not copied
        filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        raise InvalidArgumentError(f"kvcore's model has parameters the checkpoint lacks: {missing}")


def native_model(hf_model: Any, model_impl: str = "auto") -> tuple[nn.Module | None, str]:
    """``(kvcore's model, "kvcore")`` or ``(None, reason the transformers path runs)``."""
    if model_impl not in MODEL_IMPLS:
        raise InvalidArgumentError(
            f"model_impl must be one of {', '.join(MODEL_IMPLS)}: {model_impl!r}"
        )
    if model_impl == "transformers":
        return None, "model_impl='transformers'"
    reason = unsupported_reason(hf_model)
    if reason is not None:
        if model_impl == "kvcore":
            raise InvalidArgumentError(f"model_impl='kvcore' cannot run this model: {reason}")
        return None, reason
    cls = NATIVE_FAMILIES[hf_model.config.model_type]
    weight = next(hf_model.parameters())
    native = cls.from_hf(hf_model)  # empty parameters: filled from the checkpoint below
    native.to(device=weight.device, dtype=weight.dtype)
    load_from(native, hf_model)
    for module in native.modules():  # Gemma's norms: (1 + w) in float32, once
        if isinstance(module, RMSNorm):
            module.fold_offset()
    return native.eval(), "kvcore"
