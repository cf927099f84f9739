"""Per-step cost of the Rust scheduler through Python, beside the same steps timed in Rust.

    python benches/bench_scheduler.py --running 1024 --phase mixed --seed 0

Keeps ``--running`` requests in the system: ``decode`` runs them all in decode (128-token
prompts, no request finishes); ``mixed`` uses an 8,192-token budget, prompts of 128-1,024 tokens
(half start with one of 16 shared 256-token prefixes), 64-512 output tokens, and replaces every
finished request with a new one, so each step mixes ~N decodes with the new prompts' prefill
chunks. The fake model samples token 7 for every sample.

Two identical schedulers see the same request stream. The first is driven through Python:
``schedule()`` (NumPy StepPlan) and ``update()`` (NumPy sampled tokens) are timed.
The second runs ``Scheduler.bench_step``: the same ``schedule()`` + ``update()`` timed inside Rust,
with no NumPy arrays, so the difference is the cost of the boundary. Refills (``add_requests``)
are outside both timings and reported apart. Prints ``name: value unit`` lines.
"""

import argparse
import statistics
import time

import numpy as np
from kvcore import Scheduler, _kvcore

TOKEN = 7  # what the fake model samples (never a stop token: requests end by length)
BLOCK_SIZE = 16


class Stream:
    """An endless seeded stream of requests for one phase."""

    def __init__(self, phase: str, seed: int, decode_len: int) -> None:
        self.phase = phase
        self.decode_len = decode_len  # decode phase: outputs outlast the measurement
        self.rng = np.random.default_rng(seed)
        self.prefixes = self.rng.integers(10, 32000, size=(16, 256), dtype=np.int32)
        self.next_id = 0

    def one(self) -> tuple[np.ndarray, int]:
        rng = self.rng
        if self.phase == "decode":
            return rng.integers(10, 32000, size=128, dtype=np.int32), self.decode_len
        if rng.random() < 0.5:
            n = int(rng.integers(257, 1025))
            own = rng.integers(10, 32000, size=n - 256, dtype=np.int32)
            prompt = np.concatenate([self.prefixes[rng.integers(16)], own])
        else:
            prompt = rng.integers(10, 32000, size=int(rng.integers(128, 1025)), dtype=np.int32)
        return prompt, int(rng.integers(64, 513))

    def add(self, s: Scheduler, k: int) -> None:
        if k == 0:
            return
        prompts, max_tokens = zip(*(self.one() for _ in range(k)), strict=True)
        offsets = np.zeros(k + 1, np.int64)
        np.cumsum([len(p) for p in prompts], out=offsets[1:])
        ids = np.arange(self.next_id, self.next_id + k, dtype=np.int64)
        self.next_id += k
        s.add_requests(ids, np.concatenate(prompts), offsets, np.array(max_tokens), ignore_eos=True)


def make(args) -> tuple[Scheduler, Stream]:
    n = args.running
    if args.phase == "decode":
        decode_len = args.steps + args.warmup + 128
        per_req = -(-(128 + decode_len) // BLOCK_SIZE)
        budget, max_len = max(8192, n), 1 << 20
    else:
        decode_len = 0
        per_req = -(-(1024 + 512) // BLOCK_SIZE)
        budget, max_len = 8192, 2048
    s = Scheduler(
        n * per_req + 1024,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=budget,
        max_num_seqs=n,
        max_model_len=max_len,
        prefix_mode=args.prefix_mode,
    )
    stream = Stream(args.phase, args.seed, decode_len)
    stream.add(s, n)
    return s, stream


def warm_up(s: Scheduler, stream: Stream, args, step) -> None:
    """Steps until every request is admitted (decode: and decoding), then `--warmup` more."""
    for _ in range(100_000):
        stream.add(s, step())
        st = s.stats()
        decoding = st.num_scheduled_tokens == st.num_running  # one token per row
        if st.num_waiting == 0 and (args.phase == "mixed" or decoding):
            break
    for _ in range(args.warmup):
        stream.add(s, step())


def run_python(args) -> dict[str, list[float]]:
    """Times schedule() and update() through Python; returns per-step samples."""
    s, stream = make(args)
    sampled = np.full(args.running * 4, TOKEN, np.int32)
    res: dict[str, list[float]] = {k: [] for k in ("sched", "upd", "add", "rows", "tokens")}
    clock = time.perf_counter_ns

    def step() -> int:
        t0 = clock()
        plan = s.schedule()
        t1 = clock()
        out = s.update(plan.step_id, sampled[: plan.num_sampled])
        t2 = clock()
        res["sched"].append(t1 - t0)
        res["upd"].append(t2 - t1)
        res["rows"].append(plan.num_reqs)
        res["tokens"].append(plan.num_tokens)
        return out.num_finished

    warm_up(s, stream, args, step)
    for v in res.values():
        v.clear()
    for _ in range(args.steps):
        finished = step()
        t0 = clock()
        stream.add(s, finished)
        res["add"].append(clock() - t0)
    s.check_invariants()
    st = s.stats()
    res["total"] = [a + b for a, b in zip(res["sched"], res["upd"], strict=True)]
    res["preemptions"] = [st.num_preemptions]
    res["hit"] = [st.prefix_hit_tokens / max(1, st.prefix_query_tokens)]
    return res


def run_rust(args) -> list[float]:
    """The same steps on a twin scheduler, timed inside Rust (no NumPy arrays built)."""
    s, stream = make(args)
    times: list[float] = []

    def step() -> int:
        ns, finished = s.bench_step(TOKEN)
        times.append(ns)
        return finished

    warm_up(s, stream, args, step)
    times.clear()
    for _ in range(args.steps):
        stream.add(s, step())
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--phase", choices=("decode", "mixed"), default="decode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300, help="measured steps")
    ap.add_argument("--warmup", type=int, default=20, help="extra steps after settling")
    ap.add_argument("--prefix-mode", default="radix", choices=("radix", "hash", "off"))
    args = ap.parse_args()
    if getattr(_kvcore, "DEBUG_BUILD", True):
        raise SystemExit("refusing to benchmark a debug build of kvcore._kvcore")

    py = run_python(args)
    rust = run_rust(args)
    med = statistics.median
    us_py, us_rust = med(py["total"]) / 1e3, med(rust) / 1e3
    n = args.running
    print(f"running: {n} requests")
    print(f"phase: {args.phase}")
    print(f"rows_per_step: {statistics.mean(py['rows']):.1f} rows")
    print(f"tokens_per_step: {statistics.mean(py['tokens']):.1f} tokens")
    print(f"us_per_step: {us_py:.1f} us")
    print(f"us_schedule: {med(py['sched']) / 1e3:.1f} us")
    print(f"us_update: {med(py['upd']) / 1e3:.1f} us")
    print(f"us_per_step_rust: {us_rust:.1f} us")
    print(f"us_per_running_request: {us_py / n:.3f} us")
    print(f"boundary_overhead: {us_py / us_rust:.2f} x (python / rust-only)")
    print(f"us_add_requests_per_step: {statistics.mean(py['add']) / 1e3:.1f} us")
    print(f"prefix_hit_rate: {py['hit'][0]:.3f} ratio")
    print(f"preemptions: {py['preemptions'][0]} count")
    print(f"target_0.5us_per_request: {'met' if us_py / n <= 0.5 else 'missed'}")


if __name__ == "__main__":
    main()
