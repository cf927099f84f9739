"""In-process A/B of two builds of the native extension on paged-attention calls: both builds
loaded side by side, one call set timed on each in turn (the order alternated), the ratio of
each pair kept; prints the median ratio (A over B: above 1, B is faster), a bootstrap 95 %
interval of that median, the interquartile range, and the largest output difference.

On a shared VM whose speed drifts 10-20 % within minutes, a median of a few rounds of seconds
each did not separate 3 % changes (two runs of one pair of builds read 0.93x and 1.02x); hundreds
of short alternated pairs do: an A/A run reads 1.000 (interval 0.998-1.002), and whichever
build is loaded as A reads ~0.7 % faster, so a change is only believed when it wins from both
sides (``A B`` and ``B A``).

    cd kernels/native && cargo build --release --features python  # then copy lib_native.so
    python benches/tools/ab_native_builds.py A.so B.so --kind shared --threads 1 --pairs 300

Both builds must speak the binding this checkout's ``cpu_native`` calls (``run_calls``, from
commit f607c7a on); the raw results of 2026-12-06e compared builds of the binding before it.

``--kind``: ``prefill`` (16 prompts of 128-384 tokens), ``shared`` (8 suffixes of 128-384 tokens
after a 512-token prefix), or ``BxL`` decode (B requests of L tokens; ``--caches`` sets how
many caches rotate: 1 keeps them warm). SmolLM2's attention shape: 9 query heads, 3 KV heads,
head dim 64, bf16, block size 16.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

HQ, HK, D, BS = 9, 3, 64, 16


def load(path: str, tag: str):  # noqa: ANN201
    """A build of ``_native`` under its own module name, bound to torch's OpenMP threads."""
    spec = importlib.util.spec_from_file_location(f"{tag}._native", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "libgomp" in line})
    lib = ctypes.CDLL(libs[0], mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    mod.set_gomp_parallel(ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value)
    return mod


def calls_for(kind: str, caches: int) -> list[tuple]:
    import kvcore_kernels as kk
    from bench_attention import paged_copy

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(caches):
        if kind in ("prefill", "shared"):
            n = 16 if kind == "prefill" else 8
            new = torch.randint(128, 385, (n,), generator=gen)
            lens = new + (512 if kind == "shared" else 0)
        else:
            b, length = (int(x) for x in kind.split("x"))
            new = torch.ones(b, dtype=torch.int64)
            lens = torch.full((b,), length)
        batch, longest = len(lens), int(lens.max())
        keys = torch.randn(batch, HK, longest, D, generator=gen).bfloat16()
        vals = torch.randn(batch, HK, longest, D, generator=gen).bfloat16()
        cache, table = paged_copy(gen, keys, vals, BS)
        q = torch.randn(int(new.sum()), HQ, D, generator=gen).bfloat16()
        qsl = torch.zeros(batch + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(new, 0)
        out.append((q, cache, kk.plan_attention(qsl, lens.int(), table, BS)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--kind", default="shared")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--caches", type=int, default=0, help="default: 2 (prefill), 30 (decode)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import kvcore_kernels as kk
    from kvcore_kernels import cpu_native

    cpu_native.features()
    mods = {"A": load(args.a, "build_a"), "B": load(args.b, "build_b")}
    caches = args.caches or (2 if args.kind in ("prefill", "shared") else 30)
    calls = calls_for(args.kind, caches)

    def run() -> list[torch.Tensor]:
        return [
            kk.paged_attention(q, cache, meta, scale=D**-0.5, backend="cpu")
            for q, cache, meta in calls
        ]

    outs = {}
    for k, mod in mods.items():
        cpu_native._native = mod
        outs[k] = run()
    pairs = zip(outs["A"], outs["B"], strict=True)
    err = max((x.float() - y.float()).abs().max().item() for x, y in pairs)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    ratios = []
    for r in range(args.pairs):
        t = {}
        for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
            cpu_native._native = mods[k]
            t0 = clock()
            run()
            t[k] = clock() - t0
        ratios.append(t["A"] / t["B"])
    ratios.sort()
    n = len(ratios)
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(400))
    print(
        f"{args.kind} {args.threads}t: A/B median {statistics.median(ratios):.3f} "
        f"(95% interval {boot[10]:.3f}-{boot[389]:.3f}; IQR {ratios[n // 4]:.3f}-"
        f"{ratios[3 * n // 4]:.3f}; {n} pairs; max |A-B| {err:.2e})"
    )


if __name__ == "__main__":
    main()
