"""KIVI's full-precision residual: which blocks are still in the model dtype, and where.

KIVI quantizes keys per channel over a block's tokens, so a block can only be quantized once it
is full. Until then its tokens live in a small pool of model-dtype blocks (the residual), shared
by every KIVI layer of a model (block ids are the same in every layer)::

    stage_of_block[b] = s >= 0   block b's tokens are in residual slot s (model dtype)
                      = -1       block b is quantized (or was never written)

Per step, ONE host plan (``plan_for``: made by the first layer's store, reused by the others)
decides, from the step's slot mapping alone:

    finalize   blocks the previous step filled (and staged blocks now behind a window) are
               quantized from the residual first and their slots freed
    stage      every block this step writes gets a slot (a quantized block written past offset
               0, e.g. after copy-on-write, is first decoded into it: "restage"); its tokens
               go there, so this step's queries read this step's keys in the model dtype, as
               KIVI's prefill does, while keys of earlier steps are read quantized
    evict      when the pool is out of slots, the least recently written staged blocks that
               the step does not touch are quantized as they are (partial: key statistics
               over their ``fill`` valid rows) and their slots reused

With a window of ``W`` blocks (``kivi_window``), the ``W`` full blocks before each request's first
query token of the step stay staged too (KIVI's full-precision recent tokens); that needs the
step's ``AttentionMetadata`` (block tables, query and sequence lengths). Blocks of
finished requests simply age out of the pool by eviction, so no release call is needed; an
undersized pool costs quality (early quantization), never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcore_kernels.errors import KernelConfigError


@dataclass(eq=False)
class StorePlan:
    """One step's residual decisions (device int64 tensors; empty when nothing to do)."""

    final_blocks: torch.Tensor  # [nf] staged blocks quantized first (slots then reused)...
    final_slots: torch.Tensor  # [nf] ...from these residual slots
    final_fills: torch.Tensor  # [nf] valid rows of each (block_size unless evicted early)
    restage_blocks: torch.Tensor  # [nr] quantized blocks decoded into...
    restage_slots: torch.Tensor  # [nr] ...these residual slots before the writes
    stage_tokens: torch.Tensor  # [ns] tokens written to the residual...
    stage_slots: torch.Tensor  # [ns] ...at (slot, offset)
    stage_offsets: torch.Tensor  # [ns]


class ResidualState:
    """Host bookkeeping of the residual pool, shared by all KIVI layers of one model."""

    def __init__(
        self, num_blocks: int, block_size: int, num_slots: int, window: int, device: torch.device
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots, self.window, self.device = num_slots, window, device
        self.stage_of_block = np.full(num_blocks, -1, dtype=np.int64)
        self.block_of_slot = np.full(num_slots, -1, dtype=np.int64)
        self.fill = np.zeros(num_blocks, dtype=np.int64)  # valid rows of each block
        self.last_use = np.zeros(num_slots, dtype=np.int64)
        self.pending = np.empty(0, dtype=np.int64)  # blocks filled by the last step
        self.clock = 0
        self.device_map = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self._plan: StorePlan | None = None
        self._plan_src: torch.Tensor | None = None  # the step's slot mapping (kept alive)
        self._plan_version = -1
        self._plan_slots: np.ndarray | None = None  # its host copy
        self._plan_users: set[int] = set()  # layers (ids) that applied the plan

    def plan_for(self, layer: object, slot_mapping: torch.Tensor, meta: object) -> StorePlan:
        """The step's plan: made on the first layer's call, reused by the other layers.

        Layers of one step pass the same slot mapping (the same tensor object: no host copy;
        an equal tensor: compared on the host). A call is a new step when the mapping differs
        or when ``layer`` already used the current plan.
        """
        try:
            version = slot_mapping._version
        except RuntimeError:  # inference-mode tensors keep no version counter
            version = -1
        same = self._plan is not None and id(layer) not in self._plan_users
        if same and not (slot_mapping is self._plan_src and version == self._plan_version):
            host = slot_mapping.detach().to("cpu", torch.int64).numpy()
            same = self._plan_slots is not None and np.array_equal(host, self._plan_slots)
        if not same:
            self._plan, self._plan_slots = self._make_plan(slot_mapping, meta)
            self._plan_src, self._plan_version, self._plan_users = slot_mapping, version, set()
        self._plan_users.add(id(layer))
        assert self._plan is not None
        return self._plan

    def _window_blocks(self, meta: object) -> tuple[np.ndarray, np.ndarray]:
        """(blocks the window keeps staged, staged-or-not blocks behind it) of the step's
        requests. The window is the ``window`` full blocks before the step's first query
        token, so even that token reads them unquantized (later ones also read the step's)."""
        if self.window == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        if meta is None or not hasattr(meta, "host_block_table"):
            raise KernelConfigError("kivi_window > 0 needs the step's meta in store_kv_quant")
        table, lens = meta.host_block_table, meta.host_seq_lens
        ctx = lens - np.diff(meta.host_query_start_loc)  # tokens before the step's queries
        n_full = ctx // self.block_size
        cols = np.arange(table.shape[1])[None, :]
        keep = (cols < n_full[:, None]) & (cols >= n_full[:, None] - self.window)
        old = cols < (n_full - self.window)[:, None]
        return table[keep], table[old]

    def _make_plan(self, slot_mapping: torch.Tensor, meta: object) -> tuple[StorePlan, np.ndarray]:
        bs = self.block_size
        slots = slot_mapping.detach().to("cpu", torch.int64).numpy()
        if slots.size and int(slots.max()) >= self.num_blocks * bs:
            raise KernelConfigError(f"slot {int(slots.max())} is past the cache's end")
        in_window, past_window = self._window_blocks(meta)
        tok = np.flatnonzero(slots >= bs)
        uniq, first = np.unique(slots[tok[::-1]], return_index=True)  # one writer per slot
        tok = tok[::-1][first]
        blk, off = uniq // bs, uniq % bs
        ub, inv = np.unique(blk, return_inverse=True)  # the blocks this step writes
        min_off = np.full(len(ub), bs, np.int64)
        np.minimum.at(min_off, inv, off)
        new_fill = np.zeros(len(ub), np.int64)
        np.maximum.at(new_fill, inv, off + 1)
        was_staged = self.stage_of_block[ub] >= 0
        stage_of_block = self.stage_of_block.copy()
        block_of_slot = self.block_of_slot.copy()

        # 1. Blocks completed in earlier steps (and staged blocks now behind a window) are
        #    quantized first, unless this step writes them again or a window keeps them.
        pre = np.union1d(self.pending, past_window)
        pre = pre[(stage_of_block[pre] >= 0) & ~np.isin(pre, ub) & ~np.isin(pre, in_window)]
        block_of_slot[stage_of_block[pre]] = -1
        pre_slots = stage_of_block[pre]
        stage_of_block[pre] = -1
        # 2. Every written block needs a slot: free ones first, then the least recently
        #    written staged blocks this step does not touch (quantized as they are).
        need = ub[~was_staged]
        free = np.flatnonzero(block_of_slot < 0)
        if len(need) > len(free):
            holders = np.flatnonzero(block_of_slot >= 0)
            holders = holders[~np.isin(block_of_slot[holders], ub)]
            short = len(need) - len(free)
            if short > len(holders):
                raise KernelConfigError(
                    f"the KIVI residual pool has {self.num_slots} slots but this step writes "
                    f"{len(ub)} blocks: allocate a larger pool (num_residual_blocks)"
                )
            evict = holders[np.argsort(self.last_use[holders], kind="stable")[:short]]
            free = np.concatenate([free, evict])
            pre = np.concatenate([pre, block_of_slot[evict]])
            pre_slots = np.concatenate([pre_slots, evict])
            stage_of_block[block_of_slot[evict]] = -1
        got = free[: len(need)]
        stage_of_block[need] = got
        block_of_slot[got] = need
        restage = ~was_staged & (min_off > 0)  # a quantized block written past offset 0
        plan = StorePlan(
            *map(
                self._dev,
                (
                    pre,
                    pre_slots,
                    self.fill[pre],
                    ub[restage],
                    stage_of_block[ub[restage]],
                    tok,
                    stage_of_block[blk],
                    off,
                ),
            )
        )
        # Commit (nothing above raised): blocks this step filled are quantized next step.
        self.clock += 1
        self.last_use[stage_of_block[ub]] = self.clock
        self.stage_of_block, self.block_of_slot = stage_of_block, block_of_slot
        self.fill[ub] = new_fill
        self.pending = ub[(new_fill == bs) & ~np.isin(ub, in_window)]
        self._push_map()
        return plan, slots

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Release the blocks the last step filled: ``(blocks, slots, fills)`` that every KIVI
        layer must quantize now (``copy_blocks`` does, before copying)."""
        pend = self.pending[self.stage_of_block[self.pending] >= 0]
        slots = self.stage_of_block[pend]
        self.block_of_slot[slots] = -1
        self.stage_of_block[pend] = -1
        self.pending = np.empty(0, dtype=np.int64)
        self._push_map()
        self._plan = None  # the next store is a new step
        return self._dev(pend), self._dev(slots), self._dev(self.fill[pend])

    def plan_copy(self, src: np.ndarray, dst: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy-on-write of blocks ``src -> dst``: staged sources get a slot for ``dst``.

        Returns ``(from_slots, to_slots)`` residual copies to apply in every KIVI layer (after
        the block rows are copied). Raises (changing nothing) if the pool has no free slot.
        """
        staged = self.stage_of_block[src] >= 0
        stage_of_block = self.stage_of_block.copy()
        block_of_slot = self.block_of_slot.copy()
        old = stage_of_block[dst]  # a destination's own residual content is overwritten
        block_of_slot[old[old >= 0]] = -1
        stage_of_block[dst] = -1
        free = np.flatnonzero(block_of_slot < 0)
        if int(staged.sum()) > len(free):
            raise KernelConfigError("the KIVI residual pool has no free slot for a copied block")
        to_slots = free[: int(staged.sum())]
        stage_of_block[dst[staged]] = to_slots
        block_of_slot[to_slots] = dst[staged]
        from_slots = self.stage_of_block[src[staged]]
        self.stage_of_block, self.block_of_slot = stage_of_block, block_of_slot
        self.fill[dst] = self.fill[src]
        self.pending = np.union1d(self.pending, dst[staged & (self.fill[dst] == self.block_size)])
        self.clock += 1
        self.last_use[to_slots] = self.clock
        self._push_map()
        self._plan = None  # the next store is a new step
        return self._dev(from_slots), self._dev(to_slots)

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    def _push_map(self) -> None:
        self.device_map.copy_(torch.from_numpy(self.stage_of_block.astype(np.int32)))
