"""A/B of the last-layer cut inside one offline SmolLM2 job process: the same ``LLM`` (bf16,
eager, kvcore's model code) runs issue 24's workload (48 random prompts of 128-384 tokens, 64
greedy tokens) alternately with the model's forward as it is (``cut``: the last layer's o_proj
and MLP on the sampled rows only) and with that layer run on every row and the sampled rows
selected after it (``full``: the forward before the cut, plus one row copy), so start-up and
machine drift fall on both sides alike. Each run has its own cache salt (no prefix hits across
runs). Prints each run's wall, the medians, the pairs the cut won, and whether the tokens are
equal.

    python benches/tools/ab_last_layer.py --threads 1 --rounds 2 [--seeds 0 1 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_vs_vllm_cpu import workload  # noqa: E402
from inproc_ab import engine, parser, summarize, timed_generate  # noqa: E402
from kvcore.models import llama  # noqa: E402
from kvcore.params import SamplingParams  # noqa: E402

CUT = llama.LlamaModel.forward


def full_forward(self, input_ids, positions, step, keep):
    """``LlamaModel.forward`` without the cut: every layer on every row, then the selection."""
    h, res = CUT(self, input_ids, positions, step, torch.arange(input_ids.shape[0]))
    return h.index_select(0, keep), res.index_select(0, keep)


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    llm = engine(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([[5] * 40, [6] * 300], params, use_tqdm=False)
    walls: dict[str, list[float]] = {"full": [], "cut": []}
    outs: dict[str, list] = {}
    for rnd in range(args.rounds):
        for seed in args.seeds:
            prompts = workload("random", seed, args.requests)
            for name in ("full", "cut") if (rnd + seed) % 2 == 0 else ("cut", "full"):
                llama.LlamaModel.forward = full_forward if name == "full" else CUT
                wall, res = timed_generate(llm, prompts, params, f"{rnd}/{seed}/{name}")
                walls[name].append(wall)
                outs.setdefault(f"{seed}/{name}", [list(o.outputs[0].token_ids) for o in res])
                print(f"round {rnd} seed {seed} {name}: {wall:6.2f} s", flush=True)
    llama.LlamaModel.forward = CUT
    summarize(walls, outs, args.seeds, "full", "cut")


if __name__ == "__main__":
    main()
