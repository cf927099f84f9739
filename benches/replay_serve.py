"""Replay `kvcore bench serve`'s chat workload in-process: the engine alone, no HTTP.

The same prompts (chat template applied) and the same seeded Poisson arrival times as
``kvcore bench serve --dataset chat --seed S --request-rate R --num-prompts N --max-tokens 32``,
added to an ``LLMEngine`` when their time comes and stepped in this thread. Prints TTFT and
TPOT percentiles, goodput at the SLO and step-time percentiles, so a server run can be split into
engine time and the server's own. ``--warm`` first runs every prompt once (the bench sends the
same prompts at each rate, so from its second rate on they are in the prefix cache).

    python benches/replay_serve.py --seed 0 --rate 2 [--max-num-batched-tokens 2048] [--warm]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
from kvcore.entrypoints.bench_data import make_dataset
from kvcore.llm import LLM
from kvcore.outputs import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm", action="store_true", help="prompts in the prefix cache first")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=300.0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m", max_num_batched_tokens=args.max_num_batched_tokens)
    eng, tok = llm.engine, llm.engine.tokenizer
    reqs = make_dataset("chat", args.num_prompts, seed=args.seed, max_tokens=args.max_tokens)
    prompts = [
        tok.apply_chat_template(
            r.body["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        for r in reqs
    ]
    warm = prompts if args.warm else prompts[:1]
    llm.generate(warm, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    rng = random.Random(args.seed)  # the bench's arrival gaps
    arrival, t = [], 0.0
    for _ in reqs:
        arrival.append(t)
        t += rng.expovariate(args.rate)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count: dict[int, int] = {}
    steps = []
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
        start = time.perf_counter()
        outs = eng.step()
        end = time.perf_counter()
        steps.append(end - start)
        for o in outs:
            r, n = int(o.request_id), len(o.outputs[0].token_ids)
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


if __name__ == "__main__":
    main()
