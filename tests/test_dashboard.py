"""The dashboard's data without a browser: ``kv_snapshot`` against the scheduler, the engine's
``inspect()`` view (counts, owners, hot prefixes, tenants, an abort freeing blocks), the picture's
cost bound, and the Grafana dashboard against the metric names the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from kvcore import LLM, SamplingParams
from kvcore._kvcore import kv_snapshot
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "examples" / "grafana" / "kvcore.json"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_blocks=64, block_size=4, max_model_len=256)


def _greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_snapshot_agrees_with_scheduler(llm):
    engine = llm.engine
    shared = list(range(5, 29))  # 24 tokens = 6 full blocks shared by both requests
    engine.add_request(shared + [40, 41], _greedy(8), request_id="a")
    engine.step()
    engine.step()
    engine.add_request(shared + [50, 51], _greedy(8), request_id="b", cache_salt=None)
    engine.step()
    raw = kv_snapshot(engine.scheduler)
    st = raw["stats"]
    ref, cached = raw["ref_counts"], raw["cached"]
    assert len(ref) == len(cached) == engine.runner.num_blocks
    assert int((ref[1:] == 0).sum()) == st.num_free_blocks
    offsets = raw["offsets"].astype(int)
    assert offsets[-1] == len(raw["blocks"]) and len(offsets) == len(raw["req_ids"]) + 1
    held = np.bincount(raw["blocks"].astype(int), minlength=len(ref))
    held[0] = 0
    assert (held[1:] <= ref[1:]).all() and held.sum() > 0  # pending copies may add refs
    view = engine.inspect()
    c = view["counts"]
    assert c["free"] + c["cached"] == st.num_free_blocks
    assert sum(c.values()) == view["num_blocks"] == engine.runner.num_blocks - 1
    assert c["shared"] >= 6  # the shared prefix's blocks, held by both
    hot = view["hot_prefixes"]
    assert hot and hot[0]["hits"] == 1 and hot[0]["tokens"] >= 24 and hot[0]["pinned"] >= 6
    owners = [t for t in view["hover"].values() if "a, b" in t or "b, a" in t]
    assert len(owners) >= 6
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.check_invariants()


def test_abort_turns_blocks_free_and_tenants_count(llm):
    engine = llm.engine
    before = engine.inspect()["counts"]
    engine.add_request(list(range(100, 140)), _greedy(50), request_id="x", cache_salt="t1")
    for _ in range(3):
        engine.step()
    v = engine.inspect()
    assert v["tenants"]["t1"]["blocks"] >= 10
    assert v["counts"]["running"] >= 10
    engine.abort_request("x")
    after = engine.inspect()
    assert after["counts"]["running"] + after["counts"]["shared"] == 0
    free_now = after["counts"]["free"] + after["counts"]["cached"]
    assert free_now == before["free"] + before["cached"] + before["running"] + before["shared"]
    assert "t1" not in after["tenants"] or after["tenants"]["t1"]["blocks"] == 0


def test_large_pool_groups_cells():
    from kvcore.engine.inspect import MAX_CELLS, _cells

    states = np.zeros(10_000, np.int8)
    states[5] = 3
    cells = _cells(states, -(-10_000 // MAX_CELLS))
    assert len(cells) <= MAX_CELLS and cells[1] == "3" and set(cells) == {"0", "3"}


def test_picture_is_cached_and_cheap(llm):
    from types import SimpleNamespace

    from kvcore.entrypoints.openai.dashboard import Dashboard

    state = SimpleNamespace(
        engine=SimpleNamespace(engine=llm.engine, snapshot={}), metrics=None, model_name="m"
    )
    d = Dashboard(state, min_interval_s=60)
    a = d.picture()
    assert d.picture() is a and d.num_built == 1  # many pages, one build per interval
    assert a["kv"]["build_ms"] < 50 and d.cost_s < 0.5
    body = json.loads(d.response(0.0))
    assert body["kv"] == json.loads(json.dumps(a["kv"])) and len(body["history"]) == 1
    assert json.loads(d.response(body["history"][-1]["t"]))["history"] == []  # only new points


# ---- Grafana -------------------------------------------------------------------------------


def _exported_names(prefix: str) -> set[str]:
    """Sample names ``/metrics`` carries: the server's registry plus the dashboard's series,
    with a picture that has every section (tiers on)."""
    from kvcore.entrypoints.openai.dashboard import CacheCollector
    from kvcore.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("tiny", prefix, {"block_size": 16})
    for h in (m.ttft, m.itl, m.e2e, m.queue, m.overhead):
        h.observe(0.01)
    m.prefix_queries.inc(1)
    m.prefix_hits.inc(1)
    m.preemptions.inc(1)
    m.prompt_tokens.inc(1)
    m.generation_tokens.inc(1)
    pic = {
        "kv": {
            "counts": {"free": 1, "cached": 1, "running": 1, "shared": 1},
            "tenants": {"t": {"blocks": 1, "requests": 1, "hits": 1}},
            "retention": {"released_total": 1},
        },
        "tiers": {
            "resident": {"L1": 1, "L2": 1, "L3": 1, "L4": 1},
            "loaded_blocks": 1,
            "offloaded_blocks": 1,
            "fetch_p50_ms": 1.0,
            "fetch_p95_ms": 1.0,
        },
    }

    class _Dash:
        def picture(self):
            return pic

    m.registry.register(CacheCollector(_Dash(), prefix, "tiny"))
    text = generate_latest(m.registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def _grafana_names(dash: dict, prefix: str) -> set[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    text = "\n".join(exprs).replace("${prefix}", prefix)
    return set(re.findall(rf"\b{prefix}:[a-zA-Z_0-9]+", text))


def _missing(dash: dict, prefix: str) -> set[str]:
    return _grafana_names(dash, prefix) - _exported_names(prefix)


@pytest.mark.parametrize("prefix", ["kvcore", "vllm"])
def test_grafana_dashboard_uses_exported_names(prefix):
    dash = json.loads(GRAFANA.read_text())
    names = _grafana_names(dash, prefix)
    assert len(names) >= 20
    assert not _missing(dash, prefix)
    for needed in (  # the dashboard's quantities, each in some panel
        "kv_cache_usage_perc", "prefix_cache_hits_total", "num_requests_running",
        "num_requests_waiting", "num_preemptions_total", "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket", "generation_tokens_total", "kv_blocks",
        "kv_tenant_blocks", "kv_tenant_prefix_hits_total", "kv_tier_resident_blocks",
        "kv_tier_moved_blocks_total", "kv_tier_fetch_latency_ms",
        "kv_retention_released_blocks_total",
    ):  # fmt: skip
        assert f"{prefix}:{needed}" in names, needed
    # A renamed metric is caught.
    renamed = json.loads(GRAFANA.read_text().replace("kv_cache_usage_perc", "kv_cache_usage"))
    assert _missing(renamed, prefix) == {f"{prefix}:kv_cache_usage"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dash["templating"]["list"]} >= {"datasource", "prefix", "model"}


def test_no_dashboard_flag():
    from kvcore.entrypoints.cli.serve import serve_parser

    assert serve_parser().parse_args([]).dashboard is True
    assert serve_parser().parse_args(["--no-dashboard"]).dashboard is False


def test_static_files_are_package_data():
    from kvcore.entrypoints.openai.dashboard import STATIC

    names = {f.name for f in STATIC.iterdir()}
    assert {"index.html", "dashboard.js", "dashboard.css", "chart.min.js"} <= names
    assert "LICENSE.chart.js.txt" in names
    html = (STATIC / "index.html").read_text()
    assert "http://" not in html and "https://" not in html  # nothing from a CDN


def test_inspect_from_another_thread_while_stepping(llm):
    """The dashboard's thread reads while the engine thread steps: no error, counts consistent."""
    import threading

    engine = llm.engine
    errors: list[BaseException] = []
    views: list[dict] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                views.append(engine.inspect())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(6):
        engine.add_request(list(range(60, 90)) + [i], _greedy(12), cache_salt=f"s{i % 2}")
    while engine.has_unfinished_requests():
        engine.step()
    stop.set()
    t.join(30)
    assert not errors and views
    for v in views:
        assert sum(v["counts"].values()) == v["num_blocks"]
        assert v["counts"]["free"] + v["counts"]["cached"] == v["num_free_blocks"]
    engine.scheduler.check_invariants()
