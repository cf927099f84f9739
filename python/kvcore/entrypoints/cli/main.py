"""The ``kvcore`` command (``kvcore`` or ``python -m kvcore``).

* ``kvcore run``: the main job. Serves the built-in chat workload (shared system prompt,
  multi-turn follow-ups submitted as answers come back, mixed prompt lengths) on the embedded
  SmolLM2 model with a progress bar counting generated tokens, then prints a report: a table by
  default, ``name: value unit`` lines with ``--format lines``, JSON with ``--json FILE``.
  ``--compare`` replays the same prompts and output lengths through transformers' ``generate``
  in static batches and adds the throughput ratio. Ctrl-C prints the partial report (exit 130).
* ``kvcore generate "prompt"``: one completion, streamed to stdout, sampled with the model's own
  generation defaults (``kvcore.engine.generation_defaults``); ``--temperature 0`` is greedy.
* ``kvcore plan`` / ``kvcore eval-kv``: capacity planner and quality gate of the quantized KV
  formats (``kvcore/entrypoints/cli/plan.py``).

Bad arguments are refused while parsing (one line on stderr, exit 2, see
``kvcore.entrypoints.cli.args``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvcore.engine.args import EngineArgs
from kvcore.entrypoints.cli import args as ca

DESCRIPTION = """\
kvcore: an LLM inference engine with a paged, prefix-shared and optionally quantized KV cache
(Rust core, Triton kernels) that runs Hugging Face models on the CPU or a CUDA GPU."""
EPILOG = """\
examples:
  kvcore run                               the main job: chat workload on SmolLM2-135M, report
  kvcore run --compare                     ... and the same prompts through transformers
  kvcore run --format lines --json r.json  machine-readable report
  kvcore generate "Write a haiku about caches"
  kvcore generate "Why is the sky blue?" --temperature 0 --max-tokens 64
  kvcore plan --config config.json --memory 8GiB
  kvcore eval-kv --formats int8,kivi2

With no command, kvcore runs `kvcore run`. Models: smollm2-135m (default; the first run converts
it once into ~/.cache/kvcore), gemma3-270m (Gemma Terms of Use; converted the same way),
tiny-llama (random weights, no tokenizer), tiny-mistral, tiny-qwen2, tiny-qwen3, tiny-gemma2,
tiny-gemma3 (sliding-window layers, random weights) or a local checkpoint folder. Each command
has its own --help."""


def _make_llm(args: argparse.Namespace, model: Any = None, tokenizer: Any = None, **kw: Any):
    """The ``LLM`` of parsed engine flags (``EngineArgs.add_cli_args``); ``model`` /
    ``tokenizer`` / ``kw`` override them. Prints a hint when another dtype would be faster."""
    from kvcore.entrypoints.llm import LLM
    from kvcore.models.dtype import dtype_hint

    if model is not None:
        kw["model"] = model
    engine_args = EngineArgs.from_cli_args(args, tokenizer=tokenizer, **kw)
    llm = LLM(**vars(engine_args))
    hint = dtype_hint(args.dtype, llm.engine.model.dtype, llm.engine.runner.device)
    if hint:
        print(f"kvcore: {hint}", file=sys.stderr)
    return llm


def compare_model(llm: Any, args: argparse.Namespace) -> Any:
    """The model ``--compare`` runs transformers' ``generate`` on: the engine's own, or an fp32
    copy of the checkpoint where the engine runs half precision on a CPU whose bf16 GEMM is
    slower than fp32 for transformers' modules (an AVX2 CPU without native bf16, where kvcore's
    own forward runs bf16 anyway: the peer at its best, as a transformers user would run it)."""
    import torch

    from kvcore.models.dtype import cpu_runs_bf16
    from kvcore.models.loader import load_model

    model = llm.engine.model
    if model.dtype == torch.float32 or model.device.type != "cpu" or cpu_runs_bf16(False):
        return model
    print("kvcore: --compare runs transformers in float32 (faster than its bf16 on this CPU)",
          file=sys.stderr)  # fmt: skip
    return load_model(args.model, dtype="float32", seed=args.seed)[0]


def cmd_run(args: argparse.Namespace) -> int:
    from kvcore.entrypoints.cli.run_job import run_chat
    from kvcore.tools.report import Row, format_table, rows_json, summarize

    llm = _make_llm(args)
    result = run_chat(llm, args)
    summary = summarize(result.outputs, result.wall_s, llm.engine)
    rows = summary.rows("kvcore")
    if args.compare and not result.interrupted:
        from kvcore.tools.baselines import hf_generate
        from kvcore.tools.report import percentiles

        lens = [max(1, len(o.outputs[0].token_ids)) for o in result.outputs]
        try:
            peer = hf_generate(
                compare_model(llm, args), result.prompts, lens, batch_size=args.compare_batch
            )
        except KeyboardInterrupt:  # keep kvcore's own report
            result.interrupted = True
    if args.compare and not result.interrupted:
        rows += [
            Row(f"{peer.name}_tok_per_s", f"{peer.name} throughput", round(peer.tok_per_s, 1),
                "tok/s"),
            Row(f"{peer.name}_ttft_p50_ms", f"{peer.name} time to first token, p50",
                round(percentiles(peer.ttft_s)[50] * 1e3, 1), "ms"),
            Row(f"ratio_vs_{peer.name}", f"kvcore throughput / {peer.name}",
                round(summary.tok_per_s / peer.tok_per_s, 2), "x"),
        ]  # fmt: skip
    if args.format == "lines":
        print("\n".join(r.line() for r in rows))
    else:
        title = "kvcore run" + (" (interrupted: partial report)" if result.interrupted else "")
        print(format_table(rows, title))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"interrupted": result.interrupted, "figures": rows_json(rows)}, f, indent=1)
    if result.interrupted:
        print(
            f"kvcore run: interrupted after {len(result.outputs)} of {result.total_requests} "
            "requests",
            file=sys.stderr,
        )
        return ca.EXIT_INTERRUPTED
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvcore.config import blocks_for_request, resolve_device
    from kvcore.engine.generation_defaults import default_sampling_params, model_sampling_defaults
    from kvcore.models.loader import load_model

    # Load first to size the KV pool to this one request (not the default pool).
    args.device = str(resolve_device(args.device))
    # the engine below runs kvcore's eager forward (auto dtype: kvcore.models.dtype)
    model, tok = load_model(args.model, device=args.device, seed=args.seed, kvcore_eager=True)
    prompt: Any = args.prompt
    if tok is not None and args.chat and getattr(tok, "chat_template", None):
        msgs = [{"role": "user", "content": args.prompt}]
        prompt = list(
            tok.apply_chat_template(
                msgs, tokenize=True, add_generation_prompt=True, return_dict=False
            )
        )
    model_max = model_sampling_defaults(model).get("max_tokens")
    max_tokens = args.max_tokens or model_max or 128
    extra = {}
    if args.num_blocks is None and args.kv_memory_bytes is None:
        prompt_len = len(prompt) if isinstance(prompt, list) else len(prompt.encode()) + 2
        extra["num_blocks"] = blocks_for_request(prompt_len, max_tokens, args.block_size)
    llm = _make_llm(args, model, tok, **extra)
    params = default_sampling_params(
        model,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=max_tokens,
        seed=args.seed,
    )
    if args.verbose:
        print(f"kvcore generate: {params}", file=sys.stderr)
    stream = llm.engine.stream(prompt, params)
    printed = 0
    try:
        for out in stream:
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print("kvcore generate: interrupted", file=sys.stderr)
        return ca.EXIT_INTERRUPTED
    finally:
        stream.close()  # an abandoned stream aborts its request
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``kvcore`` argument parser (``plan`` and ``eval-kv`` parse their own arguments)."""
    from kvcore import __version__

    parser = ca.Parser(
        prog="kvcore",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvcore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("plan", help="KV capacity per storage format for a config and memory budget")
    sub.add_parser(
        "eval-kv",
        help="quality gate of the quantized KV formats (or, --retention, of retention policies)",
    )
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (kvcore serve --help)")
    sub.add_parser("bench", help="serving benchmark: kvcore bench serve --base-url URL ...")
    run = sub.add_parser(
        "run",
        help="serve the built-in chat workload and print a report (the default command)",
        description="Serve the built-in chat workload (24 conversations sharing a system prompt, "
        "follow-up turns, mixed prompt lengths) and print throughput, latency and cache figures.",
    )
    EngineArgs.add_cli_args(run)
    run.add_argument("--conversations", type=ca.positive_int, default=24)
    run.add_argument("--temperature", type=ca.float_in(0.0), default=0.0)
    run.add_argument(
        "--max-tokens", type=ca.positive_int, default=None, help="cap on each answer's length"
    )
    run.add_argument("--compare", action="store_true", help="also run transformers generate")
    run.add_argument(
        "--compare-batch", type=ca.positive_int, default=8, help="static batch size of --compare"
    )
    run.add_argument(
        "--format", choices=["table", "lines"], default="table",
        help="report as a table or as machine-readable 'name: value unit' lines",
    )  # fmt: skip
    run.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    run.set_defaults(func=cmd_run)
    gen = sub.add_parser(
        "generate",
        help="complete one prompt (streamed)",
        description="Stream one completion. Sampling follows the model's generation_config "
        "(temperature, top-p, top-k, min-p, repetition penalty); flags override it.",
    )
    gen.add_argument("prompt")
    EngineArgs.add_cli_args(gen)
    gen.add_argument(
        "--max-tokens", type=ca.positive_int, default=None, help="default: the model's, else 128"
    )
    gen.add_argument(
        "--temperature", type=ca.float_in(0.0), default=None, help="0 is greedy (default: model's)"
    )
    gen.add_argument("--top-p", type=ca.float_in(0.0, 1.0, low_open=True), default=None)
    gen.add_argument("--top-k", type=ca.int_at_least(-1), default=None, help="-1: off")
    gen.add_argument("--min-p", type=ca.float_in(0.0, 1.0), default=None)
    gen.add_argument("--repetition-penalty", type=ca.float_in(0.0, low_open=True), default=None)
    gen.add_argument("--no-chat", dest="chat", action="store_false", help="raw prompt, no template")
    gen.add_argument("-v", "--verbose", action="store_true", help="print the sampling parameters")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvcore`` console script and of ``python -m kvcore``."""
    # Idle OpenMP threads sleep rather than spin (read when torch loads, below): on cores shared
    # with other work, spinning threads make multi-threaded CPU runs many times slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except SystemExit as e:  # argparse: --help, --version, a bad argument (already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else ca.EXIT_USAGE)


def _main(argv: list[str]) -> int:
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["run", *argv]  # no command: the main job
    if argv[0] in ("plan", "eval-kv"):
        # The quantized-cache commands own their argument parsers (kvcore/entrypoints/cli/plan.py).
        from kvcore.entrypoints.cli import plan as quant_cli

        sub_main = quant_cli.plan_main if argv[0] == "plan" else quant_cli.eval_kv_main
        with ca.report_errors(f"kvcore {argv[0]}") as status:
            status[0] = int(sub_main(argv[1:]))
        return status[0]
    if argv[:1] == ["serve"] or argv[:2] == ["bench", "serve"]:
        # The server and its load generator own their parsers (kvcore/entrypoints/cli/serve.py).
        from kvcore.entrypoints.cli import serve as entry_cli

        name = "serve" if argv[0] == "serve" else "bench serve"
        with ca.report_errors(f"kvcore {name}") as status:
            if argv[0] == "serve":
                status[0] = int(entry_cli.serve_main(argv[1:]))
            else:
                status[0] = int(entry_cli.bench_main(argv[2:]))
        return status[0]
    args = build_parser().parse_args(argv)
    if getattr(args, "func", None) is None:  # kvcore bench: its one benchmark is named
        ca.fail(f"kvcore {args.command}", "give a benchmark: kvcore bench serve --base-url URL")
    with ca.report_errors(f"kvcore {args.command}") as status:
        status[0] = int(args.func(args))
    return status[0]
