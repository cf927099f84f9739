"""``/dashboard``: a live page of the KV cache in ``kvcore serve`` (off with ``--no-dashboard``).

Routes (behind ``--api-key`` like the API; a browser passes it once as ``/dashboard?key=KEY``,
the page then sends it as a Bearer header)::

    GET /dashboard               the page (static/dashboard/index.html)
    GET /dashboard/static/NAME   its script, style and the vendored Chart.js (no CDN: offline)
    GET /dashboard/api/state     one JSON picture: block map, hot prefixes, tenants, tiers,
                                 retention, and the history of the vLLM-named metrics
                                 (``?since=T``: only the points after T; the page keeps its own)

Cost bound: a picture is built at most once per ``min_interval_s`` (1 s) however many pages
poll (they share the cached one), and while requests run only if the last picture's CPU time
is at most 0.5 % of the server's CPU time since (``_affordable``; at most 5 s apart). Building
it is one ``LLMEngine.inspect()`` (one Rust snapshot under the engine's state lock, the view
outside it) plus a read of the charted Prometheus series, in a worker thread so the event loop
never waits for the engine's lock; the JSON is encoded once per picture.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import math
import threading
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvcore.engine.inspect import engine_view
from kvcore.entrypoints.openai.protocol import ApiError

STATIC = resources.files("kvcore.entrypoints.openai") / "static" / "dashboard"
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".txt": "text/plain"}
HISTORY = 300  # points kept (5 minutes at one a second)
log = logging.getLogger("kvcore.dashboard")
CPU_SHARE = 0.005  # while requests run, pictures take at most this share of the server's CPU
MAX_AGE_S = 5.0  # ... unless the newest picture is older than this


def _finite(x: Any) -> float | None:
    """A figure for JSON: None for a missing or non-finite one (an empty percentile is NaN)."""
    return None if x is None or not math.isfinite(x) else round(float(x), 3)


def _quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts (None when empty)."""
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank, prev_b, prev_c = q * total, 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if b == float("inf"):
                return prev_b
            return prev_b + (b - prev_b) * (rank - prev_c) / max(c - prev_c, 1e-12)
        prev_b, prev_c = b, c
    return prev_b


def _read_registry(metrics: Any) -> dict[str, Any]:
    """Counter totals and histogram buckets the charts need, from the server's registry."""
    out: dict[str, Any] = {}
    p = metrics.prefix + ":"
    wanted = (
        metrics.ttft, metrics.itl, metrics.generation_tokens, metrics.prompt_tokens,
        metrics.prefix_queries, metrics.prefix_hits, metrics.preemptions,
    )  # fmt: skip
    for fam in (f for m in wanted for f in m.collect()):  # only these series: ~0.1 ms
        for s in fam.samples:
            name = s.name.removeprefix(p)
            if name.endswith("_bucket"):
                out.setdefault(name, []).append((float(s.labels["le"]), s.value))
            elif name == "request_success_total":
                out[f"success_{s.labels['finished_reason']}"] = s.value
            else:
                out[name] = s.value
    return out


class Dashboard:
    """The page's data: the latest picture and the metric history (server side, so a page
    opened late still sees the last five minutes)."""

    def __init__(self, state: Any, min_interval_s: float = 1.0):
        self.state = state
        self.min_interval_s = min_interval_s
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._prev: dict[str, Any] | None = None
        self._window: collections.deque[dict[str, Any]] = collections.deque(maxlen=10)
        self._picture: dict[str, Any] | None = None
        self._encoded: tuple[dict[str, Any], bytes] | None = None
        self._last_cpu = 0.0  # CPU seconds of the newest picture
        self._proc_at = 0.0  # the process's CPU seconds when it was built
        self._at = 0.0
        self._lock = threading.RLock()
        self._building = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's (set by the route)
        if state.metrics is not None:
            state.metrics.registry.register(
                CacheCollector(self, state.metrics.prefix, state.metrics.model_name)
            )
        self.cost_s = 0.0  # wall time spent building pictures (for the overhead report)
        self.cpu_s = 0.0  # CPU time of the same (what the engine thread can lose to it)
        self.num_built = 0

    def response(self, since: float) -> bytes:
        """The JSON body: the picture (encoded once per picture) and the history points newer
        than ``since`` (all of them for 0), so a polling page receives one new point a second."""
        with self._lock:
            pic = self.picture()
            c0 = time.thread_time()
            if self._encoded is None or self._encoded[0] is not pic:
                self._encoded = (pic, json.dumps(pic).encode())
                self._last_cpu += time.thread_time() - c0  # the budget counts encoding too
            body = self._encoded[1]
            points = [pt for pt in self.history if pt["t"] > since] if since else list(self.history)
            out = b'{"history":' + json.dumps(points).encode() + b"," + body[1:]
            self.cpu_s += time.thread_time() - c0
            return out

    def picture(self) -> dict[str, Any]:
        """The cached picture, rebuilt if older than ``min_interval_s`` (thread-safe)."""
        with self._lock:
            now = time.monotonic()
            stale = self._picture is None or now - self._at >= self.min_interval_s
            if stale and not self._building and self._affordable(now):
                t0, c0 = time.perf_counter(), time.thread_time()
                self._building = True
                try:
                    self._picture = self._build(now)
                finally:
                    self._building = False
                self.cost_s += time.perf_counter() - t0
                self.cpu_s += time.thread_time() - c0
                self.num_built += 1
                self._at = now
                self._last_cpu = time.thread_time() - c0
                self._proc_at = time.process_time()
            return self._picture or {}

    def _affordable(self, now: float) -> bool:
        """The cost bound: while the engine has work, a new picture only if the last one's CPU
        time is at most ``CPU_SHARE`` of the process's CPU time since (or it is ``MAX_AGE_S``
        old). A CPU-starved server thus updates its page less often instead of losing more
        than 0.5 % to it; an idle one (nothing to lose) updates every second."""
        if self._picture is None or now - self._at >= MAX_AGE_S:
            return True
        if not self.state.engine.snapshot.get("num_unfinished", 0):
            return True
        if getattr(self.state.engine, "engine", None) is None:
            return True  # engine process: the view is built there (~1 ms a second), not here
        return self._last_cpu <= CPU_SHARE * (time.process_time() - self._proc_at)

    def _build(self, now: float) -> dict[str, Any]:
        view = self._engine_view()
        kv, tiers = view["kv"], view["tiers"]
        reg = _read_registry(self.state.metrics) if self.state.metrics is not None else {}
        point = self._point(now, kv, reg, tiers)
        return {
            "model": self.state.model_name,
            "time": time.time(),
            "kv": kv,
            "tiers": tiers,
            "point": point,
            "cost": {
                "build_ms_total": round(self.cost_s * 1e3, 1),
                "build_cpu_ms_total": round(self.cpu_s * 1e3, 1),
                "pictures": self.num_built,
            },
        }

    def _engine_view(self) -> dict[str, Any]:
        """``engine_view`` of the engine: read in this process (``--engine-in-process``), or
        one utility call to the engine process (its own CPU, not the server's)."""
        handle = self.state.engine
        inner = getattr(handle, "engine", None)
        if inner is not None:  # AsyncEngine: the LLMEngine is here (thread-safe reads)
            return engine_view(inner)
        if self.loop is None:
            raise RuntimeError("the dashboard needs the server's event loop")
        fut = asyncio.run_coroutine_threadsafe(handle.call("dashboard_view"), self.loop)
        return fut.result(timeout=10)

    def _point(
        self, now: float, kv: dict[str, Any], reg: dict[str, Any], tiers: dict[str, Any] | None
    ) -> dict[str, Any]:
        snap = self.state.engine.snapshot
        cur = {
            "t": now,
            "gen": reg.get("generation_tokens_total", 0.0),
            "prompt": reg.get("prompt_tokens_total", 0.0),
            "q": reg.get("prefix_cache_queries_total", 0.0),
            "h": reg.get("prefix_cache_hits_total", 0.0),
            "pre": reg.get("num_preemptions_total", 0.0),
            "ttft": reg.get("time_to_first_token_seconds_bucket", []),
            "itl": reg.get("inter_token_latency_seconds_bucket", []),
            "load": tiers["loaded_blocks"] if tiers else 0,
            "off": tiers["offloaded_blocks"] if tiers else 0,
        }
        self._window.append(cur)
        prev = self._prev or cur
        self._prev = cur
        dt = max(cur["t"] - prev["t"], 1e-9)
        old = self._window[0]  # percentiles over the last ~10 pictures

        def rate(k: str) -> float:
            return round((cur[k] - prev[k]) / dt, 2) if cur is not prev else 0.0

        def pct(k: str, q: float) -> float | None:
            new, base = cur[k], dict(old[k])
            if not new:
                return None
            bounds = [b for b, _ in new]
            counts = [c - base.get(b, 0.0) for b, c in new]
            v = _quantile(q, bounds, counts)
            return None if v is None else round(v * 1e3, 2)

        dq = cur["q"] - prev["q"]
        point = {
            "t": round(time.time(), 3),
            "kv_usage": snap.get("kv_usage", 0.0),
            "running": snap.get("num_running", 0),
            "waiting": snap.get("num_waiting", 0),
            "hit_rate": round((cur["h"] - prev["h"]) / dq, 4) if dq > 0 else None,
            "preemptions_per_s": rate("pre"),
            "gen_tokens_per_s": rate("gen"),
            "prompt_tokens_per_s": rate("prompt"),
            "ttft_p50_ms": pct("ttft", 0.5),
            "ttft_p99_ms": pct("ttft", 0.99),
            "itl_p50_ms": pct("itl", 0.5),
            "itl_p99_ms": pct("itl", 0.99),
            "loads_per_s": rate("load"),
            "offloads_per_s": rate("off"),
            "tenants": {k: v["blocks"] for k, v in kv["tenants"].items()},
            "tenant_hits": {k: v.get("hits", 0) for k, v in kv["tenants"].items()},
        }
        self.history.append(point)
        return point


class CacheCollector:
    """The dashboard's quantities as Prometheus series (for Grafana), read from the cached
    picture at scrape time: blocks by state, per-``cache_salt`` blocks and hits, tier
    residency and moves, retention's released blocks. kvcore's own names (no vLLM peer)."""

    def __init__(self, dashboard: Dashboard, prefix: str, model_name: str):
        self.dashboard, self.prefix, self.model = dashboard, prefix, model_name

    def describe(self) -> list:
        return []  # no collect() at registration time

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if getattr(self.dashboard, "_building", False):  # inside a picture: nothing to add
            return
        try:
            pic = self.dashboard.picture()
        except Exception as e:  # noqa: BLE001 - a scrape never fails for the dashboard's series
            # e.g. a Ray replica's metrics push, off the event loop that reaches the engine
            # process: the other series are still rendered.
            log.debug("dashboard series skipped: %s", e)
            return
        if not pic:
            return
        kv, tiers, m, p = pic["kv"], pic["tiers"], self.model, self.prefix
        g = GaugeMetricFamily(
            f"{p}:kv_blocks", "KV blocks by state.", labels=["model_name", "state"]
        )
        for state, n in kv["counts"].items():
            g.add_metric([m, state], n)
        yield g
        tb = GaugeMetricFamily(
            f"{p}:kv_tenant_blocks",
            "KV blocks held per cache_salt.",
            labels=["model_name", "cache_salt"],
        )
        th = CounterMetricFamily(
            f"{p}:kv_tenant_prefix_hits",
            "Requests served a prefix-cache hit, per cache_salt.",
            labels=["model_name", "cache_salt"],
        )
        for salt, t in kv["tenants"].items():
            tb.add_metric([m, salt], t["blocks"])
            th.add_metric([m, salt], t.get("hits", 0))
        yield tb
        yield th
        r = CounterMetricFamily(
            f"{p}:kv_retention_released_blocks",
            "Blocks released by retention (windows, sinks, H2O).",
            labels=["model_name"],
        )
        r.add_metric([m], kv["retention"]["released_total"])
        yield r
        res = GaugeMetricFamily(
            f"{p}:kv_tier_resident_blocks",
            "Blocks resident per tier.",
            labels=["model_name", "tier"],
        )
        moves = CounterMetricFamily(
            f"{p}:kv_tier_moved_blocks",
            "Blocks moved between L1 and L2 (load: into the pool; offload: out of it).",
            labels=["model_name", "direction"],
        )
        fetch = GaugeMetricFamily(
            f"{p}:kv_tier_fetch_latency_ms",
            "L3/L4 fetch latency percentiles (ms).",
            labels=["model_name", "quantile"],
        )
        if tiers is not None:
            for tier, n in tiers["resident"].items():
                if n is not None:
                    res.add_metric([m, tier], n)
            moves.add_metric([m, "load"], tiers["loaded_blocks"])
            moves.add_metric([m, "offload"], tiers["offloaded_blocks"])
            for q, key in (("0.5", "fetch_p50_ms"), ("0.95", "fetch_p95_ms")):
                if tiers[key] is not None:
                    fetch.add_metric([m, q], tiers[key])
        else:
            c = kv["counts"]
            res.add_metric([m, "L1"], c["running"] + c["shared"] + c["cached"])
        yield res
        yield moves
        yield fetch


def _check_key(state: Any, request: Request) -> None:
    """``--api-key``: a Bearer header, or ``?key=`` (what a browser's address bar can carry)."""
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.query_params.get("key", "")
    if not hmac.compare_digest(given.encode(), state.api_key.encode()):
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


def mount(app: FastAPI, state: Any, dashboard: Dashboard) -> None:
    """Add the dashboard's routes to the server's app."""

    @app.get("/dashboard")
    async def page(request: Request) -> Response:
        _check_key(state, request)
        return Response((STATIC / "index.html").read_bytes(), media_type="text/html")

    @app.get("/dashboard/static/{name}")
    async def static(name: str, request: Request) -> Response:
        names = {f.name for f in STATIC.iterdir()}
        if name not in names:
            raise ApiError(404, f"no file {name!r}", code="not_found")
        kind = _TYPES.get(name[name.rfind(".") :], "application/octet-stream")
        headers = {"Cache-Control": "max-age=3600"}
        return Response((STATIC / name).read_bytes(), media_type=kind, headers=headers)

    @app.get("/dashboard/api/state")
    async def api_state(request: Request, since: float = 0.0) -> Response:
        _check_key(state, request)
        dashboard.loop = asyncio.get_running_loop()
        body = await asyncio.to_thread(dashboard.response, since)
        return Response(body, media_type="application/json")
