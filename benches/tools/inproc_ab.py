"""Shared pieces of the in-process A/B tools (``ab_last_layer.py``, ``ab_step_graphs.py``): one
offline ``LLM`` runs the same workload under two variants alternated per run, each run with its
own cache salt (no prefix hits across runs), so start-up and machine drift fall on both sides
alike."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def parser() -> argparse.ArgumentParser:
    """The options both tools take: threads, rounds, seeds, requests, tokens, a model folder."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default=None, help="default: the embedded SmolLM2")
    return ap


def engine(args: argparse.Namespace) -> Any:
    """The offline ``LLM`` of issue 24's job (bf16, eager, kvcore's model code) at
    ``args.threads``; SystemExit where the model runs transformers' modules."""
    import torch
    from kvcore.entrypoints.llm import LLM

    torch.set_num_threads(args.threads)
    kw = {"model": args.model_dir} if args.model_dir else {}
    llm = LLM(**kw, dtype="bfloat16", num_blocks=4096, max_num_batched_tokens=2048,
              enforce_eager=True)  # fmt: skip
    if llm.engine.runner.model_impl != "kvcore":
        raise SystemExit("the A/B is in kvcore's model code; this model runs transformers'")
    return llm


def timed_generate(llm: Any, prompts: list, params: Any, salt: str) -> tuple[float, list]:
    """One run: the wall in seconds and the outputs."""
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False, cache_salt=salt)
    return time.perf_counter() - t0, res


def summarize(
    walls: dict[str, list[float]], outs: dict[str, list], seeds: list[int], base: str, new: str
) -> None:
    """Print the medians, both ratios, the pairs ``new`` won, and per seed how many of the
    sequences (``outs[f"{seed}/{name}"]``) are equal."""
    b, n = statistics.median(walls[base]), statistics.median(walls[new])
    won = sum(y < x for x, y in zip(walls[base], walls[new], strict=True))
    print(f"median {base} {b:.2f} s, {new} {n:.2f} s, {new} / {base} {n / b:.4f}, "
          f"{base} / {new} {b / n:.4f}; {new} faster in {won}/{len(walls[new])} pairs")  # fmt: skip
    for seed in seeds:
        x, y = outs[f"{seed}/{base}"], outs[f"{seed}/{new}"]
        same = sum(p == q for p, q in zip(x, y, strict=True))
        print(f"seed {seed}: {same}/{len(x)} sequences equal")
