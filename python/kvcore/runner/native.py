"""The attention call of kvcore's own model code (``kvcore.models.llama``, ``gemma``).

The ModelRunner builds one ``AttentionContext`` per step (``kvcore.runner.attention``) and hands
``NativeStep(ctx)`` to the model's forward; each layer calls it with its packed q/k/v and its own
constants. It does what the transformers backend's function does, without the layout shuffles
(the model already works on ``[T, H, D]``):

* op path (compiled forward, CUDA graphs): the custom op ``kvcore::paged_attention`` (store K/V
  and attend in one opaque node per layer; ``kvcore.runner.attention_op``);
* eager path: ``kvcore_kernels.store_kv`` + ``kvcore_kernels.paged_attention`` with the step's
  ``AttentionMetadata``, KV cache groups (``kvcore.retention.release``) and H2O's block mass;
  with backend "auto" and no mass through ``LayerCalls``, which checks the arguments on the
  step's first layer of each geometry and sends the others straight to the native kernel.
"""

from __future__ import annotations

import kvcore_kernels
import torch
from kvcore_kernels import cpu_native
from kvcore_kernels.step_calls import LayerCalls

from kvcore.runner.attention import AttentionContext
from kvcore.runner.attention_op import paged_attention as paged_attention_op


class NativeStep:
    """``models.layers.attention.StepAttention`` over one step's ``AttentionContext``."""

    __slots__ = ("calls", "ctx")

    def __init__(self, ctx: AttentionContext):
        self.ctx = ctx
        # the step's layers share their checks (kvcore_kernels.step_calls.LayerCalls)
        self.calls = LayerCalls() if ctx.backend == "auto" else None

    @property
    def native_calls(self) -> bool:
        """Whether this step's layers so far went straight to the native store and kernel (a
        geometry resolved by ``LayerCalls``): the model may then defer the next layers' calls
        (``cpu_native.deferred``)."""
        return self.calls is not None and not self.ctx.use_op and self.calls.fast

    def replay_key(self) -> tuple | None:
        """Where the layers' calls can be replayed from a recording
        (``kvcore.models.step_graphs``): the identity of the caches they write (a recording
        holds them, so an id is not reused while it lives); None where a layer could take
        another path than the native store and kernel with the step's one metadata and slots
        (KV groups, H2O's mass, probes, the op path, no geometry resolved to the kernel yet)."""
        ctx = self.ctx
        if (
            not self.native_calls
            or ctx.layer_group is not None
            or ctx.block_mass is not None
            or ctx.probes is not None
        ):
            return None
        return tuple(map(id, ctx.kv_caches))

    def replay_args(self) -> tuple[object, torch.Tensor]:
        """The step's metadata and its slots as the native store reads them (int64,
        contiguous): what ``cpu_native.StepGraph.replay`` patches into a recording."""
        slots = self.ctx.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        return self.ctx.meta, slots

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
    ) -> torch.Tensor:
        ctx = self.ctx
        cache = ctx.kv_caches[layer_idx]
        meta, slots, mass = ctx.meta, ctx.slot_mapping, ctx.block_mass
        if ctx.layer_group is not None and ctx.layer_group[layer_idx]:
            group = ctx.layer_group[layer_idx]
            meta, slots = ctx.group_metas[group - 1], ctx.group_slots[group - 1]
            mass = None  # as the transformers backend: local groups add no mass
        if self.calls is not None and mass is None and not ctx.use_op:
            # The model hands views into its fused QKV/rotary outputs (rows strided by all
            # heads, each head's D elements contiguous): on a plain CPU cache the native store
            # and kernel take such rows as they are (their token stride), so no copy there
            # (1.2 % of the 1-thread offline job was these three copies and their calls)
            if not (isinstance(cache, torch.Tensor) and cache.device.type == "cpu"):
                cpu_native.flush()
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            return self.calls(
                q, k, v, cache, slots, meta,
                scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
            )  # fmt: skip
        # The other paths get contiguous rows. The copies are T x H x D (small next to the
        # GEMMs) and, compiled, fuse into the kernel producing q/k.
        cpu_native.flush()  # they read q, k, v: recorded calls run first
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if ctx.use_op:
            return paged_attention_op(
                q,
                k,
                v,
                cache,
                ctx.slot_mapping,
                ctx.query_start_loc,
                ctx.seq_lens,
                ctx.block_table,
                scale=scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
                backend=ctx.backend,
            )
        kvcore_kernels.store_kv(k, v, cache, slots, backend=ctx.backend, meta=meta)
        return kvcore_kernels.paged_attention(
            q,
            cache,
            meta,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            backend=ctx.backend,
            **({} if mass is None else {"block_mass": mass}),
        )
