"""Where the offline SmolLM2 job's wall time goes: GEMMs, attention (prefill and decode steps),
the K/V store, the rest (the attention and store of a step's layers through
``step_calls.LayerCalls`` counted as attention; a gated gate-up as a GEMM; the native
element-wise ops and the greedy argmax on lines of their own; GEMMs and attention each split by
step kind: a step with one query token per request is a decode step). Issue 24/25's
workload (``bench_vs_vllm_cpu.workload``: 48 prompts of
128-384 random token ids, optionally after one shared 512-token prefix, 64 greedy tokens, EOS
ignored), eager, kvcore's own model code. Each call is timed from Python by wrapping it (no
profiler: its per-op cost would inflate the small ops), so the shares add up to the job's wall.

    python benches/profile_offline_split.py [--threads 2] [--workload random|shared] [--seed 0]

The gate-up's oneDNN post-ops A/B (docs/engine.md): the same with ``KVCORE_DNN_SILU_MUL=0``,
then ``=1``, alternated.
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from typing import Any

import kvcore_kernels
import torch
from kvcore_kernels import cpu_native

TIMES: collections.Counter = collections.Counter()


_INSIDE: set[str] = set()


def timed(name: str, fn: Any) -> Any:
    """``fn`` with its time added to ``TIMES[name]`` (a call nested in one of the same name,
    such as a linear inside an unfused gate-up, counts once)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if name in _INSIDE:
            return fn(*args, **kwargs)
        _INSIDE.add(name)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name] += time.perf_counter() - t0
            _INSIDE.discard(name)

    return call


class _TimedKernels:
    """``kvcore_kernels`` as the model code's attention sees it, every call timed; attention
    split by step kind (a decode step has one query token per request)."""

    def __getattr__(self, name: str) -> Any:
        fn = getattr(kvcore_kernels, name)
        if name != "paged_attention":
            return timed(name, fn)

        def attend(q, cache, meta, **kwargs):
            kind = "decode" if q.shape[0] == meta.seq_lens.numel() else "prefill"
            return timed(f"attention, {kind} steps", fn)(q, cache, meta, **kwargs)

        return attend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/work/peers/vllm_cpu/smollm2-hf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", choices=["random", "shared"], default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import kvcore.models.gemma as gemma
    import kvcore.models.layers.linear as linear
    import kvcore.models.llama as llama
    import kvcore.runner.native as native
    from bench_vs_vllm_cpu import workload
    from kvcore.entrypoints.llm import LLM
    from kvcore.params import SamplingParams
    from kvcore.runner.model_runner import ModelRunner
    from kvcore_kernels.step_calls import LayerCalls

    # Every call timed where it is made: deferred calls (cpu_native.deferred) would run later,
    # inside one run_calls crossing, and count as "the rest".
    os.environ["KVCORE_DEFER_CALLS"] = "0"
    native.kvcore_kernels = _TimedKernels()  # type: ignore[assignment]

    class TimedLayerCalls(LayerCalls):  # a step's layers after its first: the kernels straight
        __slots__ = ()

        def __call__(self, q, k, v, cache, slots, meta, **kwargs):  # type: ignore[override]
            kind = "decode" if q.shape[0] == meta.seq_lens.numel() else "prefill"
            call = super().__call__
            return timed(f"attention, {kind} steps", call)(q, k, v, cache, slots, meta, **kwargs)

    native.LayerCalls = TimedLayerCalls  # type: ignore[misc]
    kind = ["prefill"]  # of the step being executed

    def gemm(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            return timed(f"GEMMs, {kind[0]} steps", fn)(*args, **kwargs)

        return call

    execute = ModelRunner.execute

    def kind_execute(self, plan, *args: Any, **kwargs: Any) -> Any:
        decode = len(plan.input_ids) == len(plan.query_start_loc) - 1
        kind[0] = "decode" if decode else "prefill"
        return execute(self, plan, *args, **kwargs)

    ModelRunner.execute = kind_execute  # type: ignore[method-assign]
    for mod in (llama, gemma):  # the gated gate-up (one kernel call) is a GEMM too
        mod.gate_up_act = gemm(mod.gate_up_act)  # type: ignore[attr-defined]
    cascade = collections.Counter()
    build = cpu_native._build

    def counted_build(meta, *args: Any) -> Any:  # how many decode requests read a shared prefix
        work = build(meta, *args)
        decode = int((meta.host_query_start_loc[1:] - meta.host_query_start_loc[:-1] == 1).sum())
        cascade["decode"] += decode
        cascade["cascade"] += work.cascade_requests
        return work

    cpu_native._build = counted_build
    linear._linear = gemm(linear._linear)  # packed or F.linear
    cpu_native.elementwise = timed("element-wise ops", cpu_native.elementwise)  # norms, rotary
    cpu_native.argmax_bf16 = timed("greedy argmax", cpu_native.argmax_bf16)
    llm = LLM(
        args.model_dir, dtype="bfloat16", num_blocks=4096, max_num_batched_tokens=2048,
        enforce_eager=True, model_impl="kvcore",
    )  # fmt: skip
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[5] * 40, [6] * 70], warm, use_tqdm=False)
    TIMES.clear()
    prompts = workload(args.workload, args.seed, args.requests)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    print(f"{args.workload} seed {args.seed}, {args.threads} threads: wall {wall:.2f} s")
    for name, s in TIMES.most_common():
        print(f"  {name:28s} {s:6.2f} s  {100 * s / wall:5.1f} %")
    rest = wall - sum(TIMES.values())
    print(f"  {'the rest':28s} {rest:6.2f} s  {100 * rest / wall:5.1f} %")
    attn = sum(s for n, s in TIMES.items() if n.startswith("attention") or n == "store_kv")
    print(f"attention_share_pct: {100 * attn / wall:.1f}")
    if cascade["decode"]:
        pct = 100 * cascade["cascade"] / cascade["decode"]
        on = cpu_native.OPTIONS.cascade
        print(f"decode requests in cascade items: {pct:.1f} % (cascade {on})")


if __name__ == "__main__":
    main()
