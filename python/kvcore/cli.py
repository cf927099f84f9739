"""The ``kvcore`` command.

* ``kvcore run``: the main job. Serves the built-in chat workload (shared system prompt,
  multi-turn follow-ups submitted as answers come back, mixed prompt lengths) on the embedded
  SmolLM2 model, with a progress bar, then prints a report (``name: value unit`` lines).
  ``--compare`` replays the same prompts and output lengths through transformers' ``generate``
  in static batches and prints the throughput ratio.
* ``kvcore generate "prompt"``: one completion, streamed to stdout.
* ``kvcore plan`` / ``kvcore eval-kv``: capacity planner and quality gate of the quantized KV
  formats (``kvcore/quant_cli.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from kvcore.errors import KvCoreError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m | tiny-llama | a path")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    p.add_argument("--kv-memory-mb", type=int, default=None, help="KV budget in MiB")
    p.add_argument(
        "--kv-format",
        default="auto",
        help="KV storage: auto | float16 | bfloat16 | fp8_e4m3 | int8 | int4 | kivi2 | ... "
        "(a comma-separated list: one per layer)",
    )
    p.add_argument("--prefix-caching", default="radix", choices=["radix", "hash", "off"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--no-chunked-prefill",
        dest="chunked_prefill",
        action="store_false",
        help="compute each prompt in one step (needs a budget of --max-model-len tokens)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    # KV tiers (docs/tiers.md)
    p.add_argument("--host-kv-mb", type=int, default=0, help="L2 host-memory KV tier, MiB")
    p.add_argument("--disk-path", default=None, help="L3 disk tier directory")
    p.add_argument("--disk-mb", type=int, default=1024, help="L3 byte cap, MiB")
    p.add_argument("--remote-url", default=None, help="L4 shared store, redis://host:port/db")
    p.add_argument("--preemption", default="auto", choices=["auto", "recompute", "swap"])


def _make_llm(args: argparse.Namespace) -> Any:
    import torch

    from kvcore.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLM(
        args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_memory_bytes=args.kv_memory_mb << 20 if args.kv_memory_mb else None,
        kv_format=args.kv_format.split(",") if "," in args.kv_format else args.kv_format,
        prefix_caching=args.prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.chunked_prefill,
        max_model_len=args.max_model_len,
        device=args.device,
        seed=args.seed,
        host_kv_bytes=args.host_kv_mb << 20,
        disk_path=args.disk_path,
        disk_bytes=args.disk_mb << 20,
        remote_url=args.remote_url,
        preemption=args.preemption,
    )


def _run_chat(llm: Any, args: argparse.Namespace) -> tuple[list[Any], list[list[int]], float]:
    """Drive the chat workload: a follow-up turn is submitted when its previous answer is back."""
    from tqdm.auto import tqdm

    from kvcore.outputs import SamplingParams
    from kvcore.workload import chat_workload

    engine, tok = llm.engine, llm.get_tokenizer()
    if tok is None:
        raise KvCoreError("kvcore run needs a model with a tokenizer (the chat workload is text)")
    convs = chat_workload(args.conversations, seed=args.seed)
    answers: list[list[str]] = [[] for _ in convs]
    owner: dict[str, tuple[int, int]] = {}

    def submit(c: int) -> None:
        turn = len(answers[c])
        msgs = convs[c].messages(turn, answers[c])
        ids = tok.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        max_tokens = convs[c].max_tokens[turn]
        if args.max_tokens:
            max_tokens = min(max_tokens, args.max_tokens)
        seed = args.seed if args.temperature > 0 else None
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, seed=seed)
        owner[engine.add_request(list(ids), params)] = (c, turn)

    total = sum(len(c.turns) for c in convs)
    outputs, prompts = [], []
    bar = tqdm(total=total, desc="kvcore run", unit="req", dynamic_ncols=True)
    start, num_tokens = time.perf_counter(), 0
    for c in range(len(convs)):
        submit(c)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            c, turn = owner.pop(out.request_id)
            outputs.append(out)
            prompts.append(out.prompt_token_ids)
            answers[c].append(out.outputs[0].text)
            num_tokens += len(out.outputs[0].token_ids)
            if turn + 1 < len(convs[c].turns):
                submit(c)
            bar.set_postfix_str(
                f"{num_tokens / (time.perf_counter() - start):.1f} tok/s", refresh=False
            )
            bar.update(1)
    bar.close()
    return outputs, prompts, time.perf_counter() - start


def cmd_run(args: argparse.Namespace) -> int:
    from kvcore.report import summarize

    llm = _make_llm(args)
    outputs, prompts, wall = _run_chat(llm, args)
    summary = summarize(outputs, wall, llm.engine)
    print("\n".join(summary.lines("kvcore")))
    if args.compare:
        from kvcore.baselines import hf_generate

        lens = [max(1, len(o.outputs[0].token_ids)) for o in outputs]
        peer = hf_generate(llm.engine.model, prompts, lens, batch_size=args.compare_batch)
        from kvcore.report import percentiles

        print(f"{peer.name}_tok_per_s: {peer.tok_per_s:.1f} tok/s")
        print(f"{peer.name}_ttft_p50_ms: {percentiles(peer.ttft_s)[50] * 1e3:.1f} ms")
        print(f"ratio_vs_{peer.name}: {summary.tok_per_s / peer.tok_per_s:.2f} x")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvcore.outputs import SamplingParams

    llm = _make_llm(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed if args.temperature > 0 else None,
    )
    tok = llm.get_tokenizer()
    prompt: Any = args.prompt
    if tok is not None and args.chat and getattr(tok, "chat_template", None):
        msgs = [{"role": "user", "content": args.prompt}]
        prompt = list(
            tok.apply_chat_template(
                msgs, tokenize=True, add_generation_prompt=True, return_dict=False
            )
        )
    printed = 0
    for out in llm.engine.stream(prompt, params):
        text = out.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvcore`` console script."""
    # Idle OpenMP threads sleep rather than spin (read when torch loads, below): on cores shared
    # with other work, spinning threads make multi-threaded CPU runs many times slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("plan", "eval-kv"):
        # The quantized-cache commands own their argument parsers (kvcore/quant_cli.py).
        from kvcore import quant_cli

        sub_main = quant_cli.plan_main if argv[0] == "plan" else quant_cli.eval_kv_main
        try:
            return int(sub_main(argv[1:]))
        except KvCoreError as e:
            print(f"kvcore: error: {e}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="kvcore", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("plan", help="KV capacity per storage format for a config and memory budget")
    sub.add_parser("eval-kv", help="quality gate of the quantized KV formats on SmolLM2")
    run = sub.add_parser("run", help="serve the built-in chat workload and print a report")
    _engine_args(run)
    run.add_argument("--conversations", type=int, default=24)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--max-tokens", type=int, default=None, help="cap on each answer's length")
    run.add_argument("--compare", action="store_true", help="also run transformers generate")
    run.add_argument("--compare-batch", type=int, default=8, help="static batch size of --compare")
    run.set_defaults(func=cmd_run)
    gen = sub.add_parser("generate", help="complete one prompt (streamed)")
    gen.add_argument("prompt")
    _engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--no-chat", dest="chat", action="store_false", help="raw prompt, no template")
    gen.set_defaults(func=cmd_generate)
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run", *(argv or [])])
    try:
        return int(args.func(args))
    except KvCoreError as e:
        print(f"kvcore: error: {e}", file=sys.stderr)
        return 2
