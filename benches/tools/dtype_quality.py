"""Quality of ``--dtype bfloat16`` against the checkpoint's fp32: greedy agreement on chat prompts.

The first turn of ``--prompts`` conversations of ``kvcore run``'s chat workload (shared system
prompt; every fourth asks about a page of the Python manual), completed greedily with ``--gen``
tokens through the engine (``LLM.chat``, EOS ignored so every completion has ``--gen`` tokens) in
both dtypes; with ``--hf`` also through transformers' ``generate`` in both dtypes, which tells the
drift bf16 itself causes from any the engine adds. Prints ``name: value unit`` lines per pair
(``A_vs_B``: A the reference):

* ``identical_completions``: completions equal token for token (of the prompts);
* ``prefix_agreement_pct``: tokens before the first divergence, over all fp32 tokens (a token
  after a divergence is never counted as agreeing);
* ``position_agreement_pct``: positions where both produced the same token (up to the shorter);
* ``first_divergence_mean``: mean position of the first differing token (completion length when
  none).

Perplexity of the two dtypes is ``kvcore eval-kv --formats auto --dtype D`` (docs/serving.md).

    python benches/tools/dtype_quality.py --prompts 20 --gen 64 --seed 0 [--hf]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))


def _first_divergence(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _compare(name: str, ref: list[list[int]], new: list[list[int]]) -> None:
    pairs = list(zip(ref, new, strict=True))
    div = [_first_divergence(a, b) for a, b in pairs]
    same = sum(a == b for a, b in pairs)
    total = sum(map(len, ref))
    pos = sum(sum(x == y for x, y in zip(a, b, strict=False)) for a, b in pairs)
    shorter = sum(min(len(a), len(b)) for a, b in pairs)
    print(f"{name}_identical_completions: {same} of {len(ref)}")
    print(f"{name}_prefix_agreement_pct: {100 * sum(div) / max(total, 1):.1f} %")
    print(f"{name}_position_agreement_pct: {100 * pos / max(shorter, 1):.1f} %")
    print(f"{name}_first_divergence_mean: {sum(div) / len(div):.1f} tokens")
    print(f"{name}_first_divergence_min: {min(div)} tokens")


def _hf(model_name: str, dtype: str, prompts: list[list[int]], gen: int) -> list[list[int]]:
    """transformers' greedy generate (sdpa attention), one prompt at a time, no EOS stop."""
    import torch
    from kvcore.models.loader import load_model

    model, _ = load_model(model_name, dtype=dtype)
    model.set_attn_implementation("sdpa")
    out = []
    with torch.no_grad():
        for ids in prompts:
            got = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=gen, min_new_tokens=gen, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
            out.append(got[0, len(ids) :].tolist())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf", action="store_true", help="also transformers generate, both dtypes")
    args = p.parse_args(argv)

    import torch
    from kvcore import LLM, SamplingParams
    from kvcore.tools.workload import chat_workload

    torch.set_num_threads(args.threads)
    convs = chat_workload(args.prompts, seed=args.seed)
    msgs = [c.messages(0, []) for c in convs]
    params = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    outs, prompts = {}, []
    for dtype in ("float32", "bfloat16"):
        llm = LLM(args.model, dtype=dtype, kv_memory_bytes=256 << 20, seed=args.seed)
        start = time.perf_counter()
        res = llm.chat(msgs, params, use_tqdm=False)
        print(f"chat_seconds_{dtype}: {time.perf_counter() - start:.1f} s")
        outs[f"kvcore_{dtype}"] = [list(r.outputs[0].token_ids) for r in res]
        prompts = [list(r.prompt_token_ids) for r in res]
        del llm
    _compare("kvcore_fp32_vs_kvcore_bf16", outs["kvcore_float32"], outs["kvcore_bfloat16"])
    if args.hf:
        for dtype in ("float32", "bfloat16"):
            outs[f"hf_{dtype}"] = _hf(args.model, dtype, prompts, args.gen)
        _compare("hf_fp32_vs_hf_bf16", outs["hf_float32"], outs["hf_bfloat16"])
        _compare("hf_fp32_vs_kvcore_fp32", outs["hf_float32"], outs["kvcore_float32"])
        _compare("hf_bf16_vs_kvcore_bf16", outs["hf_bfloat16"], outs["kvcore_bfloat16"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
