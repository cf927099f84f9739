"""``kvcore run``'s driver: the chat workload served turn by turn, with a progress bar.

A follow-up turn is submitted when the answer to the previous one is back (its prompt is the
whole conversation so far, so it hits the prefix cache). The bar counts generated tokens against
the workload's token budget (each turn's ``max_tokens``; an answer that ends early hands its unused
budget over at once), so it moves every step and its ETA is a token rate, not a request rate that
stays at zero while the first answers are being written. Ctrl-C stops the run and keeps what
finished (``ChatRun.interrupted``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvcore.errors import KvCoreError


@dataclass
class ChatRun:
    """What a run of the chat workload produced."""

    outputs: list[Any] = field(default_factory=list)  # finished RequestOutputs, in finish order
    prompts: list[list[int]] = field(default_factory=list)  # their prompt token ids
    wall_s: float = 0.0
    interrupted: bool = False
    total_requests: int = 0


def run_chat(llm: Any, args: Any) -> ChatRun:
    """Serve ``args.conversations`` conversations (``args.max_tokens`` caps each answer,
    ``args.temperature`` and ``args.seed`` sample) on ``llm``; Ctrl-C ends the run early."""
    from tqdm.auto import tqdm

    from kvcore.params import SamplingParams
    from kvcore.tools.workload import chat_workload

    engine, tok = llm.engine, llm.get_tokenizer()
    if tok is None:
        raise KvCoreError("kvcore run needs a model with a tokenizer (the chat workload is text)")
    if not getattr(tok, "chat_template", None):  # base models such as gemma3-270m
        raise KvCoreError(
            "kvcore run needs a tokenizer with a chat template (the workload is chats); "
            "for a base model use kvcore generate"
        )
    convs = chat_workload(args.conversations, seed=args.seed)
    answers: list[list[str]] = [[] for _ in convs]
    owner: dict[str, tuple[int, int]] = {}

    def budget(c: int, turn: int) -> int:
        cap = convs[c].max_tokens[turn]
        return min(cap, args.max_tokens) if args.max_tokens else cap

    def submit(c: int) -> None:
        turn = len(answers[c])
        ids = tok.apply_chat_template(
            convs[c].messages(turn, answers[c]),
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        seed = args.seed if args.temperature > 0 else None
        params = SamplingParams(temperature=args.temperature, max_tokens=budget(c, turn), seed=seed)
        owner[engine.add_request(list(ids), params)] = (c, turn)

    run = ChatRun(total_requests=sum(len(c.turns) for c in convs))
    total_tokens = sum(budget(c, t) for c in range(len(convs)) for t in range(len(convs[c].turns)))
    bar = tqdm(total=total_tokens, desc="kvcore run", unit="tok", dynamic_ncols=True)
    start = time.perf_counter()
    sampled_before, last_draw = engine.stats.sampled_tokens, 0.0
    try:
        for c in range(len(convs)):
            submit(c)
        while engine.has_unfinished_requests():
            finished = [o for o in engine.step() if o.finished]
            advance = engine.stats.sampled_tokens - sampled_before
            sampled_before = engine.stats.sampled_tokens
            for out in finished:
                c, turn = owner.pop(out.request_id)
                run.outputs.append(out)
                run.prompts.append(list(out.prompt_token_ids))
                answers[c].append(out.outputs[0].text)
                advance += budget(c, turn) - len(out.outputs[0].token_ids)  # unused budget
                if turn + 1 < len(convs[c].turns):
                    submit(c)
            bar.update(max(0, min(advance, bar.total - bar.n)))
            now = time.perf_counter()
            if now - last_draw > 0.5:  # the step count moves even while prompts prefill
                bar.set_postfix_str(
                    f"{len(run.outputs)}/{run.total_requests} req, step {engine.stats.num_steps}",
                    refresh=True,
                )
                last_draw = now
    except KeyboardInterrupt:
        run.interrupted = True
    finally:
        bar.close()
    run.wall_s = time.perf_counter() - start
    return run
