"""Run summaries: throughput, latency percentiles and cache figures, as ``name: value unit``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcore.outputs import RequestOutput


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 95, 99)) -> dict[int, float]:
    """Percentiles of ``values`` (nan when empty)."""
    if not values:
        return {q: float("nan") for q in qs}
    arr = np.asarray(values, dtype=np.float64)
    return {q: float(np.percentile(arr, q)) for q in qs}


@dataclass
class RunSummary:
    """Figures of one engine run over a set of requests."""

    num_requests: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    engine: dict[str, float] = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def lines(self, prefix: str = "kvcore") -> list[str]:
        """The summary as ``name: value unit`` lines."""
        out = [
            f"{prefix}_requests: {self.num_requests} req",
            f"{prefix}_output_tokens: {self.output_tokens} tok",
            f"{prefix}_wall_s: {self.wall_s:.2f} s",
            f"{prefix}_tok_per_s: {self.tok_per_s:.1f} tok/s",
        ]
        for name, vals in (("ttft", self.ttft_s), ("itl", self.itl_s)):
            for q, v in percentiles(vals).items():
                out.append(f"{prefix}_{name}_p{q}_ms: {v * 1e3:.1f} ms")
        for key, value in self.engine.items():
            out.append(
                f"{prefix}_{key}: {value:.4g}"
                if isinstance(value, float)
                else f"{prefix}_{key}: {value}"
            )
        return out


def summarize(outputs: list[RequestOutput], wall_s: float, engine: Any | None = None) -> RunSummary:
    """Summarize finished outputs (timings from each request's metrics)."""
    ttft, itl = [], []
    tokens = 0
    for o in outputs:
        tokens += sum(len(c.token_ids) for c in o.outputs)
        t = o.metrics.time_to_first_token
        if t is not None:
            ttft.append(t)
        itl.extend(o.metrics.inter_token_latencies)
    s = RunSummary(len(outputs), tokens, wall_s, ttft, itl)
    if engine is not None:
        s.engine = engine_figures(engine, wall_s)
    return s


def engine_figures(engine: Any, wall_s: float) -> dict[str, float]:
    """Cache and overhead figures of an LLMEngine after a run."""
    st = engine.stats
    now = engine.scheduler.stats()
    last = {
        "prefix_query_tokens": now.prefix_query_tokens,
        "prefix_hit_tokens": now.prefix_hit_tokens,
        "num_preemptions": now.num_preemptions,
    }
    queried = float(last.get("prefix_query_tokens", 0))
    hit = float(last.get("prefix_hit_tokens", 0))
    forward = st.forward_seconds
    figures = {
        "prefix_hit_rate_pct": 100.0 * hit / queried if queried else 0.0,
        "peak_kv_usage_pct": 100.0 * st.peak_kv_usage,
        "kv_waste_pct": 100.0 * st.mean_waste,
        "preemptions": int(last.get("num_preemptions", 0)),
        "steps": st.num_steps,
        "engine_overhead_pct": 100.0 * max(0.0, wall_s - forward) / wall_s if wall_s else 0.0,
    }
    if st.overhead_at_64 is not None:
        figures["engine_overhead_at_64_running_pct"] = 100.0 * st.overhead_at_64
    return figures
