"""kvcore's attention backend for unmodified transformers models.

Registered with transformers' ``AttentionInterface`` under ``BACKEND_NAME`` and selected with
``model.set_attn_implementation("kvcore")``. A mask function is registered under the same name and
returns ``None``: the paged kernels apply causality from the step metadata, so no dense
``[q, kv]`` mask is ever built.

The ModelRunner packs every scheduled token of a step into ONE row (batch 1), with each
request's own ``position_ids``, and passes the step's metadata as the forward keyword argument
``kvcore_ctx`` (an ``AttentionContext``). transformers hands unknown forward keyword arguments
down to the attention function, so there is no module global to set and reset.

Per layer the function writes the step's new K/V into the paged cache (``store_kv``, slots from
``slot_mapping``) and attends over each request's blocks (``paged_attention``); with ``probes``
(the quality gate, ``kvcore.tools.eval_kv``) caches of other formats take the same K/V and the
distance of their output from the main one is summed per layer. On the op path
(compiled forward, CUDA graphs) both happen inside the custom op ``kvcore::paged_attention``
(``kvcore.runner.attention_op``), which takes tensors only:

    query/key/value from the model: [1, heads, num_tokens, head_dim]
    kernels take and return:        [num_tokens, heads, head_dim]
    the model expects back:         [1, num_tokens, num_q_heads, head_dim]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import kvcore_kernels
import numpy as np
import torch

from kvcore.errors import InvalidArgumentError
from kvcore.runner.attention_op import paged_attention as paged_attention_op

BACKEND_NAME = "kvcore"
CTX_KWARG = "kvcore_ctx"


@dataclass(slots=True)
class LayerProbes:
    """Caches of other formats that take every layer's K/V too (eager path): per layer the sum of
    squares of the main cache's attention output and of each format's difference from it."""

    caches: dict[str, list[Any]]  # format name -> its per-layer caches
    sq_err: dict[str, np.ndarray]  # format name -> float [num_layers]: sum ||o_fmt - o||^2
    sq_ref: np.ndarray  # float [num_layers]: sum ||o||^2

    @classmethod
    def of(cls, caches: dict[str, list[Any]], num_layers: int) -> LayerProbes:
        """Probes over ``caches`` with zeroed sums."""
        sq_err = {name: np.zeros(num_layers) for name in caches}
        return cls(caches, sq_err, np.zeros(num_layers))

    def measure(self, layer: int, out: torch.Tensor, attend: Callable[[Any], torch.Tensor]) -> None:
        """Add one layer's sums: ``out`` of the main cache, ``attend(cache)`` of each format's."""
        self.sq_ref[layer] += float(out.float().pow(2).sum())
        for name, caches in self.caches.items():
            o = attend(caches[layer])
            self.sq_err[name][layer] += float((o.float() - out.float()).pow(2).sum())


@dataclass(slots=True)
class AttentionContext:
    """One step's attention metadata, shared by every layer (built once by the ModelRunner).

    With ``use_op`` (plain caches; what ``torch.compile`` and CUDA graphs need) the layers call
    the custom op ``torch.ops.kvcore.paged_attention`` with the step's tensors only
    (``kvcore.runner.attention_op``); otherwise they call the kernels with ``meta`` directly.
    """

    # per layer [num_blocks, 2, block_size, num_kv_heads, head_dim], or a QuantKVCache
    kv_caches: list[Any]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; slot = block_id * block_size + offset
    meta: Any  # kvcore_kernels.plan_attention(...) for this step (eager path)
    backend: str = "auto"  # kernel backend: auto | triton | torch
    use_op: bool = False
    query_start_loc: torch.Tensor | None = None  # int32 [num_reqs + 1] (op path)
    seq_lens: torch.Tensor | None = None  # int32 [num_reqs], carries the plan (op path)
    block_table: torch.Tensor | None = None  # int32 [num_reqs, width] (op path)
    # KV cache groups (kvcore.retention.release.KvGroups): layer -> group; group k > 0 reads
    # group_metas[k - 1] and writes group_slots[k - 1] (group 0: meta and slot_mapping)
    layer_group: Any = None
    group_metas: Any = None
    group_slots: Any = None
    # H2O (kvcore.retention.h2o): float32 [num_reqs, width] the group-0 layers add their attention
    # mass into (eager path only); None: not asked for
    block_mass: torch.Tensor | None = None
    # Per-layer error probes of other cache formats (eager path only); None: none
    probes: LayerProbes | None = None


def _store_and_attend(
    cache: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    meta: Any,
    mass: torch.Tensor | None,
    backend: str,
    **attn: Any,
) -> torch.Tensor:
    """Write the step's K/V into ``cache`` (a QuantKVCache is quantized on write: the kernels
    dispatch on the cache type; KIVI's residual plan reads ``meta``), then attend over it."""
    kvcore_kernels.store_kv(k, v, cache, slots, backend=backend, meta=meta)
    return kvcore_kernels.paged_attention(
        q, cache, meta, backend=backend, **attn, **({} if mass is None else {"block_mass": mass})
    )


def kvcore_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls per layer (signature of its interface)."""
    ctx = kwargs.get(CTX_KWARG)
    if not isinstance(ctx, AttentionContext):
        raise InvalidArgumentError(
            f"attn_implementation={BACKEND_NAME!r} needs the step metadata: run the model "
            "through kvcore (LLM / LLMEngine / ModelRunner)"
        )
    if query.shape[0] != 1:
        raise InvalidArgumentError("kvcore attention expects one packed row (batch size 1)")
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise InvalidArgumentError("attention module has no layer_idx")
    q = query[0].transpose(0, 1)  # [num_tokens, num_q_heads, head_dim]
    k = key[0].transpose(0, 1)  # [num_tokens, num_kv_heads, head_dim]
    v = value[0].transpose(0, 1)
    cache = ctx.kv_caches[layer_idx]
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    if ctx.use_op:  # one opaque node per layer for torch.compile; tensors only
        out = paged_attention_op(
            q,
            k,
            v,
            cache,
            ctx.slot_mapping,
            ctx.query_start_loc,
            ctx.seq_lens,
            ctx.block_table,
            scale=scaling,
            sliding_window=sliding_window,
            soft_cap=softcap,
            backend=ctx.backend,
        )
        return out.unsqueeze(0), None
    meta, slots, mass = ctx.meta, ctx.slot_mapping, ctx.block_mass
    if ctx.layer_group is not None and ctx.layer_group[layer_idx]:
        group = ctx.layer_group[layer_idx]
        meta, slots = ctx.group_metas[group - 1], ctx.group_slots[group - 1]
        mass = None  # a local group's table may be narrower; its layers see the recent blocks
    attn = dict(scale=scaling, sliding_window=sliding_window, soft_cap=softcap)
    out = _store_and_attend(cache, q, k, v, slots, meta, mass, ctx.backend, **attn)
    if ctx.probes is not None:  # the probes add no attention mass
        ctx.probes.measure(
            layer_idx,
            out,
            lambda c: _store_and_attend(c, q, k, v, slots, meta, None, ctx.backend, **attn),
        )
    return out.unsqueeze(0), None  # [1, num_tokens, num_q_heads, head_dim]


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function of the backend: causality comes from the step metadata, not a mask."""
    return None


def register() -> str:
    """Register the backend and its mask function with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(BACKEND_NAME, kvcore_attention)
    AttentionMaskInterface.register(BACKEND_NAME, _no_mask)
    return BACKEND_NAME


def use_kvcore_attention(model: Any) -> None:
    """Switch ``model`` (a transformers PreTrainedModel) to kvcore's attention backend."""
    register()
    model.set_attn_implementation(BACKEND_NAME)
