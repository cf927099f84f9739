"""Where each request's TTFT went: a load generator's per-request records lined up with the engine
process's step log.

    KVCORE_STEP_LOG=/tmp/steps.log kvcore serve ...            # one line per engine step
    vllm bench serve ... --save-result --save-detailed --result-dir D --result-filename R.json
    python benches/tools/ttft_breakdown.py D/R.json /tmp/steps.log [--top 10]

Both sides stamp ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process on the
machine). A request's first token left the engine with its prompt's (last) prefill step: the
last step between the client's send and its first byte that ran more tokens than sequences (a
prefill chunk; if none did, a fully cached prompt, the last step in that window). Its TTFT
splits into

* ``wait``: from the client's send to the start of that step (the front-end, the step running
  when it arrived, and earlier chunks of a long prompt),
* ``step``: that step, which ran the prompt's prefill and every other scheduled sequence,
* ``deliver``: from the step's end to the client's first byte (the message to the front-end,
  detokenization, SSE, the client's parse).

A step whose tokens exceed the prompt's by more than one token per other sequence is flagged
``shared``: two prefills landed in one step.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from dataclasses import dataclass


@dataclass
class Step:
    start: float
    seconds: float
    tokens: int
    seqs: int

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass
class Row:
    ttft: float
    input_len: int
    wait: float
    step: Step

    @property
    def deliver(self) -> float:
        return self.ttft - self.wait - self.step.seconds

    @property
    def shared(self) -> bool:
        return self.step.tokens > self.input_len + self.step.seqs + 16


def read_steps(path: str) -> list[Step]:
    steps = []
    with open(path) as f:
        for line in f:
            start, seconds, tokens, seqs = line.split()
            steps.append(Step(float(start), float(seconds), int(tokens), int(seqs)))
    steps.sort(key=lambda s: s.end)
    return steps


def breakdown(result: dict, steps: list[Step]) -> list[Row]:
    """One row per completed request that a step can account for."""
    ends = [s.end for s in steps]
    rows = []
    records = zip(result["start_times"], result["ttfts"], result["input_lens"], strict=True)
    for sent, ttft, n in records:
        if not ttft:  # failed request
            continue
        last = bisect.bisect_right(ends, sent + ttft) - 1
        window = [s for s in steps[max(0, last - 64) : last + 1] if s.start >= sent]
        if not window:
            continue  # the log does not cover it
        step = next((s for s in reversed(window) if s.tokens > s.seqs), window[-1])
        rows.append(Row(ttft, n, step.start - sent, step))
    return rows


def report(rows: list[Row], top: int) -> str:
    def med(xs):
        return statistics.median(xs) * 1e3 if xs else float("nan")

    lines = [
        f"requests: {len(rows)}",
        f"ttft_p50_ms: {med([r.ttft for r in rows]):.1f}",
        f"wait_p50_ms: {med([r.wait for r in rows]):.1f}",
        f"step_p50_ms: {med([r.step.seconds for r in rows]):.1f}",
        f"deliver_p50_ms: {med([r.deliver for r in rows]):.1f}",
        f"prefill_ms_per_token_p50: "
        f"{med([r.step.seconds / r.step.tokens for r in rows if not r.shared]):.3f}",
        f"shared_steps: {sum(r.shared for r in rows)}",
        "",
        "| TTFT ms | prompt | wait ms | step ms | step tokens / seqs | deliver ms | shared |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: -r.ttft)[:top]:
        lines.append(
            f"| {r.ttft * 1e3:.0f} | {r.input_len} | {r.wait * 1e3:.1f} | "
            f"{r.step.seconds * 1e3:.1f} | {r.step.tokens} / {r.step.seqs} | "
            f"{r.deliver * 1e3:.1f} | {'yes' if r.shared else ''} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", help="vllm bench serve's result JSON (--save-detailed)")
    parser.add_argument("steps", help="the engine's KVCORE_STEP_LOG file")
    parser.add_argument("--top", type=int, default=10, help="slowest requests listed")
    args = parser.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    if "start_times" not in result:
        parser.error(f"{args.result} has no per-request records: run with --save-detailed")
    print(report(breakdown(result, read_steps(args.steps)), args.top))


if __name__ == "__main__":
    main()
