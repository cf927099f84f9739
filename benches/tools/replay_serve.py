"""Replay `kvcore bench serve`'s chat workload in-process: the engine alone, no HTTP.

The same prompts (chat template applied) and the same seeded Poisson arrival times as
``kvcore bench serve --dataset chat --seed S --request-rate R --num-prompts N --max-tokens 32``,
added to an ``LLMEngine`` when their time comes and stepped in this thread. Prints TTFT and
TPOT percentiles, goodput at the SLO and step-time percentiles, so a server run can be split into
engine time and the server's own. ``--rate-index I`` draws the prompts of the bench's I-th rate
(``rate_seed``: each rate of a sweep has its own prompts); the bench's two warm-up requests run
first. ``--warm`` also runs every prompt once first (prefix cache filled). ``--breakdown K``
prints the K slowest-TTFT requests: prompt and cached tokens, queue time (arrival to first
scheduled), prefill time (first scheduled to first token), the steps in between and how many
tokens (prefill chunks + other requests' decodes) they computed.

    python benches/tools/replay_serve.py --seed 0 --rate 0.5 --rate-index 0 --dtype bfloat16 \
        [--max-num-batched-tokens 2048] [--warm] [--breakdown 3]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.params import SamplingParams
from kvcore.tools.bench_data import make_dataset, rate_seed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rate-index", type=int, default=0, help="the rate's place in the sweep")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--warm", action="store_true", help="prompts in the prefix cache first")
    p.add_argument("--breakdown", type=int, default=0, help="slowest-TTFT requests to explain")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=300.0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m", max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
    eng, tok = llm.engine, llm.engine.tokenizer

    def chat_ids(reqs: list) -> list[list[int]]:
        return [
            tok.apply_chat_template(
                r.body["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
            )
            for r in reqs
        ]

    data_seed = rate_seed(args.seed, args.rate_index)
    reqs = make_dataset("chat", args.num_prompts, seed=data_seed, max_tokens=args.max_tokens)
    prompts = chat_ids(reqs)
    warm = chat_ids(make_dataset("chat", 2, seed=args.seed + 1, max_tokens=8))  # the bench's
    if args.warm:
        warm += prompts
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    step_tokens: list[int] = []  # tokens computed by each step's forward
    execute = eng.runner.execute

    def counted(plan, *a, **kw):
        step_tokens.append(len(plan.input_ids))
        return execute(plan, *a, **kw)

    eng.runner.execute = counted
    rng = random.Random(args.seed)  # the bench's arrival gaps
    arrival, t = [], 0.0
    for _ in reqs:
        arrival.append(t)
        t += rng.expovariate(args.rate)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count: dict[int, int] = {}
    steps, step_end, step_tok, sched, cached = [], [], [], {}, {}
    t0, i = time.perf_counter(), 0
    while i < len(reqs) or eng.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(reqs) and arrival[i] <= now:
            params = SamplingParams(max_tokens=reqs[i].body["max_tokens"], temperature=0)
            eng.add_request(prompts[i], params, request_id=str(i), stream=True)
            i += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, arrival[i] - now))
            continue
        start, before = time.perf_counter(), len(step_tokens)
        outs = eng.step()
        end = time.perf_counter()
        steps.append(end - start)
        step_end.append(end - t0)
        step_tok.append(sum(step_tokens[before:]))
        for o in outs:
            r, n = int(o.request_id), len(o.outputs[0].token_ids)
            if o.metrics.first_scheduled_time is not None:
                sched.setdefault(r, o.metrics.first_scheduled_time - t0)
            cached[r] = o.num_cached_tokens
            if n:
                first.setdefault(r, end - t0)
                last[r], count[r] = end - t0, n
    ttft = np.array([first[r] - arrival[r] for r in range(len(reqs))]) * 1e3
    tpot = np.array([(last[r] - first[r]) / max(1, count[r] - 1) for r in range(len(reqs))]) * 1e3
    good = int(((ttft <= args.slo_ttft_ms) & (tpot <= args.slo_itl_ms)).sum())
    duration = max(last.values())
    st = np.array(steps) * 1e3
    print(f"duration_s: {duration:.2f} s")
    print(f"goodput_req_per_s: {good / duration:.3f} req/s")
    for name, v in (("ttft", ttft), ("tpot", tpot), ("step", st)):
        for q in (50, 95):
            print(f"{name}_p{q}_ms: {np.percentile(v, q):.1f} ms")
    print(f"steps: {len(steps)}")
    ends = np.array(step_end)
    for r in np.argsort(-ttft)[: args.breakdown]:
        s0, f = sched.get(r, first[r]), first[r]
        inside = (ends > s0) & (ends <= f + 1e-9)  # steps that ended while r prefilled
        print(
            f"req {r}: ttft {ttft[r]:.0f} ms, prompt {len(prompts[r])} tok "
            f"({cached.get(r, 0)} cached), queue {1e3 * (s0 - arrival[r]):.0f} ms, "
            f"prefill {1e3 * (f - s0):.0f} ms in {int(inside.sum())} steps computing "
            f"{int(np.array(step_tok)[inside].sum())} tokens"
        )


if __name__ == "__main__":
    main()
