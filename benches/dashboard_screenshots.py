"""Screenshots of ``/dashboard`` under load (docs/serving.md, Dashboard), taken with Debian's
headless Chromium through Playwright.

    python benches/dashboard_screenshots.py --out docs/img [--seconds 25]

Starts ``kvcore serve`` on the tests' tiny Llama with a tokenizer (tests/serve_util.py), a pool
small enough to evict into an L2 host tier, and drives it with the ``openai`` client: two
tenants (``cache_salt``) sharing system prompts, distinct prompts that push blocks to L2, and
streams dropped half-way. Writes ``dashboard.png`` (the whole page) and ``dashboard_map.png``
(the block map with a cell's hover text).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from serve_util import ServerProcess, make_model_dir  # noqa: E402

SYSTEM = {
    "alice": "You are the support assistant of Alice's bakery: answer about bread, opening hours "
    "and orders, politely and briefly. ",
    "bob": "You are Bob's code reviewer: read the diff, point at bugs, keep every comment short "
    "and actionable. ",
}


def load(url: str, stop: threading.Event, worker: int) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-shot", max_retries=0)
    rng = random.Random(worker)
    n = 0
    while not stop.is_set():
        n += 1
        tenant = rng.choice(list(SYSTEM))
        kind = rng.random()
        try:
            if kind < 0.55:  # a tenant's shared system prompt + a question
                client.completions.create(
                    model="tiny", prompt=SYSTEM[tenant] + f"Question {n} from worker {worker}?",
                    max_tokens=rng.randint(8, 40), extra_body={"cache_salt": tenant},
                )  # fmt: skip
            elif kind < 0.85:  # a one-off prompt (evicts, offloads to L2)
                words = " ".join(f"w{worker}-{n}-{j}" for j in range(30))
                client.completions.create(model="tiny", prompt=words, max_tokens=4)
            else:  # a stream dropped half-way
                s = client.completions.create(
                    model="tiny", prompt=SYSTEM[tenant] + "Tell me a long story.", max_tokens=200,
                    stream=True, extra_body={"cache_salt": tenant, "ignore_eos": True},
                )  # fmt: skip
                for i, _ in enumerate(s):
                    if i > 20:
                        break
                s.close()
        except Exception:  # noqa: BLE001 - a screenshot run, not a test
            time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "img"))
    p.add_argument("--seconds", type=float, default=25.0)
    p.add_argument("--workers", type=int, default=6)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = make_model_dir(Path(tempfile.mkdtemp(prefix="kvcore-shot-")))
    srv = ServerProcess(
        "--model", str(model), "--served-model-name", "tiny", "--api-key", "sk-shot",
        "--num-blocks", "384", "--block-size", "4", "--max-model-len", "256",
        "--max-num-seqs", "8", "--host-kv-mb", "8", "--threads", "1",
    ).wait_ready()  # fmt: skip
    stop = threading.Event()
    workers = [
        threading.Thread(target=load, args=(srv.url, stop, w), daemon=True)
        for w in range(args.workers)
    ]
    for w in workers:
        w.start()
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            pg = b.new_page(viewport={"width": 1400, "height": 1000})
            pg.goto(srv.url + "/dashboard?key=sk-shot")
            pg.wait_for_timeout(args.seconds * 1000)
            pg.screenshot(path=str(out / "dashboard.png"), full_page=True)
            cell = pg.locator("#map .cell.s3").first
            if cell.count() == 0:
                cell = pg.locator("#map .cell.s2").first
            title = cell.get_attribute("title") or ""
            # The browser's own tooltip is not in a screenshot: show the hover text beside it.
            pg.evaluate(
                """t => { const d = document.createElement('div'); d.id = 'tip';
                d.textContent = t; d.style.cssText = 'font:12px monospace;background:#333;'
                + 'color:#fff;padding:4px 8px;margin-top:6px;display:inline-block';
                document.getElementById('pool').appendChild(d); }""",
                title,
            )
            cell.evaluate("e => { e.style.outline = '2px solid #000'; }")
            pg.locator("#pool").screenshot(path=str(out / "dashboard_map.png"))
            print(f"hover text of the outlined cell: {title}")
            b.close()
    finally:
        stop.set()
        for w in workers:
            w.join(30)
        srv.stop()
    print(f"wrote {out / 'dashboard.png'} and {out / 'dashboard_map.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
