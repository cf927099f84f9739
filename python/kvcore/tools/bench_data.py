"""Datasets, plots and re-evaluation of saved runs (``--from-json``) of ``kvcore bench serve``.

Datasets (one request each, seeded):

* ``chat``: first turns shaped like ``kvcore run``'s chat workload (a shared system prompt; short
  questions next to, one in four, a question about 600-2,000 characters of the Python manual),
  through /v1/chat/completions, answer lengths 32-96 tokens (capped by ``--max-tokens``). Short
  questions are drawn without replacement and manual excerpts start at a random offset of a random
  topic, so the only prefix two requests share is the system prompt (and, past 16 short
  questions, a repeated one), as in a real chat stream.
* ``random``: uniform random token ids (``--input-len`` ± 50 %), through /v1/completions with
  ``ignore_eos`` (so every request produces exactly ``--max-tokens`` tokens, vLLM's convention).
* ``shared-prefix``: one random ``--prefix-len``-token prefix shared by every prompt, then a random
  tail of ``--input-len`` ± 50 % tokens: the prefix cache's best case.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

DATASETS = ("chat", "random", "shared-prefix")


@dataclass
class BenchRequest:
    """One request of a benchmark: the endpoint path and its JSON body (without model)."""

    path: str
    body: dict[str, Any]


def chat_bodies(n: int, rng: random.Random, max_tokens: int | None) -> list[dict[str, Any]]:
    """``n`` first-turn chat requests (see the module doc)."""
    import pydoc_data.topics

    from kvcore.tools.workload import QUESTIONS, SYSTEM_PROMPT

    topics = sorted(pydoc_data.topics.topics)
    questions: list[str] = []
    out = []
    for i in range(n):
        if i % 4 == 3:
            text = pydoc_data.topics.topics[rng.choice(topics)]
            size = rng.choice((600, 1200, 2000))
            start = rng.randrange(max(1, len(text) - size))
            q = f"Here is part of the Python manual:\n\n{text[start : start + size]}\n\n"
            q += "What does this section explain?"
        else:
            if not questions:
                questions = rng.sample(QUESTIONS, len(QUESTIONS))
            q = questions.pop()
        mt = rng.choice((32, 48, 64, 96))
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
        mt = mt if max_tokens is None else min(mt, max_tokens)
        out.append({"messages": msgs, "max_tokens": mt, "temperature": 0.0})
    return out


def rate_seed(seed: int, rate_index: int) -> int:
    """The dataset seed of the ``rate_index``-th rate of a sweep run with ``seed`` (rate 0 keeps
    ``seed``; the warm-up uses ``seed + 1``, so the others start well away from it)."""
    return seed if rate_index == 0 else seed + 1000 * rate_index


def make_dataset(
    name: str,
    num_prompts: int,
    *,
    seed: int = 0,
    max_tokens: int | None = None,
    input_len: int = 128,
    prefix_len: int = 256,
    vocab_size: int = 32000,
) -> list[BenchRequest]:
    """``num_prompts`` requests of dataset ``name``."""
    rng = random.Random(seed)
    if name == "chat":
        return [
            BenchRequest("/v1/chat/completions", body)
            for body in chat_bodies(num_prompts, rng, max_tokens)
        ]
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, not {name!r}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    shared = tokens(prefix_len) if name == "shared-prefix" else []
    out = []
    for _ in range(num_prompts):
        n = max(1, rng.randint(input_len // 2, input_len + input_len // 2))
        body = {
            "prompt": shared + tokens(n),
            "max_tokens": max_tokens or 64,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        out.append(BenchRequest("/v1/completions", body))
    return out


def knee(results: list[dict[str, Any]], fraction: float = 0.9) -> float | None:
    """The highest request rate at which >= ``fraction`` of the requests sent met the SLO.

    (Counted over the requests, not against the offered rate: a few dozen Poisson arrivals
    realise a rate well off the nominal one, which made a server that met the SLO on every
    request miss "90 % of the offered rate" at 0.125 req/s.)"""
    ok = []
    for r in results:
        sent = r.get("requests_completed", 0) + r.get("requests_failed", 0)
        if r["request_rate"] == float("inf") or not sent:
            continue
        if r["goodput_req_per_s"] * r["duration_s"] >= fraction * sent - 1e-9:
            ok.append(r["request_rate"])
    return max(ok) if ok else None


def plot(runs: dict[str, list[dict[str, Any]]], path: str, slo: str = "") -> None:
    """Latency (TTFT p50/p95, ITL p50) and goodput against request rate, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), dpi=90)
    for label, results in runs.items():
        rs = [r for r in results if r["request_rate"] != float("inf")]
        x = [r["request_rate"] for r in rs]
        (line,) = axes[0].plot(x, [r["ttft_p95_ms"] for r in rs], "o-", label=f"{label} p95")
        axes[0].plot(x, [r["ttft_p50_ms"] for r in rs], "s--", color=line.get_color(), alpha=0.6)
        axes[1].plot(x, [r["itl_p50_ms"] for r in rs], "o-", label=label, color=line.get_color())
        axes[2].plot(
            x, [r["goodput_req_per_s"] for r in rs], "o-", label=label, color=line.get_color()
        )
    finite = sorted(
        {r["request_rate"] for rs in runs.values() for r in rs if r["request_rate"] != float("inf")}
    )
    if finite:
        axes[2].plot(finite, finite, ":", color="grey", label="offered")
    axes[0].set(title="TTFT (p95 solid, p50 dashed)", xlabel="request rate (req/s)", ylabel="ms")
    axes[0].set_yscale("log")
    axes[1].set(title="inter-token latency p50", xlabel="request rate (req/s)", ylabel="ms")
    axes[2].set(xlabel="request rate (req/s)", ylabel="req/s")
    axes[2].set_title(f"goodput {slo}".strip(), fontsize=9)
    for ax in axes:
        if len(finite) > 2:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def load_runs(paths: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Results saved with ``--save-json`` (label -> results per rate)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        ok = isinstance(data, dict) and isinstance(data.get("label"), str)
        if not (ok and isinstance(data.get("results"), list)):
            raise ValueError(f"{p} is not a file of kvcore bench serve --save-json")
        for r in data["results"]:
            if not (isinstance(r, dict) and isinstance(r.get("records"), list)):
                raise ValueError(f"{p} is not a file of kvcore bench serve --save-json")
        runs.setdefault(data["label"], []).extend(data["results"])
    return runs


def regoodput(result: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float) -> float:
    """Goodput of a saved result at another SLO, from its per-request records."""
    good = sum(
        1
        for r in result["records"]
        if r["ok"] and r["ttft_ms"] <= slo_ttft_ms and r["tpot_ms"] <= slo_tpot_ms
    )
    return good / result["duration_s"]


_REPORTED = (
    "goodput_req_per_s",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "itl_p50_ms",
    "tpot_p50_ms",
    "e2e_p50_ms",
    "output_tok_per_s",
    "server_overhead_pct_of_e2e",
)


def report(args: Any) -> int:
    """``--from-json``: the saved runs at the given SLO, merged per server and rate (mean, min,
    max over runs, e.g. seeds), each server's knee, and the plot of the means. Goodput is
    re-evaluated from per-request records; a run saved without them is left out of it."""
    merged: dict[str, list[dict[str, Any]]] = {}
    for label, results in load_runs(args.from_json).items():
        by_rate: dict[float, list[dict[str, Any]]] = {}
        for r in results:
            if "records" in r:
                r["goodput_req_per_s"] = regoodput(r, args.slo_ttft_ms, args.slo_itl_ms)
            else:
                r.pop("goodput_req_per_s", None)  # measured at another SLO
            by_rate.setdefault(r["request_rate"], []).append(r)
        rows = []
        for rate in sorted(by_rate):
            row: dict[str, Any] = {"request_rate": rate}
            for key in _REPORTED:
                vals = [r[key] for r in by_rate[rate] if key in r]
                if not vals:
                    continue
                row[key] = sum(vals) / len(vals)
                unit = key.rsplit("_", 1)[-1].replace("s", "req/s") if "goodput" in key else ""
                print(
                    f"{label} rate {rate:g} {key}: {row[key]:.3f} (min {min(vals):.3f}, "
                    f"max {max(vals):.3f}, runs {len(vals)}) {unit}".rstrip()
                )
            rows.append(row)
        merged[label] = rows
        k = knee([r for r in rows if "goodput_req_per_s" in r])
        print(f"{label} knee_request_rate: {k if k is not None else float('nan'):g} req/s")
    if args.plot:
        for rows in merged.values():
            for r in rows:
                r.setdefault("goodput_req_per_s", float("nan"))
        plot(merged, args.plot, f"(TTFT<={args.slo_ttft_ms:g} ms, TPOT<={args.slo_itl_ms:g} ms)")
        print(f"# plot written to {args.plot}")
    return 0


_UNITS = {"_req_per_s": "req/s", "_tok_per_s": "tok/s", "_ms": "ms", "_s": "s", "_pct": "%"}


def print_figures(fig: dict[str, Any]) -> None:
    """``name: value unit`` lines."""
    for name, value in fig.items():
        if name == "records":
            continue
        if name == "errors":
            for e in value:
                print(f"# error: {e}")
            continue
        unit = next((u for suf, u in _UNITS.items() if name.endswith(suf)), "")
        unit = {"request_rate": "req/s", "request_throughput": "req/s"}.get(name, unit)
        unit = "USD/Mtok" if name.startswith("cost_") else unit
        unit = "%" if name.endswith("_pct_of_e2e") else unit
        if name.startswith("requests_"):
            unit = "req"
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{name}: {shown} {unit}".rstrip(), flush=True)
