"""Default sampling parameters from a model's own ``generation_config``.

A model's authors state how it should be sampled in its ``generation_config.json``
(temperature, top-p, top-k, min-p, repetition penalty, max new tokens). Only the fields they
set explicitly count (those differing from transformers' ``GenerationConfig()``); everything
else keeps ``SamplingParams``' default, so a model that says nothing is sampled at temperature
1.0 without truncation. (Idea: vLLM's ``LLM.get_default_sampling_params``.)

``do_sample: false`` set explicitly means greedy, as in transformers' ``generate``. Explicit
overrides (a CLI flag, an API argument) always win; ``temperature=0`` is greedy.
"""

from __future__ import annotations

from typing import Any

from kvcore.errors import InvalidArgumentError
from kvcore.params import SamplingParams

# generation_config field -> SamplingParams field
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def _generation_config(source: Any) -> Any:
    """The GenerationConfig of a model, a GenerationConfig itself, a dict, or None."""
    from transformers import GenerationConfig

    if source is None or isinstance(source, GenerationConfig):
        return source
    if isinstance(source, dict):
        return GenerationConfig(**source)
    engine_model = getattr(source, "model", None)  # an LLMEngine
    if engine_model is not None and hasattr(engine_model, "generation_config"):
        source = engine_model
    return getattr(source, "generation_config", None)


def model_sampling_defaults(source: Any) -> dict[str, Any]:
    """The ``SamplingParams`` fields a model's generation config sets explicitly.

    ``source``: a transformers model, an ``LLMEngine``, a ``GenerationConfig`` or a dict.
    """
    config = _generation_config(source)
    if config is None:
        return {}
    diff = config.to_diff_dict()
    out: dict[str, Any] = {}
    for key, name in _FIELDS.items():
        value = diff.get(key)
        if value is None:
            continue
        if name == "top_k" and value == 0:
            value = -1  # transformers' "no top-k"
        out[name] = value
    if diff.get("do_sample") is False:
        out["temperature"] = 0.0  # the model asks for greedy decoding
    return out


def default_sampling_params(source: Any = None, **overrides: Any) -> SamplingParams:
    """``SamplingParams`` from the model's generation defaults, then ``overrides`` (``None``
    values are ignored, so unset CLI flags fall through). Raises ``InvalidArgumentError`` for
    an unknown field or a bad value."""
    known = set(SamplingParams.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InvalidArgumentError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    fields = model_sampling_defaults(source)
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**fields)
