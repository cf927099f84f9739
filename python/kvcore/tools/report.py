"""Run summaries: throughput, latency percentiles, cache figures and the
engine's own share of the time. A report is a list of ``Row`` (name, what, value, unit), printed
as a readable table (``format_table``), as ``name: value unit`` lines or as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcore.engine.stats import EngineStats  # noqa: E402,F401  (reports read it)
from kvcore.outputs import RequestOutput

# engine_figures() key -> (what it is, unit)
ENGINE_FIGURES = {
    "prefix_hit_rate_pct": ("prefix cache hit rate", "%"),
    "peak_kv_usage_pct": ("peak KV cache usage", "%"),
    "kv_waste_pct": ("KV slots past sequence ends", "%"),
    "preemptions": ("preemptions", ""),
    "steps": ("engine steps", ""),
    "engine_overhead_pct": ("time outside the model forward", "%"),
    "engine_overhead_at_64_running_pct": ("same, steps with >= 64 running", "%"),
}


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

    def rows(self, prefix: str = "kvcore") -> list[Row]:
        """The summary as (name, what, value, unit) rows, names prefixed with ``prefix_``."""
        out = [
            Row(f"{prefix}_requests", "requests finished", self.num_requests, "req"),
            Row(f"{prefix}_output_tokens", "output tokens", self.output_tokens, "tok"),
            Row(f"{prefix}_wall_s", "wall time", round(self.wall_s, 2), "s"),
            Row(f"{prefix}_tok_per_s", "output throughput", round(self.tok_per_s, 1), "tok/s"),
        ]
        for name, what, vals in (
            ("ttft", "time to first token", self.ttft_s),
            ("itl", "inter-token latency", self.itl_s),
        ):
            for q, v in percentiles(vals).items():
                out.append(
                    Row(f"{prefix}_{name}_p{q}_ms", f"{what}, p{q}", round(v * 1e3, 1), "ms")
                )
        for key, value in self.engine.items():
            what, unit = ENGINE_FIGURES.get(key, (key.replace("_", " "), ""))
            out.append(Row(f"{prefix}_{key}", what, value, unit))
        return out

    def lines(self, prefix: str = "kvcore") -> list[str]:
        """The summary as ``name: value unit`` lines (the machine-readable form)."""
        return [r.line() for r in self.rows(prefix)]


@dataclass(frozen=True)
class Row:
    """One figure of a report: its line name, what it is, its value and unit."""

    name: str
    what: str
    value: float | int
    unit: str = ""

    def text(self) -> str:
        """The value as printed (floats to 4 significant digits unless already rounded)."""
        v = self.value
        if isinstance(v, float) and v != round(v, 2):
            return f"{v:.4g}"
        return str(v)

    def line(self) -> str:
        """``name: value unit``."""
        return f"{self.name}: {self.text()} {self.unit}".rstrip()


def format_table(rows: list[Row], title: str | None = None) -> str:
    """Rows as an aligned, readable table (what | value | unit)."""
    what_w = max([len(r.what) for r in rows] + [4])
    value_w = max([len(r.text()) for r in rows] + [5])
    out = [title] if title else []
    out.append(f"{'what':<{what_w}}  {'value':>{value_w}}  unit")
    out.append(f"{'-' * what_w}  {'-' * value_w}  ----")
    out += [f"{r.what:<{what_w}}  {r.text():>{value_w}}  {r.unit}".rstrip() for r in rows]
    return "\n".join(out)


def rows_json(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Rows as a JSON-ready dict: name -> {value, unit, what} (non-finite values as null)."""
    return {
        r.name: {
            "value": r.value if not isinstance(r.value, float) or np.isfinite(r.value) else None,
            "unit": r.unit,
            "what": r.what,
        }
        for r in rows
    }


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
    figures.update(engine.tier_figures() if hasattr(engine, "tier_figures") else {})
    if st.overhead_at_64 is not None:
        figures["engine_overhead_at_64_running_pct"] = 100.0 * st.overhead_at_64
    return figures
