"""Where each request's time to first token goes in ``bench_tiers.py``'s workload
(docs/tiers.md, "Why TTFT p50 improves less than the computed prompt tokens").

    python benches/tools/trace_tiers.py [bench_tiers flags] [--trace-configs pool_only,tiered]
        [--json out.json]

Serves the workload on the listed configurations, paired by default (one step each in turn,
``--timing sequential``: one after the other), and records every engine step (wall time,
forward time, tier-move time, prefill tokens, decode rows, attention work = sum of query x
context, L2 loads, preemptions) and every request (arrival, the steps it ran in, first token).
Times are each engine's own step seconds. Each request's TTFT is split into:

- ``queue``: the steps between its arrival and its first scheduled step (of which
  ``queue_decode_only``: steps without any prefill),
- ``own``: the steps its prompt was computed in (its chunks, shared with others' rows),
- ``gap``: steps between its first chunk and its first token that left it out (preempted),
- ``recompute``: prompt tokens it computed twice (preemption by recompute).

Prints ``name: value`` lines per configuration, per-wave TTFT p50 (waves arrival), and the
pool-only / tiered ratios; ``--json`` keeps every step and request record.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benches/
import bench_tiers as b  # noqa: E402


class Tracer:
    """Wraps one LLM's step, forward and tier hook; keeps per-step and per-request records."""

    def __init__(self, llm) -> None:
        self.steps: list[dict] = []
        self.reqs: dict[str, dict] = {}
        eng = self.engine = llm.engine
        runner, step = eng.runner, eng._step
        execute, hook = runner.execute, runner.tier_hook
        self.cur: dict | None = None

        def traced_step():
            self.cur = {"t0": time.perf_counter(), "fwd0": runner.forward_seconds}
            out = step()
            cur = self.cur
            cur["t1"] = time.perf_counter()
            cur["fwd"] = runner.forward_seconds - cur.pop("fwd0")
            cur["preempt"] = int(eng.scheduler.stats().num_preemptions)
            self.steps.append(cur)
            return out

        def traced_execute(plan, logits_indices, block_mass=None):
            cur = self.cur
            qs = np.asarray(plan.query_start_loc)
            qlen = np.diff(qs)
            seq = np.asarray(plan.seq_lens)
            pos = np.asarray(plan.positions)
            pre = qlen > 1
            cur.update(
                tokens=int(qs[-1]),
                prefill_tokens=int(qlen[pre].sum()),
                decode_rows=int((~pre).sum()),
                attn=float((qlen * seq).sum()),
                loads=int(len(plan.tier_load)),
                offloads=int(len(plan.tier_offload)),
                tier_s=0.0,
            )
            k = len(self.steps)
            for r, rid in enumerate(plan.req_ids.tolist()):
                req = eng._requests.get(rid)
                if req is None:
                    continue
                rec = self.reqs.setdefault(
                    req.request_id, {"metrics": req.metrics, "rows": [], "prompt": None}
                )
                rec["prompt"] = len(req.prompt_token_ids)
                rec["rows"].append((k, int(pos[qs[r]]), int(qlen[r])))
            return execute(plan, logits_indices, block_mass=block_mass)

        def traced_hook(plan):
            t = time.perf_counter()
            hook(plan)
            self.cur["tier_s"] = time.perf_counter() - t

        eng._step = traced_step
        runner.execute = traced_execute
        if hook is not None:
            runner.tier_hook = traced_hook

    def requests(self) -> list[dict]:
        """Per request: ttft and its split (seconds of this engine's own steps, so that a paired
        run's other engine does not count), prompt and recomputed tokens."""
        t0 = np.array([s["t0"] for s in self.steps])
        t1 = np.array([s["t1"] for s in self.steps])
        dur = t1 - t0
        v1 = np.cumsum(dur)  # own clock at the end of each step
        decode_only = np.array([s.get("prefill_tokens", 0) == 0 for s in self.steps])
        out = []
        for rid, rec in self.reqs.items():
            m = rec["metrics"]
            if m.first_token_time is None:
                continue
            prompt = rec["prompt"]
            pre_rows = []
            for k, p, n in rec["rows"]:  # rows up to (and including) the prompt's last chunk
                pre_rows.append((k, p, n))
                if p + n >= prompt:
                    break
            first, last = pre_rows[0][0], pre_rows[-1][0]
            arrived = int(np.searchsorted(t1, m.arrival_time))  # first step after arrival
            own_steps = sorted({k for k, _, _ in pre_rows})
            own = float(dur[own_steps].sum())
            done, recompute = 0, 0
            for _, p, n in pre_rows:
                recompute += max(0, min(done, p + n) - p)
                done = max(done, p + n)
            queue = slice(arrived, first)
            out.append(
                {
                    "id": rid,
                    "ttft": float(v1[last] - (v1[arrived] - dur[arrived])),
                    "ttft_wall": m.first_token_time - m.arrival_time,
                    "queue": float(dur[queue].sum()),
                    "queue_decode_only": float(dur[queue][decode_only[queue]].sum()),
                    "queue_steps": first - arrived,
                    "own": own,
                    "own_steps": len(own_steps),
                    "gap": float(dur[first : last + 1].sum()) - own,
                    "prompt": prompt,
                    "hit": pre_rows[0][1],
                    "computed": sum(n for _, _, n in pre_rows),
                    "recompute": recompute,
                    "arrival_step": arrived,
                }
            )
        return out


def step_model(steps: list[dict]) -> dict:
    """Least-squares step cost: wall = a + b * prefill tokens + c * attention work + d * decode
    rows (steps with a forward)."""
    rows = [s for s in steps if "tokens" in s]
    x = np.array([[1.0, s["prefill_tokens"], s["attn"], s["decode_rows"]] for s in rows])
    y = np.array([s["t1"] - s["t0"] for s in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return dict(
        zip(
            ("per_step_s", "per_prefill_token_s", "per_attn_s", "per_decode_row_s"),
            coef,
            strict=True,
        )
    )


def summarize(name: str, tr: Tracer, arrival: str) -> dict:
    reqs = tr.requests()
    steps = tr.steps
    fwd = [s for s in steps if "tokens" in s]
    ttft = np.array([r["ttft"] for r in reqs])
    med = np.argsort(ttft)[len(ttft) // 2]
    model = step_model(steps)
    tot = lambda k: sum(s.get(k, 0) for s in steps)  # noqa: E731
    wall = sum(s["t1"] - s["t0"] for s in steps)
    cost = {
        "overhead": model["per_step_s"] * len(fwd),
        "prefill": model["per_prefill_token_s"] * tot("prefill_tokens"),
        "attention": model["per_attn_s"] * tot("attn"),
        "decode": model["per_decode_row_s"] * tot("decode_rows"),
    }
    decode_only = [s for s in fwd if s["prefill_tokens"] == 0]
    s = {
        "config": name,
        "requests": len(reqs),
        "steps": len(steps),
        "steps_with_forward": len(fwd),
        "decode_only_steps": len(decode_only),
        "step_wall_s": wall,
        "forward_s": tot("fwd"),
        "tier_s": tot("tier_s"),
        "prefill_tokens": tot("prefill_tokens"),
        "decode_rows": tot("decode_rows"),
        "attn_work": tot("attn"),
        "l2_loads": tot("loads"),
        "preemptions": steps[-1]["preempt"] if steps else 0,
        "requests_preempted_before_first_token": sum(r["recompute"] > 0 for r in reqs),
        "recomputed_prompt_tokens": sum(r["recompute"] for r in reqs),
        "frac_steps_with_prefill": float(np.mean([s["prefill_tokens"] > 0 for s in fwd])),
        "mean_decode_rows_per_step": float(np.mean([s["decode_rows"] for s in fwd])),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_mean_s": float(ttft.mean()),
        "queue_mean_s": float(np.mean([r["queue"] for r in reqs])),
        "queue_decode_only_mean_s": float(np.mean([r["queue_decode_only"] for r in reqs])),
        "decode_only_step_mean_s": float(np.mean([s["t1"] - s["t0"] for s in decode_only])),
        "prefill_step_mean_s": float(
            np.mean([s["t1"] - s["t0"] for s in fwd if s["prefill_tokens"] > 0])
        ),
        "own_mean_s": float(np.mean([r["own"] for r in reqs])),
        "gap_mean_s": float(np.mean([r["gap"] for r in reqs])),
        "median_request": reqs[med],
        "step_model": model,
        "step_time_split_s": cost,
    }
    if arrival == "waves":  # requests that arrived between the same two steps
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault(r["arrival_step"], []).append(i)
        s["waves"] = [
            {
                "n": len(w),
                "first_step": int(reqs[w[0]]["arrival_step"]),
                "ttft_p50_s": float(np.percentile(ttft[w], 50)),
                "ttft_max_s": float(ttft[w].max()),
                "computed_tokens": int(sum(reqs[i]["computed"] for i in w)),
            }
            for _, w in sorted(groups.items())
        ]
    return s


def main() -> None:
    argv = sys.argv[1:]
    names, out = ["pool_only", "tiered"], None
    if "--trace-configs" in argv:
        i = argv.index("--trace-configs")
        names = argv[i + 1].split(",")
        del argv[i : i + 2]
    if "--json" in argv:
        i = argv.index("--json")
        out = argv[i + 1]
        del argv[i : i + 2]
    args = b.parse(argv)
    systems, convs = b.make_workload(args)
    sizes = b.sizes(args, systems, convs)
    print(f"working_set_over_pool: {sizes['working_over_pool']:.2f} x")
    tracers: dict[str, Tracer] = {}
    kw = {k: sizes["configs"][k] for k in names}
    start = time.perf_counter()
    if args.timing == "paired":
        b.serve_paired(
            args, systems, convs, kw, hook=lambda n, llm: tracers.update({n: Tracer(llm)})
        )
    else:
        for n in names:
            b.serve(
                args, systems, convs, kw[n], hook=lambda llm, n=n: tracers.update({n: Tracer(llm)})
            )
    print(f"timing: {args.timing}  arrival: {args.arrival}")
    print(f"wall_s: {time.perf_counter() - start:.1f} s")
    results = []
    for name in names:
        s = summarize(name, tracers[name], args.arrival)
        for k, v in s.items():
            if isinstance(v, float):
                print(f"{name}_{k}: {v:.4g}")
            elif isinstance(v, int):
                print(f"{name}_{k}: {v}")
            else:
                print(f"{name}_{k}: {json.dumps(v, default=float)}")
        keep = ("t0", "t1", "fwd", "tier_s", "prefill_tokens", "decode_rows", "attn", "loads")
        s["step_records"] = [{k: st.get(k) for k in keep} for st in tracers[name].steps]
        s["request_records"] = tracers[name].requests()
        results.append(s)
    if len(results) == 2:
        a, c = results
        for k in (
            "ttft_p50_s",
            "ttft_mean_s",
            "queue_mean_s",
            "queue_decode_only_mean_s",
            "step_wall_s",
            "prefill_tokens",
            "steps_with_forward",
            "decode_rows",
        ):
            print(f"ratio_{k}: {a[k] / max(c[k], 1e-12):.3f} x")
    if out:
        Path(out).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
