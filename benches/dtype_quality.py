"""Quality of ``--dtype bfloat16`` against the checkpoint's fp32: greedy agreement on chat prompts.

The first turn of ``--prompts`` conversations of ``kvcore run``'s chat workload (shared system
prompt; every fourth asks about a page of the Python manual), completed greedily with ``--gen``
tokens through the engine (``LLM.chat``) in both dtypes. Prints ``name: value unit`` lines:

* ``identical_completions``: completions equal token for token (of the prompts);
* ``prefix_agreement_pct``: tokens before the first divergence, over all fp32 tokens (a token
  after a divergence is never counted as agreeing);
* ``position_agreement_pct``: positions where both produced the same token (up to the shorter);
* ``first_divergence_mean``: mean position of the first differing token (completion length when
  none).

Perplexity of the two dtypes is ``kvcore eval-kv --formats auto --dtype D`` (docs/serving.md).

    python benches/dtype_quality.py --prompts 20 --gen 64 --seed 0
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))


def _first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import torch
    from kvcore import LLM, SamplingParams
    from kvcore.workload import chat_workload

    torch.set_num_threads(args.threads)
    convs = chat_workload(args.prompts, seed=args.seed)
    msgs = [c.messages(0, []) for c in convs]
    params = SamplingParams(temperature=0, max_tokens=args.gen)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(args.model, dtype=dtype, kv_memory_bytes=256 << 20, seed=args.seed)
        start = time.perf_counter()
        res = llm.chat(msgs, params, use_tqdm=False)
        print(f"chat_seconds_{dtype}: {time.perf_counter() - start:.1f} s")
        outs[dtype] = [list(r.outputs[0].token_ids) for r in res]
        del llm
    ref, new = outs["float32"], outs["bfloat16"]
    div = [_first_divergence(a, b) for a, b in zip(ref, new, strict=True)]
    same = sum(a == b for a, b in zip(ref, new, strict=True))
    total = sum(map(len, ref))
    pos = sum(
        sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(ref, new, strict=True)
    )
    shorter = sum(min(len(a), len(b)) for a, b in zip(ref, new, strict=True))
    print(f"identical_completions: {same} of {len(ref)}")
    print(f"prefix_agreement_pct: {100 * sum(div) / max(total, 1):.1f} %")
    print(f"position_agreement_pct: {100 * pos / max(shorter, 1):.1f} %")
    print(f"first_divergence_mean: {sum(div) / len(div):.1f} tokens")
    print(f"first_divergence_min: {min(div)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
