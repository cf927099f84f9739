"""EngineStats: counters of an engine's life (steps, time inside and outside the forward, KV
usage and waste, preemptions, prefix hits), updated once per step by ``LLMEngine``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_STAT_FIELDS = (
    "num_running",
    "num_waiting",
    "kv_usage",
    "num_free_blocks",
    "prefix_query_tokens",
    "prefix_hit_tokens",
    "num_preemptions",
    "num_computed_tokens",
)


@dataclass
class EngineStats:
    """Counters of an engine's life: steps, time split, KV usage, preemptions, prefix hits."""

    num_blocks: int
    block_size: int
    num_steps: int = 0
    num_finished: int = 0
    step_seconds: float = 0.0  # inside step()
    forward_seconds: float = 0.0  # inside the model's forward
    peak_kv_usage: float = 0.0  # fraction of non-null blocks in use, at its peak
    peak_running: int = 0
    waste_sum: float = 0.0  # per step: fraction of the running sequences' slots past their end
    waste_steps: int = 0
    sampled_tokens: int = 0
    busy_step_seconds: float = 0.0  # steps with >= 64 running sequences
    busy_forward_seconds: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)  # the scheduler's latest stats
    last_tokens: int = 0  # tokens in the latest plan (prefill chunks + one per decode)
    last_seqs: int = 0  # sequences in the latest plan

    def reset(self) -> None:
        """Zero the counters (e.g. after a warm-up)."""
        self.__init__(self.num_blocks, self.block_size)  # type: ignore[misc]

    def observe_plan(self, plan: Any, scheduler: Any) -> None:
        """Called after each schedule(): track KV usage and waste."""
        st = scheduler.stats()
        self.last = {k: getattr(st, k) for k in _STAT_FIELDS}
        self.last_tokens, self.last_seqs = len(plan.input_ids), len(plan.seq_lens)
        usage = float(st.kv_usage)
        self.peak_kv_usage = max(self.peak_kv_usage, usage)
        self.peak_running = max(self.peak_running, int(st.num_running))
        # Internal fragmentation of the scheduled sequences: slots of their blocks past their
        # last token (a paged cache wastes nothing else).
        lens = plan.seq_lens
        if len(lens):
            bs = self.block_size
            slots = int(((lens + bs - 1) // bs).sum()) * bs
            self.waste_sum += 1.0 - float(lens.sum()) / slots
            self.waste_steps += 1

    def observe_step(self, seconds: float, forward: float, sampled: int) -> None:
        """Called at the end of each step."""
        self.num_steps += 1
        self.step_seconds += seconds
        self.forward_seconds += forward
        self.sampled_tokens += sampled
        if self.last.get("num_running", 0) >= 64:
            self.busy_step_seconds += seconds
            self.busy_forward_seconds += forward

    @property
    def overhead_at_64(self) -> float | None:
        """Fraction of step time outside the forward, over steps with >= 64 running."""
        if self.busy_step_seconds == 0:
            return None
        return 1.0 - self.busy_forward_seconds / self.busy_step_seconds

    @property
    def mean_waste(self) -> float:
        """Mean over steps of the fraction of the scheduled sequences' KV slots holding no
        token (internal fragmentation of their last blocks)."""
        return self.waste_sum / self.waste_steps if self.waste_steps else 0.0
