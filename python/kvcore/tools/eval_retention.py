"""The quality gate of retention policies: a real model whose KV a policy thins as text streams in.

``Streamer`` feeds equal-length sequences to ``eval_kv.PagedLM`` ``chunk`` tokens per step; after
every step the policy (``retention.blocks_to_release``) releases logical blocks, which become
null block-table entries that the next steps' attention skips (block-granular, exactly as the
engine does). H2O ranks blocks by the attention mass the kernels return (``block_mass``, summed
over layers, heads and query rows, accumulated over steps). Positions stay the original ones
(RoPE applied at store time): see docs/retention.md for why.

Measurements per policy (``full`` is the reference):

* ``perplexity``: NLL of ``doc_len`` tokens of real English text (``pydoc_data.topics``, shipped
  with Python under the PSF licence), the seed choosing the offset;
* ``needle``: a pass key hidden at each depth of each context length, asked for at the end;
* ``peak blocks``: the most blocks a sequence held during any step (kept + the step's own).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np
import torch

from kvcore.errors import InvalidArgumentError
from kvcore.retention.spec import RetentionPolicy, blocks_to_release
from kvcore.tools.eval_kv import PagedLM


class Streamer:
    """Equal-length sequences fed in steps, thinned by ``policy`` after every step.

    ``reindex``: StreamingLLM's positions (a kept key sits at its rank among the kept tokens):
    after every release each kept block's keys are rotated forward by the tokens released after
    it (RoPE rotations compose), so every query-key distance counts kept tokens only; queries
    keep their original positions (only distances enter RoPE attention)."""

    def __init__(self, lm: PagedLM, policy: RetentionPolicy, num_seqs: int, max_len: int,
                 chunk: int, reindex: bool = False):  # fmt: skip
        self.lm, self.policy, self.chunk = lm, policy, chunk
        self.rope = _rope_inv_freq(lm.model) if reindex else None
        self.caches = lm.caches("auto", num_seqs, max_len, chunk)
        per_seq = (self.caches[0].shape[0] - 1) // num_seqs
        self.released = np.zeros((num_seqs, per_seq), dtype=bool)
        self.mass = np.zeros((num_seqs, per_seq))
        self.shift = np.zeros((num_seqs, per_seq), dtype=np.int64)  # tokens each block moved
        self.pristine: dict[int, torch.Tensor] = {}  # block id -> its keys before any move
        self.num_tokens = 0
        self.peak_blocks = 0

    def feed(self, tokens: list[list[int]], *, last_only: bool = False) -> torch.Tensor:
        """One step: every sequence gets its ``tokens[r]`` (equal lengths); returns logits."""
        n = len(tokens[0])
        end = self.num_tokens + n
        bs = self.lm.block_size
        nblk = -(-end // bs)
        held = (~self.released[:, :nblk]).sum(1)
        self.peak_blocks = max(self.peak_blocks, int(held.max()))
        mass = None
        if self.policy.kind == "h2o":
            mass = torch.zeros(self.released.shape, dtype=torch.float32, device=self.lm.device)
        starts = [self.num_tokens] * len(tokens)
        logits = self.lm.step(self.caches, starts, tokens, last_only=last_only,
                              released=self.released, block_mass=mass)  # fmt: skip
        self.num_tokens = end
        if mass is not None:
            self.mass += mass.cpu().double().numpy()
        for r in range(len(tokens)):
            live = ~self.released[r, :nblk]
            drop = blocks_to_release(self.policy, end, bs, live, self.mass[r, :nblk])
            self.released[r, drop] = True
        if self.rope is not None:
            self._reindex(nblk)
        return logits

    def _reindex(self, nblk: int) -> None:
        """Rotate kept keys forward by the tokens released after their block. Each moved block's
        keys are rotated from a pristine copy by its whole shift: one rounding, not one per step."""
        bs, per_seq = self.lm.block_size, self.released.shape[1]
        rel = self.released[:, :nblk]
        after = bs * (np.cumsum(rel[:, ::-1], axis=1)[:, ::-1] - rel)  # released blocks after b
        want = np.where(rel, self.shift[:, :nblk], after)
        moved = want != self.shift[:, :nblk]
        self.shift[:, :nblk] = want
        for d in np.unique(want[moved]).tolist():
            r, b = np.nonzero(moved & (want == d))
            ids = (1 + r * per_seq + b).tolist()
            for i in ids:  # keys as stored at the original positions, every layer
                if i not in self.pristine:
                    self.pristine[i] = torch.stack([c[i, 0].float() for c in self.caches])
            k = torch.stack([self.pristine[i] for i in ids], dim=1)  # [layers, n, bs, h, d]
            angle = (d * self.rope).to(self.lm.device)
            cos, sin = (torch.cat([f(angle), f(angle)]).float() for f in (torch.cos, torch.sin))
            half = k.shape[-1] // 2
            turned = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
            out = k * cos + turned * sin
            idx = torch.tensor(ids, device=self.lm.device)
            for layer, cache in enumerate(self.caches):
                cache[idx, 0] = out[layer].to(cache.dtype)


def check_reindex(model) -> None:
    """Refuse (``InvalidArgumentError``) a model whose keys cannot be re-indexed."""
    _rope_inv_freq(model)


def _rope_inv_freq(model) -> torch.Tensor:
    """The model's RoPE frequencies (``rotate_half`` layout), for re-indexing kept keys; a
    model whose keys are not rotated that way (scaled RoPE, per-layer RoPE) is refused."""
    found = [m for n, m in model.named_modules() if n.endswith("rotary_emb")]
    if len(found) != 1 or getattr(found[0], "attention_scaling", 1.0) != 1.0:
        raise InvalidArgumentError("re-indexed positions need one unscaled RoPE in the model")
    if getattr(found[0], "rope_type", "default") != "default":
        raise InvalidArgumentError("re-indexed positions need the default RoPE")
    return found[0].inv_freq.detach().double().cpu()


def stream_perplexity(lm: PagedLM, policy: RetentionPolicy, seq: list[int], chunk: int,
                      reindex: bool = False):  # fmt: skip
    """(perplexity, peak blocks) of ``seq`` streamed ``chunk`` tokens per step under ``policy``
    (``reindex``: StreamingLLM's positions, see ``Streamer``)."""
    if len(seq) < 2:
        raise InvalidArgumentError("perplexity needs at least 2 tokens")
    s = Streamer(lm, policy, 1, len(seq), chunk, reindex)
    nll, count = 0.0, 0
    for start in range(0, len(seq) - 1, chunk):
        part = seq[start : min(start + chunk, len(seq) - 1)]  # the last token is only a target
        logits = s.feed([part])
        targets = torch.tensor(seq[start + 1 : start + 1 + len(part)], device=logits.device)
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(part)
    return float(np.exp(nll / count)), s.peak_blocks


@dataclass(frozen=True)
class NeedleCase:
    prompt: list[int]
    key: int
    length: int
    depth: int  # percent of the haystack before the needle


# Needle formats (docs/retention.md, "Needle"), chosen by the full cache's accuracy alone.
# ``passkey``: an instruction, a repeated filler paragraph with the needle at a sentence end, and
# the needle's own opening as the prompt to complete (pass-key retrieval, Mohtashami & Jaggi 2023;
# our own filler). ``prose``: the needle anywhere in real text, then a question.
NEEDLE_FORMATS = ("passkey", "prose")
HEADER = (
    "There is a pass key hidden in the long text below. Find it and remember it: "
    "you will be asked for it at the end.\n"
)
FILLER = (
    "The river runs down to the sea.",
    "The hills are green in spring.",
    "A bird sings in the old tree.",
    "The road goes on and on.",
)


def _filler(tokenizer, start: int, n: int) -> tuple[list[int], list[int]]:
    """``n`` tokens of the filler from sentence ``start`` on, and the sentence ends in them."""
    sentences = [tokenizer(" " + s).input_ids for s in FILLER]
    out: list[int] = []
    ends = [0]
    i = start
    while len(out) < n:
        out += sentences[i % len(sentences)]
        ends.append(min(len(out), n))
        i += 1
    return out[:n], ends


def needle_cases(tokenizer, corpus: list[int], lengths, depths, seed: int,
                 fmt: str = "passkey") -> list[NeedleCase]:  # fmt: skip
    """A pass key at ``depth`` % of the haystack of ``length`` tokens, per (length, depth).

    The seed picks each case's key (five digits) and where its haystack starts (an offset into
    ``corpus`` for ``prose``, the first filler sentence for ``passkey``)."""
    if fmt not in NEEDLE_FORMATS:
        raise InvalidArgumentError(f"needle format {fmt!r}: expected one of {NEEDLE_FORMATS}")
    rng = random.Random(seed)
    if fmt == "passkey":
        head, ask = tokenizer(HEADER).input_ids, tokenizer("\nThe pass key is").input_ids
    else:
        head, ask = [], tokenizer("\nWhat is the pass key? The pass key is").input_ids
    out = []
    for n in lengths:
        for d in depths:
            key = rng.randint(10000, 99999)
            needle = tokenizer(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
            body = n - len(head) - len(needle.input_ids) - len(ask)
            if body < 16 or (fmt == "prose" and body > len(corpus)):
                raise InvalidArgumentError(f"needle context {n} does not fit the corpus")
            cut = body * d // 100
            if fmt == "passkey":
                text, ends = _filler(tokenizer, rng.randrange(len(FILLER)), body)
                cut = min(ends, key=lambda e: abs(e - cut))  # the sentence end nearest the depth
            else:
                start = rng.randint(0, len(corpus) - body)
                text = corpus[start : start + body]
            prompt = head + text[:cut] + needle.input_ids + text[cut:] + ask
            out.append(NeedleCase(prompt, key, n, d))
    return out


def needle(lm: PagedLM, tokenizer, policy, cases: list[NeedleCase], chunk: int,
           answer_tokens: int = 8, texts: list[str] | None = None,
           reindex: bool = False) -> list[bool]:  # fmt: skip
    """Whether each case's key comes back in the greedy answer; cases of equal prompt length
    run as one batch, streamed ``chunk`` tokens per step, then decoded one token per step.
    ``texts`` (optional) gets each case's decoded answer."""
    result: dict[int, bool] = {}
    decoded: dict[int, str] = {}
    for plen in sorted({len(c.prompt) for c in cases}):
        idx = [i for i, c in enumerate(cases) if len(c.prompt) == plen]
        s = Streamer(lm, policy, len(idx), plen + answer_tokens, chunk, reindex)
        for start in range(0, plen, chunk):
            logits = s.feed([cases[i].prompt[start : start + chunk] for i in idx], last_only=True)
        answers = [[int(t)] for t in logits.argmax(-1).tolist()]
        for _ in range(answer_tokens - 1):
            logits = s.feed([[a[-1]] for a in answers], last_only=True)
            for a, t in zip(answers, logits.argmax(-1).tolist(), strict=True):
                a.append(int(t))
        for i, a in zip(idx, answers, strict=True):
            decoded[i] = tokenizer.decode(a)
            result[i] = key_found(cases[i].key, decoded[i])
    if texts is not None:
        texts.extend(decoded[i] for i in range(len(cases)))
    return [result[i] for i in range(len(cases))]


def key_found(key: int, answer: str) -> bool:
    """The scorer, exact match: the first number in the answer is the key (spaces ignored, so
    a tokenizer that splits digits still counts); a near miss (one digit off) fails."""
    digits = re.search(r"\d+", answer.replace(" ", ""))
    return digits is not None and digits.group(0) == str(key)


class ByteTokenizer:
    """UTF-8 bytes as token ids 3..258: lets a model without a tokenizer (the seeded random
    ``tiny-llama`` of the tests) run the gate; its numbers mean nothing about quality."""

    def __call__(self, text: str):
        return _Encoded([3 + b for b in text.encode()])

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")


@dataclass(frozen=True)
class _Encoded:
    input_ids: list[int]
