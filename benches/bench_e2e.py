"""End-to-end benchmark: kvcore vs transformers on a fixed workload, in the same run.

Workload (kvcore.tools.workload.bench_workload): 64 requests arriving at once, prompts of
32-512 tokens
(``--variant shared``: the same 256 tokens first, then 32-256 of their own), max_tokens uniform
in 16-256, greedy, EOS ignored. Model: ``tiny`` (Llama, hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1408, vocab 32000, fp32, seeded random weights) or ``smollm2``.

    python benches/bench_e2e.py --variant random --threads 1 --seed 0 [--model tiny] [--peers]
    python benches/bench_e2e.py --compile --peers          # the compiled forward (CPU)
    python benches/bench_e2e.py --device cuda --dtype bfloat16 --peers   # GPU (graphs + compile)

Prints ``name: value unit`` lines: kvcore_tok_per_s, ttft/itl percentiles, engine_overhead_pct
(wall time outside the model's forward; on CUDA the forward is GPU time between events),
prefix hit rate, compile_graphs / compile_s (``--compile``), cuda_graphs / capture_s /
graph_memory_mib (CUDA), and with ``--peers`` transformers' generate (batch 1, static batches
of 8 left-padded; on CUDA also one static batch of 64), continuous batching (default and
max_requests_per_batch=8), ratio_vs_best_peer and ttft_p50_ratio_vs_static8. Every peer is
warmed up before its timed run. On CUDA (or with ``--decode-step``): decode_step_ms_b64 (median
wall time of a decode step at 64 running requests) and gpu_busy_pct_b64 (kernel time / wall
time of one such step under torch.profiler); ``--profile-table`` prints the profiler's table.
``--compile`` / ``--eager`` force the forward's mode (default: the runner's, by device);
``--eager`` is ``enforce_eager=True`` (no compile, no CUDA graphs).
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning: with spinning, a 2-thread run on a machine whose
# cores are shared collapses (each parallel region can wait a scheduler quantum). Set before
# torch loads; applies to kvcore and the transformers peers alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import kvcore  # noqa: E402
import torch  # noqa: E402
from kvcore import _kvcore  # noqa: E402
from kvcore.entrypoints.llm import LLM  # noqa: E402
from kvcore.models.loader import load_model, tiny_llama  # noqa: E402
from kvcore.params import SamplingParams  # noqa: E402
from kvcore.tools.baselines import hf_continuous, hf_generate  # noqa: E402
from kvcore.tools.report import percentiles, summarize  # noqa: E402
from kvcore.tools.workload import bench_workload  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def refuse_debug_build() -> None:
    """Benchmarks only run on a release build of the extension."""
    if _kvcore.DEBUG_BUILD:
        raise SystemExit("refusing to benchmark a debug build: pip install -e . (release profile)")


def run_kvcore(model, wl, args) -> tuple[object, object]:
    num_tokens = sum(len(p) + m for p, m in zip(wl.prompts, wl.max_tokens, strict=True))
    start = time.perf_counter()
    llm = LLM(
        model,
        num_blocks=num_tokens // 16 + len(wl.prompts) + 64,
        max_num_seqs=256,
        max_num_batched_tokens=args.budget,
        prefix_caching="radix",
        kv_format=args.kv_format,
        seed=args.seed,
        device=args.device,
        enforce_eager=args.mode == "eager",
        compile=True if args.mode == "compile" else None,
    )
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    # Warm-up (allocator, first-call paths, the compiled shapes: several requests and one
    # request, prefill and decode) on unrelated tokens, not timed.
    greedy = SamplingParams(max_tokens=4, temperature=0)
    llm.generate([[5] * 40, [6] * 70], greedy, use_tqdm=False)
    llm.generate([[7] * 20], greedy, use_tqdm=False)
    runner = engine.runner
    print(f"kvcore_startup_s: {time.perf_counter() - start:.1f} s")
    print(f"kvcore_compiled: {runner.compiled is not None}")
    if runner.compiled is not None:
        print(f"compile_graphs_warmup: {runner.compile_stats.graphs} graphs")
        print(f"compile_s: {runner.compile_stats.compile_seconds:.1f} s")
    if runner.graphs is not None:
        g = runner.graphs
        print(f"cuda_graphs: {len(g.sizes)} sizes ({g.sizes[0]}..{g.sizes[-1]})")
        print(f"capture_s: {g.capture_seconds:.1f} s")
        print(f"graph_memory_mib: {g.memory_bytes / 2**20:.1f} MiB")
    graphs0 = runner.compile_stats.graphs
    engine.stats.reset()
    forward0 = engine.runner.forward_seconds
    start = time.perf_counter()
    outputs = llm.generate(wl.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    summary = summarize(outputs, wall, engine)
    forward = engine.runner.forward_seconds - forward0
    summary.engine["engine_overhead_pct"] = 100.0 * (wall - forward) / wall
    summary.engine["all_blocks_free"] = engine.all_blocks_free()
    if runner.compiled is not None:
        summary.engine["recompiles_timed"] = runner.compile_stats.graphs - graphs0
    return summary, llm, outputs


def decode_step(llm, vocab_size: int, args, running: int = 64) -> None:
    """Time decode steps at ``running`` requests (median of 20) and profile one of them."""
    engine = llm.engine
    rng = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, vocab_size, (running, 256), generator=rng).tolist()
    ids = engine.add_requests(
        prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    )
    for _ in range(running * 256 // args.budget + 4):  # every prompt prefilled, a few decodes
        engine.step()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"decode_step_ms_b{running}: {times[len(times) // 2] * 1e3:.2f} ms")
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    if cuda:  # kernels, copies and sets on the device (one stream: they do not overlap)
        busy_us = sum(_self_device_us(a) for a in averages)
        print(f"gpu_busy_pct_b{running}: {100.0 * busy_us / 1e6 / wall:.1f} %")
        print(f"profiled_step_ms_b{running}: {wall * 1e3:.2f} ms")
        launches = sum(a.count for a in averages if _self_device_us(a) > 0)
        print(f"device_ops_per_step_b{running}: {launches} ops")
    if args.profile_table:
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        print(averages.table(sort_by=key, row_limit=25))
    engine.abort_request(ids)


def _self_device_us(avg) -> float:
    """Self device time of a profiler average (the attribute's name moved across torch)."""
    value = getattr(avg, "self_device_time_total", None)
    return float(value if value is not None else avg.self_cuda_time_total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=["random", "shared"], default="random")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--peers", action="store_true", help="also run the transformers peers")
    ap.add_argument("--no-b1", action="store_true", help="skip the (slowest) batch-1 peer")
    ap.add_argument(
        "--static-only", action="store_true", help="peers: transformers' static batches only"
    )
    ap.add_argument(
        "--require-equal",
        action="store_true",
        help="exit 1 unless every peer's greedy outputs equal kvcore's (fp32 exactness checks)",
    )
    ap.add_argument("--budget", type=int, default=2048, help="kvcore token budget per step")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--kv-format", default="auto", help="kvcore's KV storage format")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", default=default_device, help="cpu or cuda (model and kvcore)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--compile", dest="mode", action="store_const", const="compile")
    mode.add_argument("--eager", dest="mode", action="store_const", const="eager")
    ap.add_argument("--decode-step", action="store_true", help="time a decode step at 64 (CPU)")
    ap.add_argument("--profile-table", action="store_true", help="print the profiler table")
    args = ap.parse_args()
    refuse_debug_build()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    if args.model == "tiny":
        model = tiny_llama(seed=args.seed, dtype=dtype)
    else:
        model = load_model("smollm2-135m", dtype=dtype)[0]
    model = model.to(args.device)
    wl = bench_workload(args.variant, model.config.vocab_size, args.seed, args.requests)
    print(f"kvcore_version: {kvcore.__version__}")
    print(
        f"workload: {args.variant} model={args.model} threads={args.threads} seed={args.seed} "
        f"kv_format={args.kv_format} device={args.device} dtype={args.dtype} "
        f"mode={args.mode or 'default'}"
    )
    print(f"omp_wait_policy: {os.environ.get('OMP_WAIT_POLICY')}")
    print(f"output_tokens_requested: {sum(wl.max_tokens)} tok")
    summary, llm, outputs = run_kvcore(model, wl, args)
    for line in summary.lines("kvcore"):
        print(line)
    if args.device.startswith("cuda") or args.decode_step:
        decode_step(llm, model.config.vocab_size, args)
    del llm
    if not args.peers:
        return
    kv_outputs = [o.outputs[0].token_ids for o in outputs]
    sizes = ([] if args.no_b1 else [1]) + [8] + ([64] if args.device.startswith("cuda") else [])
    peers = []
    for bs in sizes:
        warm = wl.prompts[:bs]  # fewer than bs when --requests is small
        hf_generate(model, warm, [2] * len(warm), batch_size=bs)  # warm-up, not timed
        peers.append(hf_generate(model, wl.prompts, wl.max_tokens, batch_size=bs))
    static8 = peers[sizes.index(8)]
    if not args.static_only:
        peers += [
            hf_continuous(model, wl.prompts, wl.max_tokens, None),
            hf_continuous(model, wl.prompts, wl.max_tokens, 8),
        ]
    unequal = []
    for p in peers:
        match = sum(a == b for a, b in zip(kv_outputs, p.outputs, strict=True))
        if match < len(kv_outputs):
            unequal.append(p.name)
        print(f"{p.name}_tok_per_s: {p.tok_per_s:.1f} tok/s")
        print(f"{p.name}_ttft_p50_ms: {percentiles(p.ttft_s)[50] * 1e3:.1f} ms")
        print(f"{p.name}_outputs_equal_kvcore: {match}/{len(kv_outputs)} req")
    best = max(peers, key=lambda p: p.tok_per_s)
    print(f"best_peer: {best.name}")
    print(f"ratio_vs_best_peer: {summary.tok_per_s / best.tok_per_s:.2f} x")
    ttft8 = percentiles(static8.ttft_s)[50]
    print(f"ttft_p50_ratio_vs_static8: {ttft8 / percentiles(summary.ttft_s)[50]:.2f} x")
    if args.require_equal and unequal:
        sys.exit(f"bench_e2e: greedy outputs differ from kvcore's in {', '.join(unequal)}")


if __name__ == "__main__":
    main()
