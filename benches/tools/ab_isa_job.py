"""A/B of the native kernel's code paths inside one offline SmolLM2 job process: the same
``LLM`` (bf16, eager, kvcore's model code, prefix cache off so every round prefills) runs
issue 24's workload (48 random prompts of 128-384 tokens, 64 greedy tokens) alternately with
``cpu_native.OPTIONS.isa`` set to each choice (``auto`` / ``noamx``: the attention's AMX
tiles on or off; ``noseg``: on, without the prefill's key segments of ``cols::head_seg``;
``nodec``: on, with bf16 decode on the AVX-512 tile loop instead of ``dec_amx.rs``;
``tileloop``: decode off AMX in the tile loop instead of ``dec_lean.rs``: bf16 in its two
passes, int8 / fp8 in its one-pass online softmax), so
start-up and machine drift fall on both sides alike. Prints each
round's wall and, per choice, the median and the ratio to the first choice.

    python benches/tools/ab_isa_job.py --threads 1 --isa auto noamx --rounds 3 [--seeds 0 1 2]
    python benches/tools/ab_isa_job.py --threads 1 --isa auto tileloop --kv-format int8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_vs_vllm_cpu import workload  # noqa: E402
from kvcore.entrypoints.llm import LLM  # noqa: E402
from kvcore.params import SamplingParams  # noqa: E402
from kvcore_kernels import cpu_native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", nargs="+", default=["auto", "noamx"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--kv-format", default="auto", help="the KV cache's format: auto, int8, ...")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kw = {"model": args.model_dir} if args.model_dir else {}
    llm = LLM(**kw, dtype="bfloat16", num_blocks=4096, max_num_batched_tokens=2048,
              enforce_eager=True, prefix_caching="off", kv_format=args.kv_format)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([[5] * 40, [6] * 300], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    walls: dict[str, list[float]] = {isa: [] for isa in args.isa}
    outs: dict[str, list] = {}
    for seed in args.seeds:
        prompts = workload("random", seed, args.requests)
        for rnd in range(args.rounds):
            order = args.isa if rnd % 2 == 0 else args.isa[::-1]
            for isa in order:
                cpu_native.OPTIONS.isa = isa
                t0 = time.perf_counter()
                res = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - t0
                walls[isa].append(wall)
                outs.setdefault(f"{seed}/{isa}", [list(o.outputs[0].token_ids) for o in res])
                print(f"seed {seed} round {rnd} {isa:8s} wall {wall:6.2f} s", flush=True)
    base = statistics.median(walls[args.isa[0]])
    for isa, w in walls.items():
        med = statistics.median(w)
        print(f"{isa:8s} median {med:6.2f} s  min {min(w):6.2f}  max {max(w):6.2f}  "
              f"wall ratio to {args.isa[0]}: {med / base:.3f}")  # fmt: skip
    for seed in args.seeds:
        ref = outs[f"{seed}/{args.isa[0]}"]
        for isa in args.isa[1:]:
            same = sum(a == b for a, b in zip(ref, outs[f"{seed}/{isa}"], strict=True))
            print(f"seed {seed}: {isa} vs {args.isa[0]}: {same}/{len(ref)} sequences equal")


if __name__ == "__main__":
    main()
