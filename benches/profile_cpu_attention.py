"""Attention's share of an offline SmolLM2 job on the CPU: twin ("torch") vs native ("auto").

The issue-25 job shrunk for a shared machine: ``--requests`` prompts of 128-384 tokens,
``--max-tokens`` outputs, bf16, one ``torch.profiler`` run per backend; prints the self CPU time
of the ops the twin's attention is made of (``index_select``, ``index_fill_``, SDPA) and of the
native call (wrapped in a ``record_function`` by this script), against all matmuls, and the
job's wall time (one run each, not interleaved: a loaded machine skews it).

    python benches/profile_cpu_attention.py [--requests 16] [--max-tokens 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from kvcore.entrypoints.llm import LLM
from kvcore.params import SamplingParams
from kvcore_kernels import cpu_native
from torch.profiler import ProfilerActivity, profile, record_function

_run = cpu_native.run
# Each call timed where it is made: deferred calls (cpu_native.deferred) would run later, inside
# one run_calls crossing, outside these records.
os.environ["KVCORE_DEFER_CALLS"] = "0"


def _traced_run(*args, **kwargs):
    """The native call, made visible to the profiler (it is not a torch op)."""
    with record_function("native_paged_attention"):
        return _run(*args, **kwargs)


cpu_native.run = _traced_run  # this script only: the library's hot path is unchanged

GROUPS = {
    "index_select": ("aten::index_select",),
    "index_fill_": ("aten::index_fill_",),
    "sdpa": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
    ),
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, 40000, (int(torch.randint(128, 385, (1,), generator=gen)),),
                      generator=gen).tolist()
        for _ in range(args.requests)
    ]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for backend in ("torch", "auto"):
        llm = LLM("smollm2-135m", dtype="bfloat16", num_blocks=2048, kernel_backend=backend)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        share = {g: 0.0 for g in GROUPS}
        native = 0.0
        for e in prof.key_averages():
            for g, names in GROUPS.items():
                if e.key in names:
                    share[g] += e.self_cpu_time_total
            if e.key == "native_paged_attention":
                native += e.cpu_time_total
        print(f"backend {backend}: wall {wall:.2f} s, "
              + ", ".join(f"{g} {100 * v / total:.1f}%" for g, v in share.items())
              + f", native kernel {100 * native / total:.1f}%")  # fmt: skip
        del llm


if __name__ == "__main__":
    main()
