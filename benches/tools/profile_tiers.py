"""cProfile of one configuration of ``bench_tiers.py``'s workload (docs/tiers.md, "Profile").

    python benches/tools/profile_tiers.py tiered|pool_only|unbounded [bench_tiers flags]

Prints wall time, TTFT p50, hit rate, forward seconds, the L2 load figures, then the profile
(cumulative) restricted to the engine step, the scheduler, the tier moves and the model's
heaviest torch ops.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benches/
import bench_tiers as b  # noqa: E402


def main() -> None:
    which, args = sys.argv[1], b.parse(sys.argv[2:])
    systems, convs = b.make_workload(args)
    bs = args.block_size
    final = [
        sum(len(t) + args.output for t in turns) + len(systems[c % 3])
        for c, turns in enumerate(convs)
    ]
    working = sum(final) - sum(len(s) for s in systems) * (len(convs) // 3 - 1)
    pool = max(int(working / args.pool_ratio) // bs, 3 * (max(final) // bs + 2)) + 2
    from kvcore import LLM

    block_bytes = LLM(b.MODELS[args.model], num_blocks=4, block_size=bs).engine.runner
    block_bytes = block_bytes.kv_cache_bytes // 4
    ws_bytes = (working // bs + len(convs)) * block_bytes
    kw = {
        "pool_only": {"num_blocks": pool},
        "tiered": {"num_blocks": pool, "host_kv_bytes": ws_bytes},
        "unbounded": {"num_blocks": 4 * (working // bs) + 64},
    }[which]
    print(f"working_set_over_pool: {working / (pool * bs):.2f} x")
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    _, ttft, _, llm = b.serve(args, systems, convs, kw)
    prof.disable()
    print(f"wall_s: {time.perf_counter() - start:.1f} s")
    print(f"ttft_p50_ms: {np.percentile(ttft, 50) * 1e3:.1f} ms")
    print(f"hit_rate: {b.hit_rate(llm):.4f} frac")
    print(f"forward_s: {llm.engine.runner.forward_seconds:.1f} s")
    t = llm.engine.tiers
    if t is not None and t.load_seconds > 0:
        print(f"load_s: {t.load_seconds:.3f} s  ({len(t.load_latency_s)} loads)")
        print(f"load_bytes: {t.bytes_loaded} B")
        print(f"load_gbps: {t.bytes_loaded / t.load_seconds / 1e9:.3f} GB/s")
        t.close()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out).sort_stats("cumulative")
    st.print_stats(
        "engine_step|schedule|tiers/__init__|copy_block_rows|_nn.linear|scaled_dot|index_select"
    )
    print(out.getvalue())


if __name__ == "__main__":
    main()
