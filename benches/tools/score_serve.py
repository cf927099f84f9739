"""Score saved `kvcore bench serve` runs (--save-json) of kvcore against a peer, per seed.

For each seed with both files (``DIR/KVCORE-seedS.json`` and ``DIR/PEER-seedS.json``; labels
``--kvcore`` and ``--peer``, e.g. ``kvcore-bf16`` against ``transformers-serve-bf16``, the runs of
``serve_vs_transformers.sh``) it re-evaluates goodput at the given SLO from the per-request
records and prints one line: the peak goodput ratio (kvcore's best rate against the peer's best
rate), the peer's knee (the highest rate at which >= 90 % of the requests met the SLO), the p95
TTFT ratio at that rate, and kvcore's server overhead there; then whether the serving targets of
issue 11 (goodput >= 2x, TTFT >= 3x lower, overhead < 5 %) hold for every seed. When the peer
meets the SLO at none of the rates it has no knee ("peer knee nan"): the TTFT ratio is then
taken at the lowest rate; when it meets it at every rate the knee is the highest rate run
(RATES="0.5 2": 2 req/s). Usage:

    python benches/tools/score_serve.py DIR [--prefix quiet-] [--kvcore kvcore] \
        [--peer transformers-serve] [--slo-ttft-ms 1000 --slo-itl-ms 300]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from kvcore.tools.bench_data import knee, regoodput  # noqa: E402


def _load(path: str, ttft_ms: float, itl_ms: float) -> dict[float, dict]:
    with open(path) as f:
        results = json.load(f)["results"]
    for r in results:
        if "records" not in r:
            raise SystemExit(f"{path}: saved without per-request records (cannot re-score)")
        r["goodput_req_per_s"] = regoodput(r, ttft_ms, itl_ms)
    return {r["request_rate"]: r for r in results}


def score(kv: dict[float, dict], peer: dict[float, dict]) -> dict[str, float]:
    """The three target figures of one seed (nan where undefined)."""
    best_kv = max(r["goodput_req_per_s"] for r in kv.values())
    best_peer = max(r["goodput_req_per_s"] for r in peer.values())
    k = knee(list(peer.values()))
    rate = k if k is not None and k in kv else min(peer)  # no knee: the lowest rate
    ttft = peer[rate]["ttft_p95_ms"] / kv[rate]["ttft_p95_ms"]
    return {
        "goodput_kvcore": best_kv,
        "goodput_peer": best_peer,
        "goodput_ratio": best_kv / best_peer if best_peer > 0 else float("inf"),
        "peer_knee": float("nan") if k is None else k,
        "ttft_rate": rate,
        "ttft_ratio": ttft,
        "overhead_pct": kv[rate].get("server_overhead_pct_of_e2e", float("nan")),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--prefix", default="", help="file name prefix, e.g. quiet-")
    p.add_argument("--kvcore", default="kvcore", help="kvcore's label, e.g. kvcore-bf16")
    p.add_argument("--peer", default="transformers-serve", help="e.g. transformers-serve-bf16")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=300.0)
    args = p.parse_args(argv)
    slo = (args.slo_ttft_ms, args.slo_itl_ms)
    seeds = []
    mine = f"{args.prefix}{args.kvcore}-seed"
    for path in sorted(glob.glob(os.path.join(args.dir, f"{glob.escape(mine)}*.json"))):
        m = re.fullmatch(re.escape(mine) + r"(\d+)\.json", os.path.basename(path))
        other = (
            os.path.join(args.dir, f"{args.prefix}{args.peer}-seed{m.group(1)}.json") if m else ""
        )
        if m and os.path.exists(other):
            seeds.append((int(m.group(1)), path, other))
    if not seeds:
        print(f"no {mine}S.json with a {args.peer} partner in {args.dir}")
        return 2
    print(f"# {args.kvcore} vs {args.peer}; SLO: TTFT <= {slo[0]:g} ms, TPOT <= {slo[1]:g} ms")
    met = []
    for seed, kv_path, peer_path in seeds:
        s = score(_load(kv_path, *slo), _load(peer_path, *slo))
        ok = s["goodput_ratio"] >= 2 and s["ttft_ratio"] >= 3 and s["overhead_pct"] < 5
        met.append(ok)
        print(
            f"seed {seed}: goodput_ratio: {s['goodput_ratio']:.2f} x "
            f"({s['goodput_kvcore']:.3f} vs {s['goodput_peer']:.3f} req/s), "
            f"ttft_p95_ratio: {s['ttft_ratio']:.2f} x at {s['ttft_rate']:g} req/s "
            f"(peer knee {s['peer_knee']:g}), server_overhead: {s['overhead_pct']:.2f} %, "
            f"targets {'met' if ok else 'NOT met'}"
        )
    print(f"targets_met_seeds: {sum(met)} of {len(met)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
