"""How much of the offline SmolLM2 job runs outside the native calls: every call of
``kvcore_kernels._native`` timed, the job's wall against their sum, and the time between
neighbouring calls summed by the pair of calls around it (the Python of the model code, the
engine and torch's small ops between two kernels).

``--stub``: the heavy calls (linear, attention, store, element-wise ops) return at once, so the
job is the Python alone with warm caches (outputs are garbage; the token ids are ignored).
``--pollute MB``: as ``--stub`` but each linear copies MB of fp32 (a stand-in for a kernel's
memory stream), the copies' own time subtracted.

    python benches/tools/native_gaps.py --threads 1 [--jobs 2] [--stub | --pollute 4]

Needs the peer's Hugging Face folder of SmolLM2 (``bash ../shared/peers/vllm_cpu/setup.sh``).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
MODEL = "/work/peers/vllm_cpu/smollm2-hf"
# ``_native.run_calls`` records by op code; a crossing of one record is named by its op, a
# crossing of many (``cpu_native.deferred``) "run_calls"
OPS = {0: "linear", 1: "elementwise", 2: "store_kv", 3: "paged_attention"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--workload", choices=["random", "shared"], default="random")
    ap.add_argument("--stub", action="store_true")
    ap.add_argument("--pollute", type=int, default=0, help="MB of fp32 copied per linear")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from bench_vs_vllm_cpu import first_token, workload
    from kvcore.entrypoints.llm import LLM
    from kvcore.params import SamplingParams
    from kvcore_kernels import cpu_native

    llm = LLM(MODEL, dtype="bfloat16", num_blocks=4096, max_num_batched_tokens=2048,
              enforce_eager=True, model_impl="kvcore")  # fmt: skip
    llm.generate([[5] * 40, [6] * 70], SamplingParams(temperature=0, max_tokens=4,
                 ignore_eos=True), use_tqdm=False)  # fmt: skip
    native = cpu_native._native
    spent: collections.Counter = collections.Counter()
    events: list[tuple[str, float, float]] = []
    src = torch.ones(args.pollute << 18)
    dst = torch.empty_like(src)

    def pollute(*_a: object, **_k: object) -> None:
        dst.copy_(src)

    class Timed:
        def __getattr__(self, name: str):  # noqa: ANN204
            fn = getattr(native, name)
            if not callable(fn):
                return fn
            if name == "run_calls" and (args.stub or args.pollute):
                # every record is heavy: none runs; --pollute copies once per linear record
                return lambda calls: [pollute() for op, _, _ in calls if op == 0 and args.pollute]

            def call(*a: object, **k: object) -> object:
                label = name
                if name == "run_calls":
                    calls = a[0]
                    label = OPS.get(calls[0][0], "?") if len(calls) == 1 else "run_calls"
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    t1 = time.perf_counter()
                    spent[label] += t1 - t0
                    events.append((label, t0, t1))

            return call

    cpu_native._native = Timed()
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = workload(args.workload, 0, 48)
    for job in range(args.jobs):
        spent.clear()
        events.clear()
        ps = [[first_token(p[0], 7 + job)] + p[1:] for p in prompts]
        t0 = time.perf_counter()
        llm.generate(ps, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        if args.pollute:
            t0 = time.perf_counter()
            for _ in range(8470):  # the job's linear calls
                pollute()
            copies = time.perf_counter() - t0
            print(f"job {job}: wall {wall:.2f} s, copies alone {copies:.2f} s, "
                  f"the rest {wall - copies:.2f} s")  # fmt: skip
            continue
        inside = sum(spent.values())
        print(f"job {job}: wall {wall:.2f} s, inside native calls {inside:.2f} s, outside "
              f"{wall - inside:.2f} s ({100 * (wall - inside) / wall:.1f} %), "
              f"{len(events)} calls")  # fmt: skip
        gaps: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for (n0, _, end), (n1, start, _) in zip(events, events[1:], strict=False):
            gaps[(n0, n1)] += start - end
            count[(n0, n1)] += 1
        for (n0, n1), s in gaps.most_common(6):
            c = count[(n0, n1)]
            print(f"  {n0} -> {n1}: {s:.3f} s over {c} gaps, {1e6 * s / c:.0f} us each")


if __name__ == "__main__":
    main()
