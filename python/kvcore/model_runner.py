"""ModelRunner: turns one StepPlan into one forward of the model on the paged KV cache.

Per step:

1. ``copy_ops`` ([n, 2] src/dst block pairs: copy-on-write, tier moves) are applied to every
   layer's cache BEFORE the forward, so the step reads the copied blocks.
2. The plan's arrays go to the device, one copy per array (zero-copy views on the CPU).
3. ``kvcore_kernels.plan_attention`` builds the step's attention metadata once; every layer reuses
   it (plan once per step, run per layer).
4. One forward of the unmodified transformers model: every scheduled token packed into one row,
   each request with its own positions; ``kvcore_ctx`` carries the metadata to the attention
   backend, which does ``store_kv`` + ``paged_attention`` per layer. ``logits_to_keep`` limits
   the LM head to the rows that are sampled (the last token of each request that samples).

Cache layout (kvcore_kernels): per layer ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
in the model dtype, or, for a quantized ``kv_format``, a ``kvcore_kernels.quant.QuantKVCache``
(one uint8 row per block holding codes and scales; KIVI layers add a model-dtype residual pool
for blocks not yet full). The kernels dispatch on the cache type, so the attention backend is the
same; copy-on-write goes through ``quant.copy_blocks`` so scales and residual slots move too.
"""

from __future__ import annotations

import time
from typing import Any

import kvcore_kernels
import numpy as np
import torch
from kvcore_kernels.quant import QuantKVCache, allocate_kv_caches, block_layout, copy_blocks
from kvcore_kernels.quant import get_format as get_kv_format

from kvcore.attention import BACKEND_NAME, CTX_KWARG, AttentionContext, use_kvcore_attention
from kvcore.errors import InvalidArgumentError


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
    the format's block row (codes and scales) for quantized ones."""
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


class ModelRunner:
    """Owns the model (switched to kvcore attention) and its per-layer paged KV caches."""

    def __init__(
        self,
        model: Any,
        *,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
        kv_formats: list[str] | None = None,
        kv_scale: float | None = None,
        num_residual_blocks: int | None = None,
        kivi_window: int = 0,
        backend: str = "auto",
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = backend
        self.kv_dtype = kv_dtype or model.dtype
        num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
        self.kv_formats = kv_formats or ["auto"] * num_layers
        self.quantized = any(get_kv_format(name).quantized for name in self.kv_formats)
        self.kv_caches: list[Any]
        if self.quantized:
            # Every check (format vs head dim, dtype, device) runs before any allocation.
            self.kv_caches = allocate_kv_caches(
                self.kv_formats,
                num_layers,
                num_blocks,
                block_size,
                num_kv_heads,
                head_dim,
                model.dtype,
                self.device,
                fp8_scales=kv_scale,
                num_residual_blocks=num_residual_blocks,
                kivi_window=kivi_window,
            )
        else:
            self.kv_caches = [
                kvcore_kernels.allocate_kv_cache(
                    num_blocks, block_size, num_kv_heads, head_dim, self.kv_dtype, self.device
                )
                for _ in range(num_layers)
            ]
        use_kvcore_attention(model)
        self.forward_seconds = 0.0  # cumulative time inside the model's forward
        self.num_forwards = 0
        self.tier_hook: Any = None  # kvcore.tiers.TierManager.apply: tier moves of a plan

    def _tensor(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes every layer's cache holds (block rows, FP8 scales, KIVI residual pools)."""
        return sum(
            c.nbytes if isinstance(c, QuantKVCache) else c.numel() * c.element_size()
            for c in self.kv_caches
        )

    def apply_copy_ops(self, copy_ops: np.ndarray) -> None:
        """Copy block src -> dst in every layer's cache (all pairs in one indexed copy)."""
        if copy_ops.size == 0:
            return
        if self.quantized:  # codes, scales and KIVI residual slots move together
            pairs = np.asarray(copy_ops, dtype=np.int64).reshape(-1, 2)
            copy_blocks(self.kv_caches, pairs[:, 0], pairs[:, 1], backend=self.backend)
            return
        ops = self._tensor(copy_ops.reshape(-1, 2), torch.int64)
        src, dst = ops[:, 0], ops[:, 1]
        for cache in self.kv_caches:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @torch.inference_mode()
    def execute(self, plan: Any, logits_indices: np.ndarray) -> torch.Tensor:
        """Run ``plan``'s forward; returns logits [len(logits_indices), vocab] (float)."""
        if self.tier_hook is not None:  # publish, offload L1->L2, load L2->L1 (before copy_ops)
            self.tier_hook(plan)
        self.apply_copy_ops(np.asarray(plan.copy_ops))
        num_tokens = len(plan.input_ids)
        if num_tokens == 0:
            raise InvalidArgumentError("a step plan with no tokens has nothing to run")
        input_ids = self._tensor(plan.input_ids, torch.int64)
        positions = self._tensor(plan.positions, torch.int64)
        slot_mapping = self._tensor(plan.slot_mapping, torch.int64)
        # Host arrays: the plan checks and lays them out on the host, then copies once each.
        meta = kvcore_kernels.plan_attention(
            plan.query_start_loc,
            plan.seq_lens,
            plan.block_table,
            self.block_size,
            device=self.device,
        )
        ctx = AttentionContext(self.kv_caches, slot_mapping, meta, self.backend)
        if self.model.config._attn_implementation != BACKEND_NAME:
            use_kvcore_attention(self.model)  # someone switched it (e.g. a transformers peer run)
        keep = self._tensor(logits_indices, torch.int64)
        start = time.perf_counter()
        out = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
            **{CTX_KWARG: ctx},
        )
        logits = out.logits[0]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - start
        self.num_forwards += 1
        return logits
