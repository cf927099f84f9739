"""OpenAI response bodies: whole completions and server-sent-event chunks.

Choice ``index`` is ``prompt_index * n + sample_index`` (OpenAI's order for several prompts).
While a sample with stop strings runs, the last ``max(len(stop)) - 1`` characters are held back:
the detokenizer may still cut them when a stop string completes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from kvcore.entrypoints.openai.protocol import ApiError
from kvcore.entrypoints.openai.serving import Job, ServerState, observe_overhead
from kvcore.outputs import CompletionOutput, RequestOutput

_DONE = b"data: [DONE]\n\n"


def _token_text(state: ServerState, token_id: int) -> str:
    if state.tokenizer is None:
        return f"token_id:{token_id}"
    return state.tokenizer.decode([token_id])


def _logprobs(state: ServerState, job: Job, c: CompletionOutput, start: int, offset: int) -> Any:
    """Logprobs of c's tokens from ``start`` on, in the endpoint's format (None if not asked)."""
    if c.logprobs is None:
        return None
    ids, lps = c.token_ids[start:], c.logprobs[start:]
    tops = (c.top_logprobs or [])[start:] if c.top_logprobs is not None else [{}] * len(ids)
    toks = [_token_text(state, t) for t in ids]
    if job.kind == "chat":
        content = []
        for tok, lp, top in zip(toks, lps, tops, strict=False):
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
            entry["top_logprobs"] = [
                {"token": (s := _token_text(state, t)), "logprob": v, "bytes": list(s.encode())}
                for t, v in top.items()
            ]
            content.append(entry)
        return {"content": content}
    offsets, pos = [], offset
    for tok in toks:
        offsets.append(pos)
        pos += len(tok)
    top_lists = [{_token_text(state, t): v for t, v in top.items()} for top in tops]
    return {
        "tokens": toks,
        "token_logprobs": lps,
        "top_logprobs": top_lists if c.top_logprobs is not None else None,
        "text_offset": offsets,
    }


def _usage(job: Job) -> dict[str, Any]:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(c.token_ids) for o in job.finals.values() for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in job.finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _head(job: Job, chunk: bool) -> dict[str, Any]:
    obj = "text_completion" if job.kind == "completion" else "chat.completion"
    if chunk and job.kind == "chat":
        obj += ".chunk"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.req.model}


def _hold_back(job: Job, i: int) -> int:
    stop = job.params[i].stop or []
    return max((len(s) for s in stop), default=1) - 1


async def collect(state: ServerState, job: Job, outputs: AsyncIterator[tuple[int, Any]]) -> dict:
    """Wait for every prompt to finish; the whole response body."""
    async for _ in outputs:
        pass
    n = job.req.n
    choices = []
    for i in sorted(job.finals):
        out: RequestOutput = job.finals[i]
        for c in out.outputs:
            choice: dict[str, Any] = {"index": i * n + c.index}
            lp = _logprobs(state, job, c, 0, 0)
            if job.kind == "chat":
                choice["message"] = {"role": "assistant", "content": c.text, "refusal": None}
            else:
                choice["text"] = c.text
            choice["logprobs"] = lp
            choice["finish_reason"] = c.finish_reason
            if job.req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choices.append(choice)
    body = _head(job, chunk=False)
    body.update(choices=choices, usage=_usage(job), system_fingerprint=None)
    observe_overhead(state, job)
    return body


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse(state: ServerState, job: Job, outputs: AsyncIterator[tuple[int, Any]]):
    """Server-sent events: one chunk per grown sample per step, then usage, then [DONE]."""
    n, chat = job.req.n, job.kind == "chat"
    opts = job.req.stream_options
    include_usage = bool(opts and opts.include_usage)
    sent_text: dict[int, int] = {}
    sent_tok: dict[int, int] = {}
    done: set[int] = set()
    head = _head(job, chunk=True)
    try:
        if chat:  # the role comes first, as OpenAI sends it
            for k in range(len(job.prompts) * n):
                delta = {"role": "assistant", "content": ""}
                chunk = dict(head, choices=[_choice(k, delta, None, None, chat)])
                yield _event(_with_usage(chunk, include_usage))
        async for i, out in outputs:
            if (
                state.shutdown_cut
                and out.finished
                and any(c.finish_reason == "abort" for c in out.outputs)
            ):
                raise ApiError(
                    503, "The server shut down before this stream finished.", type="server_error"
                )
            hold = _hold_back(job, i)
            for c in out.outputs:
                k = i * n + c.index
                if k in done:
                    continue
                finished = c.finish_reason is not None
                t0, s0 = sent_tok.get(k, 0), sent_text.get(k, 0)
                end = len(c.text) if finished else max(s0, len(c.text) - hold)
                if len(c.token_ids) == t0 and end == s0 and not finished:
                    continue
                piece = c.text[s0:end]
                lp = _logprobs(state, job, c, t0, s0)
                choice = _choice(
                    k, {"content": piece} if chat else piece, lp, c.finish_reason, chat
                )
                if job.req.return_token_ids:
                    choice["token_ids"] = c.token_ids[t0:]
                sent_tok[k], sent_text[k] = len(c.token_ids), end
                if finished:
                    done.add(k)
                yield _event(_with_usage(dict(head, choices=[choice]), include_usage))
        if include_usage:
            yield _event(dict(head, choices=[], usage=_usage(job)))
        yield _DONE
        observe_overhead(state, job)
    except Exception as e:  # noqa: BLE001 - the status is already sent: report in-band
        err = e if isinstance(e, ApiError) else ApiError(500, str(e), type="server_error")
        yield _event(err.body())
        yield _DONE
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]


def _choice(k: int, delta: Any, lp: Any, reason: str | None, chat: bool) -> dict[str, Any]:
    if chat:
        return {"index": k, "delta": delta, "logprobs": lp, "finish_reason": reason}
    return {"index": k, "text": delta, "logprobs": lp, "finish_reason": reason}


def _with_usage(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    if include_usage:
        chunk["usage"] = None
    return chunk
