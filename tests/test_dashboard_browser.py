"""``/dashboard`` in a real browser: Debian's Chromium driven by Playwright, a ``kvcore serve``
subprocess (tiny Llama with a tokenizer, an L2 host tier), load from the official ``openai``
client, and assertions on what a person sees: the map's counts against the engine's, a shared
prefix in the hot list with its hits, the L2 count moving when blocks are offloaded, an aborted
stream's blocks turning free. Skips (with the reason) where no browser can run."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_util import ServerProcess, make_model_dir

KEY = "sk-dash-key"
NUM_BLOCKS = 600  # block size 4: the pool holds 2,396 tokens, so distinct prompts evict
CHROMIUM = os.environ.get("KVCORE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
SHARED = (
    "The shared system prompt of every tenant in this test: answer briefly, cite the manual, "
    "and never reveal the contents of the cache. "
)


# Wide enough that a decode step takes tens of ms on one thread: a 400-token stream then runs
# for seconds, so the page (redrawn once a second) sees it running before it ends on its own.
# (The 64-wide test model finishes 400 tokens in about a second, a race the page could lose.)
WIDE = dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
            intermediate_size=3072)  # fmt: skip


def _playwright():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright missing: pip install pytest-playwright"
    )
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
    return sync_api


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("tiny-dash"), **WIDE)
    srv = ServerProcess(
        "--model", str(model), "--served-model-name", "tiny", "--api-key", KEY,
        "--num-blocks", str(NUM_BLOCKS), "--block-size", "4", "--max-model-len", "512",
        "--max-num-seqs", "16", "--host-kv-mb", "4", "--threads", "1",
    )  # fmt: skip
    yield srv.wait_ready()
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def dash_browser():
    sync_api = _playwright()
    with sync_api.sync_playwright() as pw:
        try:
            b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        except Exception as e:  # noqa: BLE001 - a browser that cannot start is a skip
            pytest.skip(f"Chromium at {CHROMIUM} does not start under Playwright: {e}")
        yield b
        b.close()


@pytest.fixture
def dash_page(dash_browser, server):
    pg = dash_browser.new_page(viewport={"width": 1400, "height": 1100})
    pg.goto(f"{server.url}/dashboard?key={KEY}")
    _wait_updates(pg, 1)
    yield pg
    pg.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _updates(pg) -> int:
    return int(pg.get_attribute("#status", "data-updates") or 0)


def _wait_updates(pg, n: int = 1, timeout: float = 30.0) -> None:
    """Wait until the page redrew ``n`` more times (a redraw after the state changed)."""
    start, deadline = _updates(pg), time.monotonic() + timeout
    while _updates(pg) < start + n:
        assert time.monotonic() < deadline, pg.text_content("#status")
        pg.wait_for_timeout(100)


def _counts(pg) -> dict[str, int]:
    return {s: int(pg.text_content(f"#count-{s}")) for s in ("free", "cached", "running", "shared")}


def _wait_idle(server, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = server.health()
        if h["num_unfinished"] == 0 and h["all_blocks_free"]:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


def test_map_counts_equal_engine_stats(dash_page, server, client):
    for i in range(3):
        client.completions.create(model="tiny", prompt=f"count {i}: " + SHARED, max_tokens=4)
    h = _wait_idle(server)
    _wait_updates(dash_page, 2)  # a picture taken after the load ended (pictures are <= 1 s old)
    c = _counts(dash_page)
    assert c["free"] + c["cached"] == h["num_free_blocks"]
    assert c["running"] + c["shared"] == h["num_blocks"] - h["num_free_blocks"] == 0
    assert sum(c.values()) == h["num_blocks"] == NUM_BLOCKS - 1
    assert c["cached"] > 0  # the prompts' full blocks stay cached
    # What is drawn is what is counted: one cell per block, coloured by its state.
    assert dash_page.locator("#map .cell").count() == h["num_blocks"]
    for k, state in enumerate(("free", "cached", "running", "shared")):
        assert dash_page.locator(f"#map .cell.s{k}").count() == c[state]
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert f'kvcore:kv_blocks{{model_name="tiny",state="cached"}} {float(c["cached"])}' in metrics


def test_shared_prefix_in_hot_list_with_hits(dash_page, server, client):
    for i in range(4):
        client.completions.create(model="tiny", prompt=SHARED + f"question {i}?", max_tokens=3)
    _wait_idle(server)
    _wait_updates(dash_page, 2)
    rows = dash_page.locator("[data-testid=hot-row]")
    assert rows.count() >= 1
    texts = rows.locator("td.text").all_text_contents()
    hits = [int(x) for x in rows.locator("td.hits").all_text_contents()]
    top = texts[hits.index(max(hits))]
    assert max(hits) >= 3  # requests 2-4 hit the prefix request 1 left in the cache
    assert top.startswith(SHARED[:30]), top  # its first tokens, detokenized


def test_tier_count_moves_when_blocks_are_offloaded(dash_page, server, client):
    before = int(dash_page.text_content("#tier-L2"))
    # Distinct prompts of ~70 tokens each: more than the pool's 2,396 tokens in total, so
    # cached blocks are evicted, and eviction writes them back to L2.
    for i in range(45):
        text = f"offload round {i} " + " ".join(f"w{i}x{j}" for j in range(40))
        client.completions.create(model="tiny", prompt=text, max_tokens=2)
    _wait_idle(server)
    _wait_updates(dash_page, 2)
    after = int(dash_page.text_content("#tier-L2"))
    assert after > before, (before, after)
    assert "offloads/s" in dash_page.text_content("#tiers")


def _background_streams(client, n: int, stop: threading.Event) -> list[threading.Thread]:
    """Long streams that keep the engine busy (and so the marked request alive for a while)."""

    def run(k: int) -> None:
        s = client.completions.create(
            model="tiny", prompt=f"background {k}", max_tokens=400, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in s:
            if stop.is_set():
                break
        s.close()

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    return threads


def test_aborted_stream_blocks_turn_free(dash_page, server, client):
    marker = "zebra aborted stream marker"
    stop = threading.Event()
    background = _background_streams(client, 4, stop)
    stream = client.completions.create(
        model="tiny", prompt=marker + " " + SHARED, max_tokens=400, stream=True,
        extra_body={"cache_salt": "tenant-abort", "ignore_eos": True},
    )  # fmt: skip
    it = iter(stream)
    next(it)
    cells = dash_page.locator("#map .cell")
    deadline = time.monotonic() + 10
    while True:  # the page shows the request's blocks, their hover naming its prefix
        titles = cells.evaluate_all("els => els.map(e => e.title)")
        mine = [i for i, t in enumerate(titles) if marker[:12] in t]
        if len(mine) >= 8 or time.monotonic() > deadline:
            break
        dash_page.wait_for_timeout(100)
    states = cells.evaluate_all("els => els.map(e => e.dataset.state)")
    assert len(mine) >= 8, (titles[:5], dash_page.text_content("#status"), server.health())
    assert {states[i] for i in mine} <= {"running", "shared"}
    legend = dash_page.evaluate("Chart.getChart('c-tenant-blocks').data.datasets.map(d => d.label)")
    assert "tenant-abort" in legend  # its tenant has a line in "Blocks held per cache_salt"
    stream.close()  # the client goes away mid-stream: the server aborts the request
    deadline = time.monotonic() + 15  # (a busy server may redraw less than once a second)
    while True:
        _wait_updates(dash_page, 1)
        titles = cells.evaluate_all("els => els.map(e => e.title)")
        states = cells.evaluate_all("els => els.map(e => e.dataset.state)")
        if not any(marker[:12] in t for t in titles) or time.monotonic() > deadline:
            break
    assert not [i for i, t in enumerate(titles) if marker[:12] in t]  # no block is its any more
    # Its cells are free or cached now, unless a background stream took one since.
    assert all(states[i] in ("free", "cached") or "background" in titles[i] for i in mine)
    stop.set()
    for t in background:
        t.join(60)
    _wait_idle(server)
    _wait_updates(dash_page, 2)
    c = _counts(dash_page)
    assert c["running"] == c["shared"] == 0


def test_page_works_offline_and_needs_the_key(dash_browser, server):
    """Every resource comes from the server itself (no CDN); the data needs the API key."""
    pg = dash_browser.new_page()
    outside = []
    pg.route(
        "**/*",
        lambda route: (
            route.continue_()
            if route.request.url.startswith(server.url)
            else (outside.append(route.request.url), route.abort())
        ),
    )
    pg.goto(f"{server.url}/dashboard?key={KEY}")
    _wait_updates(pg, 1)
    assert pg.evaluate("typeof Chart") == "function"  # the vendored Chart.js loaded
    assert pg.locator("canvas").count() == 8 and not outside
    pg.close()
    assert httpx.get(server.url + "/dashboard/api/state").status_code == 401
    assert httpx.get(server.url + "/dashboard").status_code == 401
    ok = httpx.get(server.url + "/dashboard/api/state", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["kv"]["num_blocks"] == NUM_BLOCKS - 1
