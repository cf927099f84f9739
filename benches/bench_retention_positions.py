"""Original vs re-indexed positions under a lossy policy: perplexity of the same document streamed
with keys kept at their original RoPE positions (what kvcore ships) and re-indexed to their rank
among the kept tokens (StreamingLLM; ``eval_retention.Streamer(reindex=True)``), docs/retention.md.

    python benches/bench_retention_positions.py --doc-lens 8192,12288 --seed 0 \\
        --retention sink:4+window:1020 --dtype bfloat16

Prints ``ppl_<policy>_<positions>_<doc len>: value`` lines and the ratio re-indexed / original.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from kvcore.models.loader import load_model
from kvcore.retention.spec import parse_retention_list
from kvcore.tools.corpus import corpus_ids
from kvcore.tools.eval_kv import PagedLM
from kvcore.tools.eval_retention import stream_perplexity


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--retention", default="sink:4+window:1020")
    p.add_argument("--doc-lens", default="8192,12288")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    lm = PagedLM(model, block_size=16, backend="torch")
    ids = corpus_ids(tok)
    for n in (int(x) for x in args.doc_lens.split(",")):
        offset = random.Random(args.seed).randrange(0, len(ids) - n + 1)
        doc = ids[offset : offset + n]
        print(f"doc_offset_{n}: {offset} tokens", flush=True)
        for policy in parse_retention_list(args.retention):
            ppl = {}
            for mode in ("original", "reindexed"):
                t0 = time.perf_counter()
                ppl[mode], _ = stream_perplexity(lm, policy, doc, args.chunk, mode == "reindexed")
                name = f"{policy.metric_name}_{mode}_{n}"
                print(f"ppl_{name}: {ppl[mode]:.4f}", flush=True)
                print(f"seconds_{name}: {time.perf_counter() - t0:.1f} s", flush=True)
            ratio = ppl["reindexed"] / ppl["original"]
            print(f"ppl_ratio_reindexed_over_original_{policy.metric_name}_{n}: {ratio:.4f} x")


if __name__ == "__main__":
    main()
