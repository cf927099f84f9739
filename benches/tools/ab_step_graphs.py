"""A/B of step graphs (``kvcore.models.step_graphs``) inside one offline SmolLM2 job process: the
same ``LLM`` (bf16, eager, kvcore's model code) runs issue 24's workload (48 prompts of 128-384
random token ids, 64 greedy tokens, EOS ignored) alternately with decode steps replayed from
their recorded native calls (``replay``) and recorded every step (``record``,
``KVCORE_STEP_GRAPHS=0``), so start-up and machine drift fall on both sides alike. Each run has
its own cache salt (no prefix hits across runs). Prints each run's wall, the medians, the pairs
replay won, the replays and captures counted, and whether the tokens and log-probabilities are
equal.

    python benches/tools/ab_step_graphs.py --threads 1 --rounds 2 [--seeds 0 1 2]
        [--requests 48] [--max-tokens 64] [--workload random|shared|short]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from bench_vs_vllm_cpu import workload  # noqa: E402
from inproc_ab import engine, parser, summarize, timed_generate  # noqa: E402
from kvcore.params import SamplingParams  # noqa: E402


def main() -> None:
    ap = parser()
    ap.add_argument(
        "--workload",
        choices=("random", "shared", "short"),
        default="random",
        help="short: prompts of 16 random token ids, so decode steps dominate",
    )
    args = ap.parse_args()
    llm = engine(args)
    graphs = llm.engine.runner.native.model.graphs
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1)
    llm.generate([[5] * 40, [6] * 300], params, use_tqdm=False)
    walls: dict[str, list[float]] = {"record": [], "replay": []}
    outs: dict[str, list] = {}
    for rnd in range(args.rounds):
        for seed in args.seeds:
            if args.workload == "short":
                rng = np.random.default_rng(seed)
                prompts = [rng.integers(100, 40000, 16).tolist() for _ in range(args.requests)]
            else:
                prompts = workload(args.workload, seed, args.requests)
            order = ("record", "replay") if (rnd + seed) % 2 == 0 else ("replay", "record")
            for name in order:
                os.environ["KVCORE_STEP_GRAPHS"] = "1" if name == "replay" else "0"
                graphs.clear()
                replays, captures = graphs.replays, graphs.captures
                wall, res = timed_generate(llm, prompts, params, f"{rnd}/{seed}/{name}")
                walls[name].append(wall)
                outs.setdefault(f"{seed}/{name}", [
                    (list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in res
                ])  # fmt: skip
                n_rep, n_cap = graphs.replays - replays, graphs.captures - captures
                counts = f"replays {n_rep}, captures {n_cap}"
                print(f"round {rnd} seed {seed} {name}: {wall:6.2f} s ({counts})", flush=True)
    summarize(walls, outs, args.seeds, "record", "replay")  # outputs: tokens and log-probs


if __name__ == "__main__":
    main()
