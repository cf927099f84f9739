"""Score a ``serve_vs_vllm_cpu.sh`` summary: kvcore over vLLM per dataset, rate and seed.

    python benches/tools/score_vs_vllm.py OUT/summary.tsv [--label kvcore]

Per (dataset, rate): output tok/s ratio, p95 TTFT ratio (kvcore / vLLM: below 1 is better) and
goodput ratio (requests/s meeting the sweep's SLO), each as the worst and best over seeds, then
vLLM's knee (the highest rate whose goodput is >= 90 % of what it was offered, on every seed)
and the worst p95 TTFT ratio at every rate up to it. Lines ``name: value`` at the end.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict


def _rate(r: str) -> float:
    return math.inf if r == "inf" else float(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary")
    ap.add_argument("--label", default="kvcore")
    ap.add_argument("--peer", default="vllm-cpu")
    args = ap.parse_args()
    rows: dict[tuple[str, str, str, str], dict[str, str]] = {}
    with open(args.summary) as f:
        for r in csv.DictReader(f, delimiter="\t"):
            if r.get("out_tok_s") in (None, "failed-run"):
                continue
            rows[(r["label"], r["dataset"], r["rate"], r["seed"])] = r
    cases: dict[tuple[str, str], list[tuple[float, float, float]]] = defaultdict(list)
    knee_ok: dict[tuple[str, str], bool] = {}
    for (label, ds, rate, seed), k in rows.items():
        if label != args.label or (args.peer, ds, rate, seed) not in rows:
            continue
        v = rows[(args.peer, ds, rate, seed)]
        tok = float(k["out_tok_s"]) / float(v["out_tok_s"])
        ttft = float(k["ttft_p95_ms"]) / float(v["ttft_p95_ms"])
        kg, vg = float(k["goodput_req_s"]), float(v["goodput_req_s"])
        good = kg / vg if vg > 0 else (math.inf if kg > 0 else math.nan)
        cases[(ds, rate)].append((tok, ttft, good))
        offered = _rate(rate)
        ok = math.isfinite(offered) and vg >= 0.9 * offered
        knee_ok[(ds, rate)] = knee_ok.get((ds, rate), True) and ok
    print("dataset rate seeds | tok/s ratio worst-best | p95 TTFT ratio worst-best | goodput ratio")
    worst_sat = {}
    for (ds, rate), v in sorted(cases.items(), key=lambda c: (c[0][0], _rate(c[0][1]))):
        tok = [x[0] for x in v]
        ttft = [x[1] for x in v]
        good = [x[2] for x in v if not math.isnan(x[2])]
        gtxt = f"{min(good):.2f}-{max(good):.2f}" if good else "n/a (0 / 0)"
        print(
            f"{ds} {rate} {len(v)} | {min(tok):.2f}-{max(tok):.2f} | "
            f"{max(ttft):.2f}-{min(ttft):.2f} | {gtxt}"
        )
        if rate == "inf":
            worst_sat[ds] = min(tok)
    for ds in sorted({d for d, _ in cases}):
        rates = sorted((r for d, r in cases if d == ds), key=_rate)
        knee = None
        for r in rates:
            if knee_ok.get((ds, r)):
                knee = r
        upto = [r for r in rates if knee is not None and _rate(r) <= _rate(knee)]
        worst_ttft = max((x[1] for r in upto for x in cases[(ds, r)]), default=math.nan)
        print(f"{ds}_peer_knee_req_s: {knee}")
        print(f"{ds}_worst_p95_ttft_ratio_up_to_knee: {worst_ttft:.2f}")
        if ds in worst_sat:
            print(f"{ds}_worst_saturation_ratio: {worst_sat[ds]:.2f}")


if __name__ == "__main__":
    main()
