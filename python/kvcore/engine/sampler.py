"""Vectorised sampling over the rows of a step.

Per-request parameters live in slot-indexed NumPy arrays (a slot is taken by ``add`` and given
back by ``remove``), so a step gathers them with one fancy index and moves them to the device as
one array. The pipeline per step, each stage run only when some row needs it:

    raw logits ─► logprobs of chosen tokens (from the raw model distribution)
               ─► penalties (repetition on prompt+output, presence/frequency on output counts)
               ─► greedy rows: argmax
               ─► sampled rows: / temperature ─► top-k ─► top-p ─► min-p ─► softmax
                  ─► argmax(probs / E), E ~ Exp(1)   (exponential race = a draw from probs)

Seeded rows draw their E from a generator re-seeded with ``mix(seed, output_index)``, a
counter-based stream: the same seed gives the same tokens whatever else is in the batch, and a
recomputed (preempted) request does not shift its stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvcore_kernels import ops_cpu

from kvcore.params import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, counter: int) -> int:
    """A 64-bit hash of (seed, counter) (splitmix64 finaliser) for counter-based streams."""
    z = (seed * 0x9E3779B97F4A7C15 + counter + 0x632BE59BD9B4E5B5) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index on ties, NaN above all, like torch.argmax). On the CPU
    NumPy's is several times faster than torch's for [rows, vocab] fp32 logits; bf16 logits go
    to the native kernel's (``ops_cpu.argmax_rows``), which does not widen them first."""
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and ops_cpu.argmax_rows_native_ok(x):
        return ops_cpu.argmax_rows(x, backend="cpu")
    if x.device.type == "cpu":
        return torch.from_numpy(np.argmax(x.detach().float().numpy(), axis=-1))
    return torch.argmax(x, dim=-1)


@dataclass
class SamplerOutput:
    """The step's sampled tokens, one per row, and the logprobs asked for."""

    token_ids: np.ndarray  # int64 [rows]
    logprobs: np.ndarray | None = None  # float32 [rows]: chosen token's logprob (nan if unasked)
    top_ids: np.ndarray | None = None  # int64 [rows, k_max]: top-k alternatives (logprobs=k)
    top_logprobs: np.ndarray | None = None  # float32 [rows, k_max]


# Columns of the per-slot float parameter table (gathered per step, one H2D copy).
_TEMP, _TOP_P, _MIN_P, _REP, _PRES, _FREQ, _TOP_K = range(7)


class Sampler:
    """Samples one token per row of a step's logits with each row's own SamplingParams."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._params = np.zeros((0, 7), np.float32)
        self._seed = np.zeros(0, np.uint64)
        self._seeded = np.zeros(0, bool)
        self._logprobs = np.zeros(0, np.int32)  # -1: no logprobs
        self._pen_row = np.zeros(0, np.int64)  # row in the penalty tables, -1: none
        self._free: list[int] = []
        self._pen_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=self.device)
        self._pen_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)
        self._pen_free: list[int] = []
        self._noise_gen = torch.Generator(self.device).manual_seed(seed)
        self._seeded_gen = torch.Generator(self.device)

    @property
    def num_active(self) -> int:
        """Slots in use."""
        return len(self._seed) - len(self._free)

    def _grow(self) -> None:
        old = len(self._seed)
        new = max(16, 2 * old)
        self._params = np.concatenate([self._params, np.zeros((new - old, 7), np.float32)])
        self._seed = np.concatenate([self._seed, np.zeros(new - old, np.uint64)])
        self._seeded = np.concatenate([self._seeded, np.zeros(new - old, bool)])
        self._logprobs = np.concatenate([self._logprobs, np.full(new - old, -1, np.int32)])
        self._pen_row = np.concatenate([self._pen_row, np.full(new - old, -1, np.int64)])
        self._free.extend(range(new - 1, old - 1, -1))

    def _pen_slot(self) -> int:
        if not self._pen_free:
            old = self._pen_counts.shape[0]
            new = max(4, 2 * old)
            grow = new - old
            pad = torch.zeros((grow, self.vocab_size), dtype=torch.int32, device=self.device)
            self._pen_counts = torch.cat([self._pen_counts, pad])
            self._pen_prompt = torch.cat([self._pen_prompt, pad.bool()])
            self._pen_free.extend(range(new - 1, old - 1, -1))
        return self._pen_free.pop()

    def add(self, params: SamplingParams, prompt_token_ids: list[int], index: int = 0) -> int:
        """Take a slot for completion ``index`` of a request; returns the slot."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        top_k = params.top_k if params.top_k > 0 else self.vocab_size
        self._params[slot] = (
            params.temperature,
            params.top_p,
            params.min_p,
            params.repetition_penalty,
            params.presence_penalty,
            params.frequency_penalty,
            min(top_k, self.vocab_size),
        )
        self._seeded[slot] = params.seed is not None
        self._seed[slot] = mix_seed(params.seed & _MASK64, index) if params.seed is not None else 0
        self._logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self._pen_row[slot] = -1
        if params.has_penalties:
            row = self._pen_slot()
            self._pen_counts[row].zero_()
            self._pen_prompt[row].zero_()
            if prompt_token_ids:
                ids = torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)
                self._pen_prompt[row, ids] = True
            self._pen_row[slot] = row
        return slot

    def remove(self, slot: int) -> None:
        """Give ``slot`` back."""
        row = int(self._pen_row[slot])
        if row >= 0:
            self._pen_free.append(row)
            self._pen_row[slot] = -1
        self._free.append(slot)

    def sample(
        self, logits: torch.Tensor, slots: np.ndarray, output_index: np.ndarray
    ) -> SamplerOutput:
        """Sample a token per row. ``slots[i]`` is row i's slot, ``output_index[i]`` the number
        of tokens that completion has already produced (the seeded stream's counter)."""
        params = self._params[slots]  # [rows, 7]
        lp_k = self._logprobs[slots]
        pen_rows = self._pen_row[slots]
        has_pen = pen_rows >= 0
        any_pen, want_lp = bool(has_pen.any()), bool((lp_k >= 0).any())
        sampled = np.nonzero(params[:, _TEMP] > 0)[0]
        if want_lp or any_pen or sampled.size:
            logits = logits.float()  # else greedy rows only: the argmax of the logits as they are
        # Logprobs are those of the raw model distribution, before penalties and temperature.
        logp = torch.log_softmax(logits, dim=-1) if want_lp else None
        if any_pen:
            logits = logits.clone()
            self._apply_penalties(logits, np.nonzero(has_pen)[0], pen_rows[has_pen], params)
        tokens = argmax_rows(logits)
        if sampled.size:
            tokens[torch.from_numpy(sampled).to(self.device)] = self._sample_rows(
                logits, sampled, params, slots, output_index
            )
        if any_pen:  # count the chosen tokens for the next step's penalties
            rows = torch.from_numpy(pen_rows[has_pen]).to(self.device)
            chosen = tokens[torch.from_numpy(np.nonzero(has_pen)[0]).to(self.device)]
            ones = torch.ones_like(chosen, dtype=torch.int32)
            self._pen_counts.index_put_((rows, chosen), ones, accumulate=True)
        out = SamplerOutput(token_ids=tokens.cpu().numpy())
        if logp is not None:
            out.logprobs = logp.gather(1, tokens[:, None])[:, 0].cpu().numpy()
            k_max = int(lp_k.max())
            if k_max > 0:
                top = torch.topk(logp, k_max, dim=-1)
                out.top_ids = top.indices.cpu().numpy()
                out.top_logprobs = top.values.cpu().numpy()
        return out

    def _apply_penalties(
        self, logits: torch.Tensor, rows: np.ndarray, pen_rows: np.ndarray, params: np.ndarray
    ) -> None:
        dev_rows = torch.from_numpy(rows).to(self.device)
        table = torch.from_numpy(pen_rows).to(self.device)
        counts = self._pen_counts[table]  # [p, vocab]
        seen_out = counts > 0
        p = torch.from_numpy(params[rows]).to(self.device)
        x = logits[dev_rows]
        rep = p[:, _REP, None]
        seen = seen_out | self._pen_prompt[table]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - p[:, _FREQ, None] * counts - p[:, _PRES, None] * seen_out
        logits[dev_rows] = x

    def _sample_rows(
        self,
        logits: torch.Tensor,
        rows: np.ndarray,
        params: np.ndarray,
        slots: np.ndarray,
        output_index: np.ndarray,
    ) -> torch.Tensor:
        p = torch.from_numpy(params[rows]).to(self.device)
        x = logits[torch.from_numpy(rows).to(self.device)] / p[:, _TEMP, None]
        vocab = x.shape[-1]
        use_top_k = bool((params[rows, _TOP_K] < vocab).any())
        use_top_p = bool((params[rows, _TOP_P] < 1).any())
        if use_top_k or use_top_p:
            x_sorted, order = torch.sort(x, dim=-1, descending=True)
            if use_top_k:
                rank = torch.arange(vocab, device=self.device)
                x_sorted.masked_fill_(rank[None, :] >= p[:, _TOP_K, None], float("-inf"))
            if use_top_p:
                probs_sorted = torch.softmax(x_sorted, dim=-1)
                before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted  # mass ranked above
                top_p = torch.where(p[:, _TOP_P] < 1, p[:, _TOP_P], torch.inf)
                x_sorted.masked_fill_(before > top_p[:, None], float("-inf"))
            x = torch.empty_like(x).scatter_(1, order, x_sorted)
        probs = torch.softmax(x, dim=-1)
        if bool((params[rows, _MIN_P] > 0).any()):
            floor = p[:, _MIN_P, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self._noise_gen)
        seeded = np.nonzero(self._seeded[slots[rows]])[0]
        for i in seeded.tolist():  # only seeded rows pay a per-row draw
            slot = int(slots[rows[i]])
            key = mix_seed(int(self._seed[slot]), int(output_index[rows[i]]))
            self._seeded_gen.manual_seed(key)
            noise[i].exponential_(generator=self._seeded_gen)
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a 0 draw would divide 0 by 0
        return argmax_rows(probs / noise)
