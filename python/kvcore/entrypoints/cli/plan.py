"""``kvcore plan`` and ``kvcore eval-kv``: entry points the ``kvcore`` CLI dispatches to.

* ``plan_main(argv)``: the capacity table of a Hugging Face config for a memory budget.
* ``eval_kv_main(argv)``: the quality gate on the embedded SmolLM2 (or any supported model)
  (with ``--retention LIST``, the retention gate instead:
  ``kvcore.entrypoints.cli.eval_retention``):
  ``name: value unit`` lines per format (bytes per token, perplexity and its change, greedy
  agreement, needle retrieval, per-layer attention error), then one summary table.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from kvcore.entrypoints.cli import args as ca
from kvcore.entrypoints.cli import eval_retention as retention_cli
from kvcore.errors import KvCoreError
from kvcore.models.dtype import DTYPE_NAMES
from kvcore.tools.corpus import corpus_ids

DEFAULT_EVAL_FORMATS = "fp8_e4m3,fp8_e5m2,int8,int4,kivi4,kivi2,int2"


def plan_main(argv: list[str] | None = None) -> int:
    """``kvcore plan --config config.json --memory 8GiB [--formats ...] [--context N]``."""
    from kvcore.tools.planner import DEFAULT_FORMATS, format_table, plan_capacity

    p = ca.Parser(
        prog="kvcore plan",
        description="KV capacity of a model config for a memory budget, per storage format: "
        "bytes per token, tokens and concurrent requests the budget holds.",
    )
    p.add_argument("--config", required=True, help="config.json or a checkpoint folder")
    p.add_argument(
        "--memory", required=True, type=ca.memory_size, help="KV budget, e.g. 8GiB, 500MiB, 80GB"
    )
    p.add_argument(
        "--formats", type=ca.name_list, default=list(DEFAULT_FORMATS), help="comma-separated"
    )
    p.add_argument(
        "--context", type=ca.positive_int, default=None, help="tokens per request (default: max)"
    )
    p.add_argument("--block-size", type=ca.positive_int, default=16)
    p.add_argument(
        "--kivi-window", type=ca.int_in(0, 64), default=0, help="KIVI full blocks kept in fp"
    )
    args = p.parse_args(argv)
    with ca.report_errors("kvcore plan") as status:
        geom, rows = plan_capacity(
            args.config,
            args.memory,
            formats=args.formats,
            block_size=args.block_size,
            context_len=args.context,
            kivi_window=args.kivi_window,
        )
        print(format_table(geom, rows, args.memory))
    return status[0]


def _eval_parser() -> argparse.ArgumentParser:
    p = ca.Parser(prog="kvcore eval-kv", description="KV quantization quality gate")
    a = p.add_argument
    pos, names = ca.positive_int, ca.name_list
    a("--formats", type=names, default=DEFAULT_EVAL_FORMATS.split(","),
      help="comma-separated ('auto' is the reference)")  # fmt: skip
    a("--seed", type=ca.non_negative_int, default=0)
    a("--model", default="smollm2-135m")
    a("--dtype", default="auto", choices=DTYPE_NAMES,
      help="model dtype ('auto' is the 'auto' format's KV dtype too; docs/serving.md)")  # fmt: skip
    a("--threads", type=pos, default=None, help="torch threads (1 is fastest on busy CPUs)")
    a("--backend", default="auto", choices=["auto", "torch", "triton"])
    a("--block-size", type=pos, default=16)
    a("--kivi-window", type=ca.int_in(0, 64), default=0, help="KIVI full blocks kept in fp")
    a("--rotate", default=None, choices=["none", "k", "v", "kv"], help="override rotations")
    a("--ppl-seqs", type=pos, default=2, help="text sequences for perplexity")
    a("--ppl-len", type=ca.int_at_least(2), default=1024, help="tokens per perplexity sequence")
    a("--chunk", type=pos, default=None,
      help="prefill chunk (tokens per step per sequence; default 256, retention 128)")  # fmt: skip
    a("--prompts", type=pos, default=50, help="prompts for greedy agreement")
    a("--prompt-len", type=pos, default=32)
    a("--gen", type=pos, default=64, help="greedy tokens per prompt")
    a("--needle-lengths", type=ca.positive_int_list, default=[1024, 2048, 4096],
      help="comma-separated ('' to skip)")  # fmt: skip
    a("--no-layer-errors", action="store_true", help="skip the per-layer attention errors")
    a("--mix", type=names, default=None, help="a per-layer format list, shown as 'mixed'")
    a("--auto-mix", type=ca.float_in(0.0), default=None,
      help="assign a mix within this ppl budget (%%), verified on the perplexity text")  # fmt: skip
    a("--mix-candidates", type=names, default=["int4", "kivi2"],
      help="formats the automatic mix may use")  # fmt: skip
    a("--mix-calib-len", type=ca.int_at_least(2), default=512,
      help="calibration tokens of the automatic mix")  # fmt: skip
    retention_cli.add_arguments(p)
    return p


def eval_kv_main(argv: list[str] | None = None) -> int:
    """``kvcore eval-kv --formats LIST --seed S``: the quality table of quantized caches."""
    args = _eval_parser().parse_args(argv)
    if args.retention is not None:
        with ca.report_errors("kvcore eval-kv") as status:
            retention_cli.run(args)
        return status[0]
    args.chunk = args.chunk or 256
    mix_cands = args.mix_candidates if args.auto_mix is not None else []
    kivi = [f for f in [*args.formats, *(args.mix or []), *mix_cands] if f.startswith("kivi")]
    ca.check(
        not kivi or args.ppl_len > args.chunk + 1,
        "kvcore eval-kv",
        f"--ppl-len {args.ppl_len} must be at least --chunk + 2 ({args.chunk + 2}) for "
        f"{kivi[0] if kivi else 'KIVI'}: in one prefill step no token reads quantized KV (KIVI "
        "keeps the step's newest blocks in full precision), so its perplexity change would read "
        "0; raise --ppl-len or lower --chunk",
    )
    with ca.report_errors("kvcore eval-kv") as status:
        _eval(args)
    return status[0]


def _eval(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from kvcore_kernels.errors import KernelConfigError
    from kvcore_kernels.quant import check_format

    from kvcore.models.loader import load_model
    from kvcore.tools import eval_kv as ev
    from kvcore.tools.mixed_precision import assign_mix
    from kvcore.tools.planner import geometry, layer_bytes_per_token

    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    print(f"model_dtype: {str(model.dtype).removeprefix('torch.')}")
    if tok is None:
        raise KvCoreError("eval-kv needs a model with a tokenizer (real text)")
    names = [f for f in args.formats if f != "auto"]
    num_layers = model.config.num_hidden_layers
    geom = geometry(model.config)
    specs: dict[str, Any] = {"auto": "auto"}
    try:  # every format is checked before any cache is allocated
        for n in names:
            check_format(n, head_dim=geom.head_dim, dtype=model.dtype, block_size=args.block_size)
            specs[n] = n
        if args.mix:
            from kvcore_kernels.quant import resolve_formats

            specs["mixed"] = resolve_formats(args.mix, num_layers)
            for n in set(specs["mixed"]):
                check_format(
                    n, head_dim=geom.head_dim, dtype=model.dtype, block_size=args.block_size
                )
    except KernelConfigError as e:
        raise KvCoreError(str(e)) from e
    rotate = {"none": ""}.get(args.rotate, args.rotate)
    lm = ev.PagedLM(
        model, block_size=args.block_size, backend=args.backend, kivi_window=args.kivi_window,
        rotate=rotate,
    )  # fmt: skip
    ids = corpus_ids(tok)
    rng = random.Random(args.seed)
    ppl_seqs = [
        ids[s : s + args.ppl_len] for s in _starts(rng, len(ids), args.ppl_len, args.ppl_seqs)
    ]
    prompts = [
        ids[s : s + args.prompt_len] for s in _starts(rng, len(ids), args.prompt_len, args.prompts)
    ]
    if args.auto_mix is not None:
        calib = [ppl_seqs[0][: args.mix_calib_len]]
        mix = assign_mix(
            lm, calib, args.mix_candidates, args.auto_mix, chunk=args.chunk,
            verify_seqs=ppl_seqs, verify_chunk=args.chunk, log=print,
        )  # fmt: skip
        specs["mixed"] = mix.formats
    lines: list[tuple[str, float, str]] = []
    fp16 = num_layers * layer_bytes_per_token(geom, "float16", args.block_size)
    table = {}
    for name, spec in specs.items():
        per_layer = [
            layer_bytes_per_token(geom, f, args.block_size) for f in _per_layer(spec, num_layers)
        ]
        table[name] = {"bytes": sum(per_layer), "ratio": sum(per_layer) / fp16}
        lines += [
            (f"bytes_per_token_{name}", sum(per_layer), "B"),
            (f"ratio_vs_fp16_{name}", sum(per_layer) / fp16, "x"),
        ]
    ca.emit_lines(lines)
    phase = time.perf_counter()
    base = None
    for name, spec in specs.items():
        ppl = ev.perplexity(lm, spec, ppl_seqs, args.chunk)
        base = ppl if base is None else base
        table[name].update(ppl=ppl, dppl=100 * (ppl / base - 1))
        dppl = table[name]["dppl"]
        ca.emit_lines([(f"ppl_{name}", ppl, ""), (f"ppl_delta_pct_{name}", dppl, "%")])
    phase = _phase("ppl", phase)
    reference = ev.greedy_reference(lm, prompts, args.gen)
    for name, spec in specs.items():
        agree = 100 * ev.agreement(lm, spec, prompts, reference)
        table[name]["agree"] = agree
        unit = f"% of {len(prompts)}x{args.gen} greedy tokens"
        ca.emit_lines([(f"agreement_{name}", agree, unit)])
    phase = _phase("agreement", phase)
    lengths = args.needle_lengths
    if lengths:
        cases = ev.needle_prompts(tok, ids, lengths, args.seed)
        for name, spec in specs.items():
            ok = ev.needle(lm, tok, spec, cases, max(args.chunk, 512))
            table[name]["needle"] = f"{sum(ok)}/{len(ok)}"
            ca.emit_lines(
                [(f"needle_{name}_{n}", float(o), "pass") for n, o in zip(lengths, ok, strict=True)]
            )
    phase = _phase("needle", phase)
    if not args.no_layer_errors:
        probes = {n: s for n, s in specs.items() if n != "auto"}
        errs = ev.layer_errors(lm, probes, ppl_seqs[0], args.chunk) if probes else {}
        for name, layer_err in errs.items():
            table[name]["err"] = float(np.mean(layer_err))
            ca.emit_lines(
                [(f"attn_rel_err_{name}_layer{i}", float(x), "") for i, x in enumerate(layer_err)]
            )
            ca.emit_lines(
                [
                    (f"attn_rel_err_{name}_mean", float(np.mean(layer_err)), ""),
                    (f"attn_rel_err_{name}_max", float(np.max(layer_err)), ""),
                ]
            )
    _phase("layer_errors", phase)
    ca.emit_lines([("eval_seconds", time.perf_counter() - start, "s")])
    print(_table(table))


def _phase(name: str, since: float) -> float:
    now = time.perf_counter()
    ca.emit_lines([(f"eval_seconds_{name}", now - since, "s")])
    return now


def _per_layer(spec: Any, num_layers: int) -> list[str]:
    return [spec] * num_layers if isinstance(spec, str) else list(spec)


def _starts(rng: random.Random, total: int, length: int, count: int) -> list[int]:
    if length * count > total:
        raise KvCoreError(f"the corpus has {total} tokens: cannot cut {count} x {length}")
    return [rng.randrange(0, total - length) for _ in range(count)]


def _table(rows: dict[str, dict]) -> str:
    cols: tuple[tuple[str, str], ...] = (
        ("format", "<12"),
        ("B/token", ">9"),
        ("vs fp16", ">9"),
        ("ppl", ">9"),
    )
    cols += (("dppl %", ">9"), ("agree %", ">9"), ("needle", ">8"), ("attn err", ">10"))
    out = ["".join(f"{c:{w}}" for c, w in cols)]
    for name, r in rows.items():
        out.append(
            f"{name:<12}{r['bytes']:>9.0f}{r['ratio']:>9.3f}{r.get('ppl', float('nan')):>9.3f}"
            f"{r.get('dppl', float('nan')):>+9.2f}{r.get('agree', float('nan')):>9.2f}"
            f"{r.get('needle', '-'):>8}{r.get('err', 0.0):>10.4f}"
        )
    return "\n".join(out)
