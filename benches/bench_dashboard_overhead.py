"""What an open dashboard costs a saturated ``kvcore serve``: output tokens/s with and without
a viewer, alternated (ABBA) on one server, plus the server's own time building pictures.

    python benches/bench_dashboard_overhead.py --repeats 3 --seconds 20 [--viewer chromium]

A "viewer" is either a poller of ``/dashboard/api/state`` once a second (what the page asks of
the server; the default, so the browser's own rendering does not compete for this machine's
cores) or a real headless Chromium page (``--viewer chromium``). The load: ``--concurrency``
closed-loop clients sending token-id prompts (tiny-llama, no tokenizer) with a shared prefix and
``--max-tokens`` outputs, past the server's ``--max-num-seqs``. Prints ``name: value unit`` lines:
each window's tokens/s, the mean of each arm, their ratio with the spread of the pairwise ratios,
and ``dashboard_build_ms_per_s``: the server's time spent building pictures per second of wall
time (the direct cost; it holds the GIL, so it bounds the throughput lost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT / "kernels")])
    )
    cmd = [
        sys.executable, "-m", "kvcore", "serve", "--model", args.model, "--port", str(port),
        "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
        "--max-model-len", "512", "--threads", str(args.threads),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


async def _client(
    url: str, start: float, stop: float, i: int, args: argparse.Namespace, out: list
) -> None:
    """Streams requests back to back; counts the tokens that arrive inside [start, stop)."""
    prefix = list(range(10, 10 + args.prefix_tokens))
    n = 0
    async with httpx.AsyncClient(timeout=120) as c:
        while time.monotonic() < stop:
            body = {
                "model": args.model,
                "prompt": prefix + [200 + i, 300 + n % 50],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    if now >= stop:
                        break
                    if now >= start:
                        chunk = json.loads(line[6:])
                        out.append(sum(len(ch.get("token_ids") or []) for ch in chunk["choices"]))
            n += 1


def run_load(url: str, args: argparse.Namespace) -> float:
    """Output tokens/s over one window of ``args.seconds`` (requests finished inside it)."""
    out: list[int] = []
    start = time.monotonic() + args.ramp_s  # the clients' first prefills are not counted
    stop = start + args.seconds

    async def main() -> None:
        await asyncio.gather(
            *(_client(url, start, stop, i, args, out) for i in range(args.concurrency))
        )

    asyncio.run(main())
    return sum(out) / args.seconds


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Viewer:
    """A dashboard kept open during one window."""

    def __init__(self, url: str, kind: str):
        self.url, self.kind = url, kind
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Viewer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        if self.kind == "poll":
            since = 0.0
            with httpx.Client(timeout=30) as c:
                while not self._stop.wait(1.0):  # as the page: once a second, new points only
                    d = c.get(self.url + f"/dashboard/api/state?since={since}").json()
                    since = d["history"][-1]["t"] if d["history"] else since
            return
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            pg = b.new_page()
            pg.goto(self.url + "/dashboard")
            while not self._stop.wait(0.5):
                pass
            b.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0, help="measured part of a window")
    p.add_argument("--ramp-s", type=float, default=3.0, help="unmeasured start of a window")
    p.add_argument("--repeats", type=int, default=3, help="ABBA blocks")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--viewer", default="poll", choices=("poll", "chromium"))
    args = p.parse_args(argv)
    proc, url = start_server(args)
    try:
        run_load(url, argparse.Namespace(**{**vars(args), "seconds": 5.0}))  # warm-up
        base: list[float] = []
        viewed: list[float] = []
        t_build = httpx.get(url + "/dashboard/api/state", timeout=30).json()["cost"]
        wall_viewed = cpu_viewed = 0.0
        for r in range(args.repeats):
            for arm in "AB" if r % 2 == 0 else "BA":
                if arm == "A":
                    tps = run_load(url, args)
                    base.append(tps)
                else:
                    t0, c0 = time.monotonic(), cpu_seconds(proc.pid)
                    with Viewer(url, args.viewer):
                        tps = run_load(url, args)
                    wall_viewed += time.monotonic() - t0
                    cpu_viewed += cpu_seconds(proc.pid) - c0
                    viewed.append(tps)
                name = "no_viewer" if arm == "A" else f"viewer_{args.viewer}"
                print(f"window_{r}_{name}_output_tok_per_s: {tps:.1f} tok/s", flush=True)
        cost = httpx.get(url + "/dashboard/api/state", timeout=30).json()["cost"]
        ratios = [v / b for v, b in zip(viewed, base, strict=True)]
        print(f"no_viewer_output_tok_per_s: {statistics.mean(base):.1f} tok/s")
        print(f"viewer_output_tok_per_s: {statistics.mean(viewed):.1f} tok/s")
        print(f"viewer_over_no_viewer: {statistics.mean(viewed) / statistics.mean(base):.4f} x")
        print(f"paired_ratio_min: {min(ratios):.4f} x")
        print(f"paired_ratio_max: {max(ratios):.4f} x")
        built_ms = cost["build_ms_total"] - t_build["build_ms_total"]
        pictures = cost["pictures"] - t_build["pictures"]
        print(f"dashboard_pictures: {pictures} pictures")
        print(f"dashboard_build_ms_per_picture: {built_ms / max(pictures, 1):.2f} ms")
        cpu_ms = cost["build_cpu_ms_total"] - t_build["build_cpu_ms_total"]
        print(f"dashboard_build_ms_per_s: {built_ms / max(wall_viewed, 1e-9):.2f} ms/s")
        print(f"dashboard_build_cpu_ms_per_picture: {cpu_ms / max(pictures, 1):.2f} ms")
        print(f"dashboard_build_cpu_ms_per_s: {cpu_ms / max(wall_viewed, 1e-9):.2f} ms/s")
        print(f"server_cpu_ms_per_s_viewed: {1e3 * cpu_viewed / max(wall_viewed, 1e-9):.0f} ms/s")
        share = 100 * cpu_ms / max(1e3 * cpu_viewed, 1e-9)
        print(f"dashboard_share_of_server_cpu: {share:.3f} %")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
