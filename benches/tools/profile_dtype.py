"""Where a bf16 (or fp32) step of SmolLM2 goes on the CPU: prefill timing, op profile, decode A/B.

* ``prefill``: ``LLM(dtype=D).generate`` of one ``--prompt-len``-token prompt (1 output token),
  twice, then ``torch.profiler`` over one prefill plus ``--decode`` decode steps (op table by self
  CPU time: an fp32 ``mm``, a ``_to_copy`` storm or an unexpected op shows up here).
* ``decode-ab``: one decode step of ``--seqs`` sequences of ``--prompt-len`` tokens, kvcore's
  engine against transformers' own forward (DynamicCache, sdpa) on the same model, interleaved
  step by step in one process (``--steps`` each), so a loaded machine slows both alike.

    python benches/tools/profile_dtype.py prefill --dtype bfloat16 [--prompt-len 1000]
    python benches/tools/profile_dtype.py decode-ab --dtype bfloat16 --seqs 8 [--prompt-len 300]
"""

from __future__ import annotations

import argparse
import time

import torch
from kvcore.entrypoints.llm import LLM
from kvcore.models.loader import load_model
from kvcore.params import SamplingParams


def _prompt(i: int, n: int) -> list[int]:
    return [5 + i] + list(range(1000 + i, 1000 + i + n))


def prefill(args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm = LLM("smollm2-135m", dtype=args.dtype, num_blocks=1024)
    kv = llm.engine.runner.kv_caches[0].dtype
    print(f"model_dtype: {llm.engine.model.dtype}, kv_dtype: {kv}")
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([_prompt(0, 200)], one, use_tqdm=False)  # warm-up
    for rep in range(2):
        start = time.perf_counter()
        llm.generate([_prompt(rep + 1, args.prompt_len)], one, use_tqdm=False)
        print(f"prefill_{args.prompt_len + 1}_tok_ms: {(time.perf_counter() - start) * 1e3:.1f} ms")
    params = SamplingParams(temperature=0, max_tokens=args.decode + 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([_prompt(9, args.prompt_len)], params, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def decode_ab(args: argparse.Namespace) -> None:
    from transformers import DynamicCache

    n, plen = args.seqs, args.prompt_len
    eng = LLM("smollm2-135m", dtype=args.dtype, num_blocks=1024).engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(n):
        eng.add_request(_prompt(i, plen), params)
    while eng.stats.sampled_tokens < n:  # every prompt prefilled
        eng.step()
    hf, _ = load_model("smollm2-135m", dtype=args.dtype)
    hf.set_attn_implementation("sdpa")
    ids = torch.tensor([_prompt(i, plen) for i in range(n)])
    ours, theirs = [], []
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        nxt = hf(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        pos = plen + 1
        for _ in range(args.steps):
            start = time.perf_counter()
            eng.step()
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            pos_ids = torch.full((n, 1), pos)
            out = hf(input_ids=nxt, past_key_values=cache, use_cache=True, position_ids=pos_ids)
            nxt, pos = out.logits[:, -1:].argmax(-1), pos + 1
            theirs.append(time.perf_counter() - start)

    def med(v: list[float]) -> float:
        return sorted(v)[len(v) // 2] * 1e3

    print(f"kvcore_decode_step_ms: {med(ours):.1f} ms")
    print(f"transformers_forward_ms: {med(theirs):.1f} ms")
    print(f"ratio_transformers_over_kvcore: {med(theirs) / med(ours):.2f} x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["prefill", "decode-ab"])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-len", type=int, default=None, help="default 1000 / 300")
    p.add_argument("--decode", type=int, default=8, help="decode steps profiled after prefill")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode == "prefill":
        args.prompt_len = args.prompt_len or 1000
        prefill(args)
    else:
        args.prompt_len = args.prompt_len or 300
        decode_ab(args)


if __name__ == "__main__":
    main()
