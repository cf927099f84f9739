"""End-to-end benchmark: kvcore vs transformers on a fixed workload, in the same run.

Workload (kvcore.workload.bench_workload): 64 requests arriving at once, prompts of 32-512 tokens
(``--variant shared``: the same 256 tokens first, then 32-256 of their own), max_tokens uniform
in 16-256, greedy, EOS ignored. Model: ``tiny`` (Llama, hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1408, vocab 32000, fp32, seeded random weights) or ``smollm2``.

    python benches/bench_e2e.py --variant random --threads 1 --seed 0 [--model tiny] [--peers]

Prints ``name: value unit`` lines: kvcore_tok_per_s, ttft/itl percentiles, engine_overhead_pct
(wall time outside the model's forward), prefix hit rate, and with ``--peers`` transformers'
generate (batch 1, static batches of 8 left-padded) and continuous batching (default and
max_requests_per_batch=8), ratio_vs_best_peer and ttft_p50_ratio_vs_static8.
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: with spinning, a 2-thread run on a machine whose
# cores are shared collapses (each parallel region can wait a scheduler quantum). Set before
# torch loads; applies to kvcore and the transformers peers alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import time  # noqa: E402

import kvcore  # noqa: E402
import torch  # noqa: E402
from kvcore import _kvcore  # noqa: E402
from kvcore.baselines import hf_continuous, hf_generate  # noqa: E402
from kvcore.llm import LLM  # noqa: E402
from kvcore.models import load_model, tiny_llama  # noqa: E402
from kvcore.outputs import SamplingParams  # noqa: E402
from kvcore.report import percentiles, summarize  # noqa: E402
from kvcore.workload import bench_workload  # noqa: E402


def refuse_debug_build() -> None:
    """Benchmarks only run on a release build of the extension."""
    if _kvcore.DEBUG_BUILD:
        raise SystemExit("refusing to benchmark a debug build: pip install -e . (release profile)")


def run_kvcore(model, wl, args) -> tuple[object, object]:
    num_tokens = sum(len(p) + m for p, m in zip(wl.prompts, wl.max_tokens, strict=True))
    llm = LLM(
        model,
        num_blocks=num_tokens // 16 + len(wl.prompts) + 64,
        max_num_seqs=256,
        max_num_batched_tokens=args.budget,
        prefix_caching="radix",
        kv_format=args.kv_format,
        seed=args.seed,
    )
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    # Warm-up (allocator, first-call paths) on unrelated tokens, not timed.
    llm.generate([[5] * 40, [6] * 70], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    engine.stats.reset()
    forward0 = engine.runner.forward_seconds
    start = time.perf_counter()
    outputs = llm.generate(wl.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    summary = summarize(outputs, wall, engine)
    forward = engine.runner.forward_seconds - forward0
    summary.engine["engine_overhead_pct"] = 100.0 * (wall - forward) / wall
    summary.engine["all_blocks_free"] = engine.all_blocks_free()
    return summary, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=["random", "shared"], default="random")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--peers", action="store_true", help="also run the transformers peers")
    ap.add_argument("--no-b1", action="store_true", help="skip the (slowest) batch-1 peer")
    ap.add_argument("--budget", type=int, default=2048, help="kvcore token budget per step")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--kv-format", default="auto", help="kvcore's KV storage format")
    args = ap.parse_args()
    refuse_debug_build()
    torch.set_num_threads(args.threads)
    model = tiny_llama(seed=args.seed) if args.model == "tiny" else load_model("smollm2-135m")[0]
    wl = bench_workload(args.variant, model.config.vocab_size, args.seed, args.requests)
    print(f"kvcore_version: {kvcore.__version__}")
    print(
        f"workload: {args.variant} model={args.model} threads={args.threads} seed={args.seed} "
        f"kv_format={args.kv_format}"
    )
    print(f"omp_wait_policy: {os.environ.get('OMP_WAIT_POLICY')}")
    print(f"output_tokens_requested: {sum(wl.max_tokens)} tok")
    summary, outputs = run_kvcore(model, wl, args)
    for line in summary.lines("kvcore"):
        print(line)
    if not args.peers:
        return
    kv_outputs = [o.outputs[0].token_ids for o in outputs]
    peers = [] if args.no_b1 else [hf_generate(model, wl.prompts, wl.max_tokens, batch_size=1)]
    static8 = hf_generate(model, wl.prompts, wl.max_tokens, batch_size=8)
    peers += [
        static8,
        hf_continuous(model, wl.prompts, wl.max_tokens, None),
        hf_continuous(model, wl.prompts, wl.max_tokens, 8),
    ]
    for p in peers:
        match = sum(a == b for a, b in zip(kv_outputs, p.outputs, strict=True))
        print(f"{p.name}_tok_per_s: {p.tok_per_s:.1f} tok/s")
        print(f"{p.name}_ttft_p50_ms: {percentiles(p.ttft_s)[50] * 1e3:.1f} ms")
        print(f"{p.name}_outputs_equal_kvcore: {match}/{len(kv_outputs)} req")
    best = max(peers, key=lambda p: p.tok_per_s)
    print(f"best_peer: {best.name}")
    print(f"ratio_vs_best_peer: {summary.tok_per_s / best.tok_per_s:.2f} x")
    ttft8 = percentiles(static8.ttft_s)[50]
    print(f"ttft_p50_ratio_vs_static8: {ttft8 / percentiles(summary.ttft_s)[50]:.2f} x")


if __name__ == "__main__":
    main()
