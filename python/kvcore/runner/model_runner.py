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

MLA models (DeepSeek-V2/V3): per layer one latent cache ``[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]`` and kvcore's own attention modules (``kvcore.runner.mla``). Cache sizes per
block: ``kvcore.models.sizes``.

Fast paths (plain caches; ``enforce_eager=True`` turns both off): the forward is compiled with
``torch.compile`` around the custom op ``kvcore::paged_attention`` (``kvcore.runner.compile``),
and on CUDA decode-only steps replay a captured CUDA graph padded to the next ladder size
(``kvcore.runner.cuda_graphs``); mixed and prefill steps run the compiled forward. On CUDA the
plan's token arrays go to the device in one asynchronous copy from pinned memory, the forward is
timed with CUDA events, and the only sync of a step is the sampler reading the sampled tokens.
Quantized caches are Python objects with host-side state, so they keep the eager path.

Cache layout (kvcore_kernels): per layer ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
in the model dtype, or, for a quantized ``kv_format``, a ``kvcore_kernels.quant.QuantKVCache``
(one uint8 row per block holding codes and scales; KIVI layers add a model-dtype residual pool
for blocks not yet full). The kernels dispatch on the cache type, so the attention backend is the
same; copy-on-write goes through ``quant.copy_blocks`` so scales and residual slots move too.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import kvcore_kernels
import numpy as np
import torch
from kvcore_kernels.quant import QuantKVCache, allocate_kv_caches, copy_blocks
from kvcore_kernels.quant import get_format as get_kv_format

from kvcore.errors import InvalidArgumentError
from kvcore.models.layers.linear import prepack_linears
from kvcore.models.mla import check_mla_config, is_mla_config
from kvcore.models.native import native_model
from kvcore.models.sizes import kv_geometry
from kvcore.models.windows import layer_windows
from kvcore.retention.release import fill_released, has_released
from kvcore.runner.attention import BACKEND_NAME, CTX_KWARG, AttentionContext, use_kvcore_attention
from kvcore.runner.attention_op import attach_plan
from kvcore.runner.compile import (
    CompileStats,
    compile_model,
    compiled_graph_count,
    mark_step_dynamic,
)
from kvcore.runner.cpu_malloc import tune_cpu_malloc
from kvcore.runner.cuda_graphs import CudaGraphs, DecodeBuffers, graph_sizes
from kvcore.runner.mla import allocate_latent_caches, check_runner_args, install_mla
from kvcore.runner.native import NativeStep

logger = logging.getLogger("kvcore")
# Whether the forward is compiled when the caller does not say (bench_e2e --compile/--eager, on
# the CPU: docs/gpu.md); CUDA graphs are on by default wherever they can run.
COMPILE_BY_DEFAULT = {"cuda": True, "cpu": False}


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
        enforce_eager: bool = False,
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        cuda_graph_sizes: list[int] | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        compile_backend: str = "inductor",
        kv_groups: Any = None,
        model_impl: str | None = None,
    ):
        self.model = model
        # "cuda" and "cuda:0" are one device: compare normalised forms only.
        self.device = kvcore_kernels.normalize_device(next(model.parameters()).device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.backend = backend
        self.kv_dtype = kv_dtype or model.dtype
        num_layers, num_kv_heads, head_dim = kv_geometry(model.config)
        # Per layer the sliding window its attention applies (None: full): kvcore.models.windows.
        self.layer_windows = layer_windows(model.config)
        self.kv_formats = kv_formats or ["auto"] * num_layers
        self.quantized = any(get_kv_format(name).quantized for name in self.kv_formats)
        self.kv_caches: list[Any]
        self.mla = is_mla_config(model.config)
        if self.mla:  # DeepSeek MLA: latent caches and kvcore's MLA attention modules
            check_mla_config(model.config, self.kv_formats)
            check_runner_args(model.config, self.kv_dtype, model.dtype)
            self.kv_caches = allocate_latent_caches(
                model.config, num_blocks, block_size, self.kv_dtype, self.device, self.kv_formats
            )
            self.quantized = False  # FP8 latent rows are plain tensors: copy ops copy rows
            install_mla(model)
        elif self.quantized:
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
            # KV cache groups (kvcore.retention.release.KvGroups): one tensor per position in a
            # group, shared by the groups' layers, each through its own group's block table.
            slots = list(kv_groups.layer_slot) if kv_groups is not None else range(num_layers)
            tensors = [
                kvcore_kernels.allocate_kv_cache(
                    num_blocks, block_size, num_kv_heads, head_dim, self.kv_dtype, self.device
                )
                for _ in range(max(slots) + 1 if num_layers else 0)
            ]
            self.kv_caches = [tensors[s] for s in slots]
        if kv_groups is not None and (self.quantized or self.mla):
            raise InvalidArgumentError("KV cache groups need model-dtype caches without MLA")
        self.kv_groups = kv_groups
        use_kvcore_attention(model)  # the fallback path, and transformers peers of a bench
        # kvcore's own model code where the family has it (kvcore.models.native), else the
        # transformers modules; MLA keeps its own attention modules on the transformers model.
        impl = model_impl or os.environ.get("KVCORE_MODEL_IMPL") or "auto"
        self.native: Any = None
        if self.mla:
            reason = "MLA runs its own attention modules"
        else:
            self.native, reason = native_model(model, impl)
        self.model_impl = "kvcore" if self.native is not None else "transformers"
        logger.info(
            "kvcore: model code: %s (%s)",
            self.model_impl,
            type(self.native).__name__ if self.native is not None else reason,
        )
        self.forward_calls = 0
        self._forward_seconds = 0.0  # cumulative time inside the model's forward
        self._pending: list[tuple[Any, Any]] = []  # CUDA events not yet read
        self._pinned: torch.Tensor | None = None
        self.tier_hook: Any = None  # kvcore.tiers.TierManager.apply: tier moves of a plan
        # Fill released (null) block-table entries before planning (kvcore.retention.release)
        self.fill_released = False
        self._group_step: Any = (None, None, None)  # this step's groups (_plan_groups)
        cuda = self.device.type == "cuda"
        if compile is None:
            compile = COMPILE_BY_DEFAULT.get(self.device.type, False)
        # Quantized caches and MLA latents (their own attention modules) run eagerly.
        fast = not enforce_eager and not self.quantized and not self.mla and kv_groups is None
        self.compile = bool(compile) and fast
        self.use_op = self.compile or (cuda and fast)
        target = self.native if self.native is not None else model
        self.compiled = compile_model(target, compile_backend) if self.compile else None
        # The eager CPU forward of kvcore's model code: bf16 weights re-laid once for oneDNN and
        # the native small-batch kernel (kvcore.models.layers.linear); a compiled forward leaves
        # the packing to inductor.
        self.prepacked_bytes = 0
        if self.device.type == "cpu" and (tuned := tune_cpu_malloc()):
            logger.info("kvcore: %s (KVCORE_MALLOC_TUNE=0 leaves it alone)", tuned)
        if self.native is not None and self.device.type == "cpu" and not self.compile:
            self.prepacked_bytes = prepack_linears(self.native)
            if self.prepacked_bytes:
                mods = [m for m in self.native.modules() if hasattr(m, "gated")]
                logger.info(
                    "kvcore: linear weights prepacked (%.0f MiB): %d bf16 for kvcore's kernel, "
                    "%d bf16 for oneDNN (%d gate-ups as halves, SiLU as a post-op), %d on fp32 "
                    "GEMMs (%d of them bf16 weights: no bf16 GEMM on this CPU), %d with oneDNN's "
                    "packed fp32 copy for few-row calls",
                    self.prepacked_bytes / 2**20,
                    sum(m.small is not None or m.gated is not None for m in mods),
                    sum(m.packed is not None or m.packed_silu is not None for m in mods),
                    sum(m.packed_silu is not None for m in mods),
                    sum(m.upcast is not None for m in mods),
                    sum(m.upcast is not None and m.weight.dtype == torch.bfloat16 for m in mods),
                    sum(m.upcast is not None and m.upcast[2] is not None for m in mods),
                )
        self.compile_stats = CompileStats()
        self.max_model_len = max_model_len or num_blocks * block_size
        self.max_num_seqs = max_num_seqs
        self._buffers: DecodeBuffers | None = None
        self.graphs: CudaGraphs | None = None
        triton = cuda and kvcore_kernels.cache.check_backend(backend, self.device) == "triton"
        if cuda_graphs and not (cuda and triton):
            raise InvalidArgumentError("cuda_graphs=True needs a CUDA device and Triton kernels")
        want_graphs = cuda and triton if cuda_graphs is None else bool(cuda_graphs)
        if want_graphs and fast:
            self.graphs = CudaGraphs(
                self.decode_buffers, graph_sizes(max_num_seqs, cuda_graph_sizes)
            )
            self.graphs.capture(self._decode_forward, self.max_model_len)
            logger.info(
                "kvcore: captured %d CUDA graphs (batch %d..%d) in %.1f s, %.1f MiB",
                len(self.graphs.sizes),
                self.graphs.sizes[0],
                self.graphs.sizes[-1],
                self.graphs.capture_seconds,
                self.graphs.memory_bytes / 2**20,
            )

    @property
    def decode_buffers(self) -> DecodeBuffers:
        """Static buffers of padded decode steps (made on first use)."""
        if self._buffers is None:
            width = math.ceil(self.max_model_len / self.block_size)
            self._buffers = DecodeBuffers(self.max_num_seqs, width, self.block_size, self.device)
        return self._buffers

    @property
    def forward_seconds(self) -> float:
        """Seconds inside the model's forward so far (GPU time between CUDA events on CUDA)."""
        for start, end in self._pending:
            end.synchronize()
            self._forward_seconds += start.elapsed_time(end) / 1e3
        self._pending.clear()
        return self._forward_seconds

    @property
    def num_forwards(self) -> int:
        return self.forward_calls

    def _tensor(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(array))
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def _int64_tensors(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """int64 device tensors of ``arrays``: on CUDA staged in one pinned buffer and sent in
        one asynchronous copy (the buffer is rewritten only after the step's sync)."""
        if self.device.type != "cuda":
            return [self._tensor(a, torch.int64) for a in arrays]
        sizes = [len(a) for a in arrays]
        total = sum(sizes)
        if self._pinned is None or self._pinned.numel() < total:
            self._pinned = torch.empty(max(total, 4096), dtype=torch.int64, pin_memory=True)
        host = self._pinned.numpy()
        offset = 0
        for a, n in zip(arrays, sizes, strict=True):
            host[offset : offset + n] = a
            offset += n
        dev = self._pinned[:total].to(self.device, non_blocking=True)
        return list(dev.split(sizes))

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes every layer's cache holds (block rows, FP8 scales, KIVI residual pools)."""
        unique = {id(c): c for c in self.kv_caches}.values()  # groups share tensors
        return sum(
            c.nbytes if isinstance(c, QuantKVCache) else c.numel() * c.element_size()
            for c in unique
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

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        keep: torch.Tensor,
        meta: Any,
        block_mass: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward (compiled when on; eager when ``block_mass`` is asked for, which only the
        kernels called directly fill); logits [len(keep), vocab]."""
        use_op = self.use_op and block_mass is None
        ctx = AttentionContext(self.kv_caches, slot_mapping, meta, self.backend, use_op)
        ctx.block_mass = block_mass
        if self.kv_groups is not None:
            ctx.layer_group, ctx.group_metas, ctx.group_slots = self._group_step
        if use_op:
            ctx.query_start_loc, ctx.seq_lens = meta.query_start_loc, meta.seq_lens
            ctx.block_table = meta.block_table
            attach_plan(meta.seq_lens, meta)
        if self.native is not None:
            return self._native_forward(input_ids[0], positions[0], slot_mapping, keep, ctx)
        if self.model.config._attn_implementation != BACKEND_NAME:
            use_kvcore_attention(self.model)  # someone switched it (e.g. a transformers peer run)
        forward = self.model
        if self.compiled is not None and use_op:
            forward = self.compiled
            mark_step_dynamic(
                (input_ids, (1,)),
                (positions, (1,)),
                (slot_mapping, (0,)),
                (keep, (0,)),
                (ctx.query_start_loc, (0,)),
                (ctx.seq_lens, (0,)),
                (ctx.block_table, (0, 1)),
            )
        graphs_before = compiled_graph_count()
        start = time.perf_counter()
        out = forward(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=keep,
            **{CTX_KWARG: ctx},
        )
        new_graphs = compiled_graph_count() - graphs_before
        if new_graphs:
            self.compile_stats.graphs += new_graphs
            self.compile_stats.compile_seconds += time.perf_counter() - start
        return out.logits[0]

    def _native_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        keep: torch.Tensor,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        """kvcore's model code on the packed step (compiled when on); logits [len(keep), vocab]."""
        forward = self.native
        if self.compiled is not None and ctx.use_op:
            forward = self.compiled
            mark_step_dynamic(
                (input_ids, (0,)),
                (positions, (0,)),
                (slot_mapping, (0,)),
                (keep, (0,)),
                (ctx.query_start_loc, (0,)),
                (ctx.seq_lens, (0,)),
                (ctx.block_table, (0, 1)),
            )
        graphs_before = compiled_graph_count()
        start = time.perf_counter()
        logits = forward(input_ids, positions, keep, NativeStep(ctx))
        new_graphs = compiled_graph_count() - graphs_before
        if new_graphs:
            self.compile_stats.graphs += new_graphs
            self.compile_stats.compile_seconds += time.perf_counter() - start
        return logits

    def _decode_forward(self, batch: int, meta: Any) -> torch.Tensor:
        """The forward over the decode buffers' first ``batch`` rows (what a graph captures)."""
        input_ids, positions, slot_mapping, rows = self.decode_buffers.inputs(batch)
        return self._forward(input_ids, positions, slot_mapping, rows, meta)

    @torch.inference_mode()
    def execute_padded(self, plan: Any, logits_indices: np.ndarray, batch: int) -> torch.Tensor:
        """A decode-only ``plan`` run as a graph would run it, without one: padded to ``batch``
        rows in the static buffers (CPU or CUDA; tests check the padding rows touch nothing)."""
        self.apply_copy_ops(np.asarray(plan.copy_ops))
        self.decode_buffers.fill(plan, batch)
        logits = self._decode_forward(batch, self.decode_buffers.metadata(batch))
        return logits.index_select(0, self._tensor(logits_indices, torch.int64))

    def _plan_groups(self, plan: Any) -> tuple[Any, list[Any], list[torch.Tensor]]:
        """Attention metadata and slots of the extra KV cache groups of ``plan``."""
        metas, slots = [], []
        for k in range(plan.group_block_table.shape[0]):
            table = plan.group_block_table[k]
            if self.fill_released:
                table = fill_released(table, plan.seq_lens, self.block_size)
            metas.append(
                kvcore_kernels.plan_attention(
                    plan.query_start_loc, plan.seq_lens, table, self.block_size, device=self.device
                )
            )
            slots.append(self._tensor(plan.group_slot_mapping[k], torch.int64))
        return self.kv_groups.layer_group, metas, slots

    @torch.inference_mode()
    def execute(
        self, plan: Any, logits_indices: np.ndarray, block_mass: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run ``plan``'s forward; returns logits [len(logits_indices), vocab] (float).
        ``block_mass`` (H2O): filled with the step's attention mass per (row, logical block)."""
        if self.tier_hook is not None:  # publish, offload L1->L2, load L2->L1 (before copy_ops)
            self.tier_hook(plan)
        self.apply_copy_ops(np.asarray(plan.copy_ops))
        num_tokens = len(plan.input_ids)
        if num_tokens == 0:
            raise InvalidArgumentError("a step plan with no tokens has nothing to run")
        cuda = self.device.type == "cuda"
        start = time.perf_counter()
        if cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        graphs = self.graphs if block_mass is None else None
        # A captured graph froze its kernels' launch (no released-entry masking): released
        # entries (null) run eagerly, where the kernels plan around them.
        if graphs is not None and has_released(plan.block_table, plan.seq_lens, self.block_size):
            graphs = None
        logits = graphs.replay(plan) if graphs is not None else None
        if logits is not None:  # rows [0, n): pick the sampled ones
            n = logits.shape[0]
            if not (len(logits_indices) == n and np.array_equal(logits_indices, np.arange(n))):
                logits = logits.index_select(0, self._tensor(logits_indices, torch.int64))
        else:
            input_ids, positions, slot_mapping, keep = self._int64_tensors(
                plan.input_ids, plan.positions, plan.slot_mapping, logits_indices
            )
            table = plan.block_table
            if self.fill_released:  # exact windows on kernels without null entries
                table = fill_released(table, plan.seq_lens, self.block_size)
            # Host arrays: the plan checks and lays them out on the host, then copies once each.
            meta = kvcore_kernels.plan_attention(
                plan.query_start_loc,
                plan.seq_lens,
                table,
                self.block_size,
                device=self.device,
            )
            if self.kv_groups is not None:
                self._group_step = self._plan_groups(plan)
            logits = self._forward(
                input_ids[None], positions[None], slot_mapping, keep, meta, block_mass
            )
        if cuda:  # read after the sampler's sync: no sync here
            events[1].record()
            self._pending.append(events)
        else:
            self._forward_seconds += time.perf_counter() - start
        self.forward_calls += 1
        return logits
