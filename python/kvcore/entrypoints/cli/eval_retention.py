"""``kvcore eval-kv --retention LIST``: the quality table of retention policies (docs/retention.md).

Per policy, ``name: value unit`` lines (``<p>`` is the policy's ``metric_name``):
``ppl_<p>``, ``ppl_delta_pct_<p>`` (against ``full``), ``needle_acc_<p>`` (share of the
needle sweep retrieved), ``needle_<p>_<context>_<depth>`` (each case) and
``peak_blocks_per_seq_<p>``; then one summary table.
"""

from __future__ import annotations

import argparse
import random
import time

from kvcore.entrypoints.cli import args as ca
from kvcore.errors import KvCoreError
from kvcore.retention.spec import RetentionError, parse_retention_list

DEFAULT_CHUNK = 128  # tokens per step: a policy sees each chunk whole, then thins (as prefill)


def retention_list(text: str):
    """An argparse type: a ``,``-separated retention policy list."""
    try:
        return parse_retention_list(text)
    except RetentionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The retention gate's options of ``kvcore eval-kv``."""
    a = p.add_argument
    a(
        "--retention",
        type=retention_list,
        default=None,
        help="run the retention gate on these policies instead of the formats, e.g. "
        "full,sink:4+window:1020,window:1024,h2o:budget=1024 ('full' is added first when "
        "perplexity is measured)",
    )
    a(
        "--doc-len",
        type=ca.non_negative_int,
        default=8192,
        help="retention: tokens of the perplexity document (0: skip perplexity)",
    )
    a(
        "--needle-contexts",
        type=ca.positive_int_list,
        default=[2048, 4096, 8192],
        help="retention: needle context lengths ('' to skip)",
    )
    a("--needle-depths", type=ca.positive_int_list, default=[10, 50, 90],
      help="retention: needle depths in percent")  # fmt: skip
    a("--needle-format", choices=["passkey", "prose"], default="passkey",
      help="retention: haystack of the needle (docs/retention.md)")  # fmt: skip
    a("--positions", choices=["original", "reindexed"], default="original",
      help="retention: keys keep their positions (what kvcore ships) or are re-indexed to their "
      "rank among the kept tokens (StreamingLLM; eval only)")  # fmt: skip


def run(args: argparse.Namespace) -> None:
    """The retention gate (``args`` from ``kvcore eval-kv``'s parser)."""
    import torch

    from kvcore.models.loader import load_model
    from kvcore.tools import eval_retention as er
    from kvcore.tools.corpus import corpus_ids
    from kvcore.tools.eval_kv import PagedLM

    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = list(args.retention)
    if args.doc_len and all(p.kind != "full" for p in policies):  # the ppl reference
        policies.insert(0, parse_retention_list("full")[0])
    for p in policies:  # sizes that cannot work at this block size: refused before loading
        p.blocks(args.block_size)
    if any(not 0 < d < 100 for d in args.needle_depths):
        raise KvCoreError("--needle-depths are percentages strictly between 0 and 100")
    chunk = args.chunk or DEFAULT_CHUNK
    model, tok = load_model(args.model, dtype=args.dtype)
    if tok is None:  # the random test model: bytes as tokens (its numbers mean nothing)
        if model.config.vocab_size < 259:
            raise KvCoreError("eval-kv needs a model with a tokenizer (real text)")
        tok = er.ByteTokenizer()
    lm = PagedLM(model, block_size=args.block_size, backend=args.backend)
    ids = corpus_ids(tok)
    if args.doc_len > len(ids):
        raise KvCoreError(f"--doc-len {args.doc_len}: the corpus has {len(ids)} tokens")
    if args.doc_len == 1:
        raise KvCoreError("--doc-len must be 0 (skip perplexity) or at least 2 tokens")
    offset = random.Random(args.seed).randrange(0, len(ids) - args.doc_len + 1)
    doc = ids[offset : offset + args.doc_len]
    reindex = args.positions == "reindexed"
    if reindex:
        er.check_reindex(model)
    print(f"positions: {args.positions}")
    ca.emit_lines([("doc_tokens", len(doc), "tokens"), ("doc_offset", offset, "tokens"),
           ("chunk", chunk, "tokens")])  # fmt: skip
    cases = []
    if args.needle_contexts:
        cases = er.needle_cases(
            tok, ids, args.needle_contexts, args.needle_depths, args.seed, args.needle_format
        )
    rows: dict[str, dict] = {}
    base = None
    for p in policies:
        name, t0 = p.metric_name, time.perf_counter()
        row = rows[name] = {"ppl": float("nan"), "dppl": float("nan"), "peak": 0}
        if doc:
            ppl, peak = er.stream_perplexity(lm, p, doc, chunk, reindex)
            base = ppl if p.kind == "full" and base is None else base
            row.update(ppl=ppl, peak=peak, dppl=100 * (ppl / base - 1))
            ca.emit_lines([(f"ppl_{name}", ppl, ""), (f"ppl_delta_pct_{name}", row["dppl"], "%"),
                   (f"peak_blocks_per_seq_{name}", peak, "blocks")])  # fmt: skip
        if cases:
            ok = er.needle(lm, tok, p, cases, chunk, reindex=reindex)
            row["needle"] = sum(ok) / len(ok)
            ca.emit_lines([(f"needle_{name}_{c.length}_{c.depth}", float(o), "pass")
                   for c, o in zip(cases, ok, strict=True)])  # fmt: skip
            ca.emit_lines([(f"needle_acc_{name}", row["needle"], f"of {len(ok)}")])
        ca.emit_lines([(f"eval_seconds_{name}", time.perf_counter() - t0, "s")])
    ca.emit_lines([("eval_seconds", time.perf_counter() - start, "s")])
    print(table(rows, args.block_size))


def table(rows: dict[str, dict], block_size: int) -> str:
    """The summary: one line per policy."""
    out = [f"{'policy':<28}{'ppl':>9}{'dppl %':>9}{'needle':>8}{'peak blocks':>13}{'tokens':>8}"]
    for name, r in rows.items():
        needle = f"{r['needle']:.2f}" if "needle" in r else "-"
        out.append(f"{name:<28}{r['ppl']:>9.3f}{r['dppl']:>+9.2f}{needle:>8}{r['peak']:>13}"
                   f"{r['peak'] * block_size:>8}")  # fmt: skip
    return "\n".join(out)
