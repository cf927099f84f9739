"""Ops of one decode step per layer, kvcore's model code vs transformers' modules (torch.profiler,
CPU). Counts the aten ops a step launches (the top-level ones: an op's children are not counted
again) and divides by the layer count; prints the self-time table of the busiest ops.

    python benches/op_count.py [--model smollm2|tiny] [--running 16] [--dtype bfloat16] [--compile]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import collections  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def top_level_ops(prof) -> collections.Counter:
    """aten ops not nested in another aten op (what the Python code launched), by name."""
    events = [
        e for e in prof.events() if e.name.startswith("aten::") or e.name.startswith("kvcore")
    ]
    events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    counts: collections.Counter = collections.Counter()
    stack: list = []
    for e in events:
        while stack and stack[-1].time_range.end <= e.time_range.start:
            stack.pop()
        if not any(s.thread == e.thread for s in stack):
            counts[e.name] += 1
        stack.append(e)
    return counts


def measure(impl: str, args) -> dict:
    os.environ["KVCORE_MODEL_IMPL"] = impl
    from kvcore.entrypoints.llm import LLM
    from kvcore.params import SamplingParams

    model = "smollm2-135m" if args.model == "smollm2" else "tiny-llama"
    llm = LLM(
        model,
        dtype=args.dtype,
        num_blocks=args.running * (args.context // 16 + 8) + 16,
        compile=args.compile,
        enforce_eager=not args.compile,
        max_num_batched_tokens=4096,
    )
    engine = llm.engine
    layers = engine.model.config.num_hidden_layers
    rng = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 1000, (args.running, args.context), generator=rng).tolist()
    ids = engine.add_requests(
        prompts,
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    )
    for _ in range(args.running * args.context // 4096 + 4):
        engine.step()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    counts = top_level_ops(prof)
    engine.abort_request(ids)
    total = sum(counts.values())
    print(
        f"\n== {impl} ({engine.runner.model_impl}), {layers} layers, {args.running} decodes, "
        f"compile={engine.runner.compiled is not None}"
    )
    print(f"decode_step_ms: {sorted(times)[2] * 1e3:.1f}")
    print(f"ops_per_step: {total}  ops_per_layer: {total / layers:.1f}")
    for name, n in counts.most_common(14):
        print(f"  {name:40s} {n:6d}  ({n / layers:.1f}/layer)")
    if args.table:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    return {"ops": total, "layers": layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for impl in ("kvcore", "transformers"):
        measure(impl, args)


if __name__ == "__main__":
    main()
