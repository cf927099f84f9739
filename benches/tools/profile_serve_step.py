"""Profile one decode step in the regime where `kvcore serve` missed its SLO (docs/serving.md).

The chat dataset's prompts of seed S (the bench's), first N of them, as token-id prompts of the
same lengths, all prefilled, then decode steps: the median step time with the torch twin's
chunks allowed any padding (``MAX_PAD_RATIO`` = inf, the old schedule: every decode padded to the
longest context) and with the default bound, interleaved step by step so machine load hits both
alike, and with ``--ops`` the torch profiler's table of one side. Prints ``name: value unit``.

    python benches/tools/profile_serve_step.py --seed 0 --num 17 [--steps 8] [--ops]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from kvcore.entrypoints.llm import LLM
from kvcore.params import SamplingParams
from kvcore.tools.bench_data import make_dataset
from kvcore_kernels import chunks_torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num", type=int, default=17, help="running requests (decode batch)")
    p.add_argument("--steps", type=int, default=8, help="decode steps per side")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ops", action="store_true", help="torch profiler table (bounded chunks)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m", max_num_batched_tokens=16384, prefix_caching="off")
    eng, tok = llm.engine, llm.engine.tokenizer
    reqs = make_dataset("chat", args.num, seed=args.seed, max_tokens=32)
    lens = [
        len(
            tok.apply_chat_template(
                r.body["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
            )
        )
        for r in reqs
    ]
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    for n in lens:
        eng.add_request(rng.integers(100, 40_000, n).tolist(), params, stream=True)
    eng.step()  # every prompt in one step
    eng.step()
    print(f"prompt_tokens_in_flight: {sum(lens)} tok")
    print(f"longest_prompt: {max(lens)} tok")
    times: dict[str, list[float]] = {"unbounded": [], "bounded": []}
    default = chunks_torch.MAX_PAD_RATIO
    for _ in range(args.steps):
        for side, ratio in (("unbounded", float("inf")), ("bounded", default)):
            chunks_torch.MAX_PAD_RATIO = ratio
            t = time.perf_counter()
            eng.step()
            times[side].append(time.perf_counter() - t)
    chunks_torch.MAX_PAD_RATIO = default
    for side, ts in times.items():
        print(f"decode_step_{side}_p50_ms: {np.median(ts) * 1e3:.1f} ms")
    ratio = np.median(times["unbounded"]) / np.median(times["bounded"])
    print(f"decode_step_speedup: {ratio:.2f} x")
    if args.ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
