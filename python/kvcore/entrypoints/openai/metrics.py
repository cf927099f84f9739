"""Prometheus metrics of ``kvcore serve``, named as vLLM's v1 metrics.

The names are vLLM's (``vllm:num_requests_running``, ``vllm:prefix_cache_hits_total``, ...) under
a configurable prefix: ``kvcore:`` by default, ``--metrics-prefix vllm`` to emit ``vllm:`` so
existing Grafana dashboards read kvcore unchanged. Every series carries the ``model_name`` label,
as vLLM's do. Counters that mirror the scheduler's cumulative statistics (prefix-cache queries and
hits in tokens, preemptions) advance by the difference between two snapshots; request counters
and histograms are observed when a request finishes, in the engine thread.
``<prefix>:request_server_overhead_seconds`` is kvcore's own: time a request spent in the server
outside the engine (HTTP, JSON, SSE, inbox queueing).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket bounds in seconds.
_TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
_OVERHEAD_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip


class ServerMetrics:
    """The server's Prometheus registry and the hooks that feed it."""

    def __init__(self, model_name: str, prefix: str = "kvcore", cache_info: dict | None = None):
        if not prefix.replace("_", "").isalnum():
            raise ValueError(f"metrics prefix must be alphanumeric or '_': {prefix!r}")
        disable_created_metrics()  # no *_created series, as vLLM
        self.registry = CollectorRegistry()
        self.prefix = prefix
        reg, label = self.registry, ["model_name"]

        def name(short: str) -> str:
            return f"{prefix}:{short}"

        def counter(short: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name(short), doc, label + (extra or []), registry=reg)

        def gauge(short: str, doc: str) -> Gauge:
            return Gauge(name(short), doc, label, registry=reg)

        def hist(short: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name(short), doc, label, buckets=buckets, registry=reg)

        m = model_name
        self.running = gauge("num_requests_running", "Requests in the running batch.").labels(m)
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.").labels(m)
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage (1 = full).").labels(m)
        self.free_blocks = gauge("num_free_blocks", "KV blocks not held by a request.").labels(m)
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens served by the prefix cache."
        ).labels(m)
        self.preemptions = counter("num_preemptions", "Preemptions of running requests.").labels(m)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(
            m
        )
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated for finished requests."
        ).labels(m)
        self._success = counter(
            "request_success", "Finished requests by finish reason.", ["finished_reason"]
        )
        for reason in ("stop", "length", "abort"):
            self._success.labels(m, reason)  # exported at zero from the start
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Time waiting to be scheduled.", _E2E_BUCKETS
        )
        self.overhead = hist(
            "request_server_overhead_seconds",
            "Time in the server outside the engine (HTTP, JSON, SSE, inbox).",
            _OVERHEAD_BUCKETS,
        )
        self.ttft, self.itl, self.e2e = self.ttft.labels(m), self.itl.labels(m), self.e2e.labels(m)
        self.queue, self.overhead = self.queue.labels(m), self.overhead.labels(m)
        self.model_name = m
        info = Gauge(
            name("cache_config_info"),
            "Information of the KV-cache configuration.",
            sorted(cache_info or {}),
            registry=reg,
        )
        if cache_info:
            info.labels(**{k: str(v) for k, v in cache_info.items()}).set(1)
        self._last: dict[str, int] = {}

    def observe_step(self, engine: Any, outputs: list[Any]) -> None:
        """Called by the engine thread with a step's (or an abort's) outputs."""
        for out in outputs:
            if not out.finished:
                continue
            met = out.metrics
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            num_generated = sum(len(c.token_ids) for c in out.outputs)
            self.generation_tokens.inc(num_generated)
            reason = out.outputs[0].finish_reason or "abort"
            self._success.labels(self.model_name, reason).inc()
            if met.time_to_first_token is not None:
                self.ttft.observe(met.time_to_first_token)
            for dt in met.inter_token_latencies:
                self.itl.observe(dt)
            if met.e2e_latency is not None:
                self.e2e.observe(met.e2e_latency)
            if met.queue_time is not None:
                self.queue.observe(met.queue_time)

    def observe_snapshot(self, snap: dict[str, Any]) -> None:
        """Gauges from the engine thread's latest snapshot; cumulative counters by difference."""
        self.running.set(snap["num_running"])
        self.waiting.set(snap["num_waiting"])
        self.kv_usage.set(snap["kv_usage"])
        self.free_blocks.set(snap["num_free_blocks"])
        for key, metric in (
            ("prefix_query_tokens", self.prefix_queries),
            ("prefix_hit_tokens", self.prefix_hits),
            ("num_preemptions", self.preemptions),
        ):
            delta = snap[key] - self._last.get(key, 0)
            if delta > 0:
                metric.inc(delta)
            self._last[key] = snap[key]

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
