"""A/B of the fused gate-up (``KVCORE_FUSED_GATE_UP``) in the offline SmolLM2 job: one process per
run, the setting alternated, the same prompts (issue 24's workload), the wall of
``LLM.generate`` and a hash of every output token id (equal hashes: the same tokens).

    python benches/tools/ab_gate_up.py [--threads 2] [--rounds 2] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time

MODEL = "/work/peers/vllm_cpu/smollm2-hf"


def one(seed: int, threads: int, workload: str) -> None:
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from bench_vs_vllm_cpu import workload as make
    from kvcore.entrypoints.llm import LLM
    from kvcore.params import SamplingParams

    llm = LLM(MODEL, dtype="bfloat16", num_blocks=4096, max_num_batched_tokens=2048,
              enforce_eager=True, model_impl="kvcore")  # fmt: skip
    llm.generate([[5] * 40, [6] * 70], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = make(workload, seed, 48)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ids = [tok for o in outs for tok in o.outputs[0].token_ids]
    print(f"{wall:.3f} {hashlib.sha1(str(ids).encode()).hexdigest()[:12]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workload", default="random")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        return one(args.one, args.threads, args.workload)
    for r in range(args.rounds):
        for seed in args.seeds:
            line = []
            for fused in ("0", "1") if r % 2 == 0 else ("1", "0"):
                env = dict(os.environ, KVCORE_FUSED_GATE_UP=fused)
                cmd = [sys.executable, __file__, "--one", str(seed), "--threads",
                       str(args.threads), "--workload", args.workload]  # fmt: skip
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                line.append(f"fused={fused} {out.stdout.strip().splitlines()[-1]}")
            print(f"round {r} seed {seed}: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
