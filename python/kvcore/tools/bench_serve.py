"""``kvcore bench serve``: a load generator for any OpenAI-compatible server.

For each ``--request-rate`` (requests/s; ``inf`` sends all at once) it sends ``--num-prompts``
streaming requests with Poisson arrivals (exponential gaps, seeded), over plain HTTP + SSE (httpx;
no server-specific code), and measures per request the time to first token (TTFT, first chunk
carrying text or token ids), the gaps between chunks (ITL), the time per output token after the
first (TPOT) and the end-to-end latency. It prints ``name: value unit`` lines per rate: throughput,
p50/p95/p99 of each latency, goodput (requests/s meeting ``--slo-ttft-ms`` and ``--slo-itl-ms``,
the ITL SLO applied to the request's TPOT as in vLLM's benchmark) and, with ``--cost-per-hour``,
the cost per million useful output tokens (tokens of requests meeting the SLO). When the server
exports ``*:request_server_overhead_seconds`` (kvcore does), it also prints the server's own time
per request and its share of the end-to-end latency; with ``--offline FLAGS``, the served output
tok/s over ``LLM.generate``'s on the same prompts at saturation (rate ``inf``). ``--plot`` draws
latency and goodput against the rate, for this run and any ``--compare-json`` results saved by
earlier runs (``--save-json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from kvcore import argtypes as at
from kvcore.tools.bench_data import (
    DATASETS,
    BenchRequest,
    knee,
    load_runs,
    make_dataset,
    plot,
    print_figures,
    rate_seed,
    report,
)


@dataclass
class Result:
    """One request's measurements (perf_counter seconds)."""

    ok: bool = False
    status: int = 0
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    events: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    output_tokens: int = 0


def _piece(choice: dict[str, Any]) -> bool:
    if choice.get("token_ids"):
        return True
    text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
    return bool(text)


async def _one(client: Any, url: str, body: dict, headers: dict, timeout: float) -> Result:
    r = Result(start=time.perf_counter())
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error = (await resp.aread()).decode(errors="replace")[:200]
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = str(chunk["error"])[:200]
                    return r
                if any(_piece(c) for c in chunk.get("choices") or []):
                    r.events.append(time.perf_counter())
                usage = chunk.get("usage") or usage
        r.ok = bool(r.events)
        r.error = "" if r.ok else "no tokens"
        r.output_tokens = int(usage["completion_tokens"]) if usage else len(r.events)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        r.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        r.end = time.perf_counter()
    return r


async def _scrape(client: Any, base: str) -> dict[str, float]:
    """Sums and counts of the server's overhead and e2e histograms (empty if not exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = await client.get(base + "/metrics", timeout=10)
        if resp.status_code != 200:
            return {}
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(resp.text):
            for key in ("request_server_overhead_seconds", "e2e_request_latency_seconds"):
                if fam.name.endswith(":" + key):
                    for s in fam.samples:
                        if s.name.endswith(("_sum", "_count")):
                            name = key + s.name[s.name.rfind("_") :]
                            out[name] = out.get(name, 0.0) + s.value
        return out
    except Exception:  # noqa: BLE001 - metrics are optional
        return {}


async def run_rate(args: Any, rate: float, reqs: list[BenchRequest], model: str) -> dict:
    """Send every request at ``rate`` (Poisson); returns the figures of this rate."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with httpx.AsyncClient(limits=limits) as client:
        before = await _scrape(client, args.base_url)

        async def send(req: BenchRequest) -> Result:
            body = dict(req.body, model=model, stream=True, stream_options={"include_usage": True})
            url = args.base_url + req.path
            if sem is None:
                return await _one(client, url, body, headers, args.timeout)
            async with sem:
                return await _one(client, url, body, headers, args.timeout)

        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(send(req)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        after = await _scrape(client, args.base_url)
    duration = max(r.end for r in results) - start
    return summarize(args, rate, results, duration, before, after)


def _pct(values: list[float]) -> dict[int, float]:
    if not values:
        return {50: float("nan"), 95: float("nan"), 99: float("nan")}
    arr = np.asarray(values) * 1e3
    return {q: float(np.percentile(arr, q)) for q in (50, 95, 99)}


def summarize(
    args: Any, rate: float, results: list[Result], duration: float, before: dict, after: dict
) -> dict[str, Any]:
    """The figures of one rate (milliseconds for latencies)."""
    ok = [r for r in results if r.ok]
    ttft = [r.events[0] - r.start for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.events, r.events[1:], strict=False)]
    tpot = [(r.end - r.events[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2e = [r.end - r.start for r in ok]

    def meets_slo(r: Result) -> bool:
        first = r.events[0] - r.start
        per_token = (r.end - r.events[0]) / max(1, r.output_tokens - 1)
        return first * 1e3 <= args.slo_ttft_ms and per_token * 1e3 <= args.slo_itl_ms

    good = [r for r in ok if meets_slo(r)]
    out_tokens = sum(r.output_tokens for r in ok)
    fig: dict[str, Any] = {
        "request_rate": rate,
        "requests_completed": len(ok),
        "requests_failed": len(results) - len(ok),
        "requests_refused_503": sum(r.status == 503 for r in results),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tok_per_s": out_tokens / duration,
        "goodput_req_per_s": len(good) / duration,
    }
    for name, vals in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        for q, v in _pct(vals).items():
            fig[f"{name}_p{q}_ms"] = v
    useful = sum(r.output_tokens for r in good)
    if args.cost_per_hour is not None:
        cost = args.cost_per_hour * duration / 3600.0
        fig["cost_per_m_useful_tok_usd"] = cost / (useful / 1e6) if useful else float("inf")
    n = after.get("request_server_overhead_seconds_count", 0) - before.get(
        "request_server_overhead_seconds_count", 0
    )
    if n > 0 and e2e:
        key = "request_server_overhead_seconds_sum"
        s = after[key] - before.get(key, 0.0)
        fig["server_overhead_mean_ms"] = s / n * 1e3
        fig["server_overhead_pct_of_e2e"] = 100.0 * (s / n) / float(np.mean(e2e))
    errors = sorted({r.error for r in results if not r.ok})
    fig["errors"] = errors[:3]
    fig["records"] = [  # per request, to re-evaluate goodput at other SLOs (--save-json)
        {
            "ok": r.ok,
            "ttft_ms": (r.events[0] - r.start) * 1e3 if r.ok else None,
            "tpot_ms": (r.end - r.events[0]) / max(1, r.output_tokens - 1) * 1e3 if r.ok else None,
            "e2e_ms": (r.end - r.start) * 1e3,
            "output_tokens": r.output_tokens,
        }
        for r in results
    ]
    return fig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (as kvcore's other commands)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _rate(text: str) -> float:
    """A request rate: a number > 0, or inf (all at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    """Flags of ``kvcore bench serve`` (checked while parsing: one line, exit 2)."""
    p = _Parser(prog="kvcore bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--request-rate", type=_rate, nargs="+", default=[float("inf")])
    p.add_argument("--num-prompts", type=at.positive_int, default=50)
    p.add_argument(
        "--max-tokens", type=at.positive_int, default=None, help="output cap (random: exact)"
    )
    p.add_argument(
        "--input-len", type=at.positive_int, default=128, help="random prompt length (±50 %%)"
    )
    p.add_argument(
        "--prefix-len", type=at.non_negative_int, default=256, help="shared-prefix: shared tokens"
    )
    p.add_argument(
        "--vocab-size", type=at.int_at_least(2), default=32000, help="random token ids below this"
    )
    p.add_argument("--seed", type=at.non_negative_int, default=0)
    p.add_argument("--slo-ttft-ms", type=at.float_in(0, low_open=True), default=1000.0)
    p.add_argument("--slo-itl-ms", type=at.float_in(0, low_open=True), default=200.0)
    p.add_argument(
        "--cost-per-hour", type=at.float_in(0), default=None, help="USD per hour of the server"
    )
    p.add_argument("--max-concurrency", type=at.positive_int, default=None)
    p.add_argument(
        "--warmup", type=at.non_negative_int, default=2, help="unmeasured requests sent first"
    )
    p.add_argument("--timeout", type=at.float_in(0, low_open=True), default=600.0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default=None, help="name of this server in plots (default: model)")
    p.add_argument("--save-json", default=None, help="write the figures to this file")
    p.add_argument("--compare-json", nargs="*", default=[], help="earlier --save-json files")
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        help="send nothing: re-evaluate saved runs at this --slo-* (goodput, knee) and --plot",
    )
    p.add_argument("--plot", default=None, help="draw latency/goodput vs rate to FILE.png")
    p.add_argument(
        "--offline",
        default=None,
        metavar="FLAGS",
        help="after each saturated rate (inf), run LLM.generate in this process on the same "
        "prompts with these `kvcore serve` engine flags ('--model M --dtype bfloat16 "
        "--threads 2'; the server idles meanwhile) and print served_over_offline",
    )
    return p


class _Offline:
    """``LLM.generate`` on a rate's own prompts: the engine's speed without the server."""

    def __init__(self, flags: str):
        import shlex

        from kvcore.engine.factory import make_engine
        from kvcore.entrypoints.llm import LLM
        from kvcore.scaleout.ray_app import replica_parser

        # The server's engine flags, parsed as a replica parses them (scale-out flags ignored).
        engine = make_engine(replica_parser().parse_known_args(shlex.split(flags))[0])
        self.llm = LLM.from_engine(engine)
        self.run([[5, 6, 7, 8]] * 2, [4, 4])  # warm-up, as the server's

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
        from kvcore.params import SamplingParams

        params = [
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens
        ]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def offline_figures(offline: _Offline, reqs: list[BenchRequest], fig: dict[str, Any]) -> None:
    """Add ``offline_output_tok_per_s`` and ``served_over_offline`` (served output tok/s ÷
    LLM.generate's on the same prompts) to a saturated rate's figures."""
    if not all(isinstance(r.body.get("prompt"), list) for r in reqs):
        return  # chat prompts: no token ids to replay
    elapsed, tokens = offline.run(
        [r.body["prompt"] for r in reqs], [r.body["max_tokens"] for r in reqs]
    )
    fig["offline_output_tok_per_s"] = tokens / elapsed
    fig["served_over_offline"] = fig["output_tok_per_s"] / fig["offline_output_tok_per_s"]


async def _model(args: Any) -> str:
    import httpx

    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient() as client:
        resp = await client.get(args.base_url + "/v1/models", headers=headers, timeout=30)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


async def _main(args: Any) -> list[dict[str, Any]]:
    model = await _model(args)

    def dataset(i: int) -> list[BenchRequest]:
        # Each rate draws its own requests (seed, rate index): replaying one list at every rate
        # would let a prefix cache serve the later rates from the earlier ones' prompts.
        return make_dataset(
            args.dataset,
            args.num_prompts,
            seed=rate_seed(args.seed, i),
            max_tokens=args.max_tokens,
            input_len=args.input_len,
            prefix_len=args.prefix_len,
            vocab_size=args.vocab_size,
        )

    if args.warmup:
        warm = make_dataset(
            args.dataset, args.warmup, seed=args.seed + 1, max_tokens=8, vocab_size=args.vocab_size
        )
        await run_rate(args, float("inf"), warm, model)
    results = []
    offline = None
    for i, rate in enumerate(args.request_rate):
        reqs = dataset(i)
        fig = await run_rate(args, rate, reqs, model)
        if args.offline and not math.isfinite(rate):
            offline = offline or _Offline(args.offline)
            offline_figures(offline, reqs, fig)
        print_figures(fig)
        results.append(fig)
    return results


def main(argv: list[str] | None = None) -> int:
    """Entry of ``kvcore bench serve``; 0 when every request of every rate completed."""
    args = parser().parse_args(argv)
    if args.from_json:
        return report(args)
    if not args.base_url:
        parser().error("--base-url is required (or --from-json)")
    args.base_url = args.base_url.rstrip("/")
    try:
        results = asyncio.run(_main(args))
    except OSError as e:  # httpx's connection errors derive from neither; caught below
        print(f"kvcore bench serve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        import httpx

        if not isinstance(e, httpx.HTTPError):
            raise
        print(f"kvcore bench serve: error: {args.base_url}: {e}", file=sys.stderr)
        return 2
    label = args.label or args.model or "server"
    k = knee(results)
    print(f"knee_request_rate: {k if k is not None else float('nan'):.2f} req/s")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump({"label": label, "args": vars(args), "results": results}, f, indent=1)
    if args.plot:
        runs = load_runs(args.compare_json)
        runs[label] = results
        plot(runs, args.plot, f"(TTFT<={args.slo_ttft_ms:g} ms, TPOT<={args.slo_itl_ms:g} ms)")
        print(f"# plot written to {args.plot}")
    return 0 if all(r["requests_failed"] == 0 for r in results) else 1
