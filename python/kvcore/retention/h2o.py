"""H2O in the engine: accumulate each sequence's attention mass per block, drop the lightest.

Heavy hitters (H2O, Zhang et al. 2023): a sequence keeps its sinks, a recent window and, within
a budget, the blocks that received the most attention so far. Per step:

1. ``mass_tensor(plan)``: when the plan has an H2O row, a float32 ``[rows, width]`` zero tensor
   that every layer's ``paged_attention`` adds its attention mass into (``block_mass=``, summed
   over heads, query rows and layers; released blocks get none). Otherwise ``None``: no cost.
2. ``drops(plan, mass)``: per H2O row, add the step's mass to the sequence's running total and
   ask ``retention.blocks_to_release`` which of the blocks that were full *before* the step to
   give up (the step's own blocks were computed with the whole context and are kept until the
   next step). The pairs ``(plan row, logical block)`` go to ``Scheduler.update(drop_blocks=)``:
   one array, so the step still crosses into Rust twice.

State is per sample (``req_id, seq_index``): the running mass and which blocks it still holds. A
sample that restarts (recompute preemption: fewer tokens computed than last seen) starts over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcore.retention.spec import RetentionPolicy, blocks_to_release


@dataclass
class _Seq:
    mass: np.ndarray  # float64 [blocks]: accumulated attention per logical block
    live: np.ndarray  # bool [blocks]: still held (not dropped)
    computed: int  # tokens computed after the last step it ran in


class H2OTracker:
    """The engine's H2O state (one per engine, used under its state lock)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.policies: dict[int, RetentionPolicy] = {}  # internal request id -> h2o policy
        self._seqs: dict[tuple[int, int], _Seq] = {}

    def add(self, internal_id: int, policy: RetentionPolicy) -> None:
        if policy.kind == "h2o":
            self.policies[internal_id] = policy

    def forget(self, internal_id: int) -> None:
        if self.policies.pop(internal_id, None) is not None:
            for key in [k for k in self._seqs if k[0] == internal_id]:
                del self._seqs[key]

    def rows(self, plan: Any) -> np.ndarray:
        """Plan rows of H2O requests."""
        if not self.policies:
            return np.zeros(0, np.int64)
        ids = np.fromiter(self.policies, np.int64, len(self.policies))
        return np.flatnonzero(np.isin(np.asarray(plan.req_ids), ids))

    def mass_tensor(self, plan: Any, device: torch.device) -> torch.Tensor | None:
        if not len(self.rows(plan)):
            return None
        table = np.asarray(plan.block_table)
        return torch.zeros(table.shape, dtype=torch.float32, device=device)

    def drops(self, plan: Any, mass: torch.Tensor | None) -> np.ndarray:
        """Flat ``(plan row, logical block)`` pairs to release after this step."""
        rows = self.rows(plan)
        if mass is None or not len(rows):
            return np.zeros(0, np.int64)
        host = mass.detach().to("cpu", torch.float64).numpy()
        qsl = np.asarray(plan.query_start_loc)
        seq_lens = np.asarray(plan.seq_lens)
        req_ids, seq_index = np.asarray(plan.req_ids), np.asarray(plan.seq_index)
        bs = self.block_size
        out: list[int] = []
        for row in rows.tolist():
            rid = int(req_ids[row])
            key = (rid, int(seq_index[row]))
            seq_len = int(seq_lens[row])
            before = seq_len - int(qsl[row + 1] - qsl[row])  # computed before this step
            n = -(-seq_len // bs)
            s = self._seqs.get(key)
            if s is None or before < s.computed:  # new, or recomputing after a preemption
                s = _Seq(np.zeros(0), np.zeros(0, bool), 0)
                self._seqs[key] = s
            if len(s.mass) < n:
                grow = n - len(s.mass)
                s.mass = np.concatenate([s.mass, np.zeros(grow)])
                s.live = np.concatenate([s.live, np.ones(grow, bool)])
            s.mass[:n] += host[row, :n]
            s.computed = seq_len
            nb = -(-before // bs)
            if nb == 0:
                continue
            drop = blocks_to_release(
                self.policies[rid], before, bs, s.live[:nb].copy(), s.mass[:nb]
            )
            s.live[drop] = False
            for b in drop.tolist():
                out.extend((row, b))
        return np.asarray(out, np.int64)
