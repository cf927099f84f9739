"""Per-layer mixed precision: a storage format per layer, chosen by measured layer sensitivity.

A mix is just a list of format names, one per layer (``allocate_kv_caches`` takes it as is;
the planner counts it layer by layer). ``assign_mix`` picks the cheapest list that stays within
a perplexity budget:

1. sensitivity: the perplexity change when ONLY layer ``l`` uses candidate ``c`` (all others in
   the model dtype), on a calibration text, for every ``(l, c)``;
2. greedy downgrades: starting from the model dtype everywhere, repeatedly apply the move
   (layer -> a cheaper candidate) with the least predicted perplexity per byte saved, while the
   predicted total (the sum of the layers' changes) stays within the budget;
3. verification: the assembled mix is measured (on the verification text, by default the
   calibration text); while it is over budget, the most sensitive quantized layer moves to the
   next safer format and the mix is measured again. All layers in the model dtype always meet
   the budget, so this ends; ``MixResult.met`` says whether it did.

The calibration text must be longer than one prefill step (``reading_chunk``): otherwise no
token reads KV quantized by an earlier step and KIVI measures 0.00% on every layer.

The first and last layers usually come out most sensitive; the table of sensitivities is
returned so callers can print it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from kvcore_kernels.quant import resolve_formats

from kvcore.errors import InvalidArgumentError
from kvcore.tools.eval_kv import PagedLM, perplexity
from kvcore.tools.planner import geometry, layer_bytes_per_token


@dataclass
class MixResult:
    """The chosen per-layer formats and what was measured on the way."""

    formats: list[str]
    base_ppl: float
    predicted_pct: float  # sum of the chosen layers' single-layer changes (calibration)
    measured_pct: float  # the assembled mix, measured on the verification text
    bytes_per_token: float
    sensitivity: dict[str, np.ndarray] = field(default_factory=dict)  # format -> [L] % change
    backoffs: int = 0  # layers moved to a safer format after the verification
    calib_chunk: int = 0  # prefill chunk of the sensitivity measurement


def reading_chunk(num_tokens: int, chunk: int) -> int:
    """A prefill chunk under which a text of ``num_tokens`` reads KV written by earlier steps.

    Perplexity feeds ``num_tokens - 1`` tokens ``chunk`` per step; in one step every token
    attends within the step, and KIVI keeps the step's blocks in full precision, so nothing
    quantized would be read (KIVI's change would read 0). Then the text is cut in four steps.
    """
    if num_tokens - 1 > chunk:
        return chunk
    return max(1, -(-(num_tokens - 1) // 4))


def layer_sensitivity(
    lm: PagedLM, seqs: list[list[int]], candidates: Sequence[str], *, chunk: int
) -> tuple[float, dict[str, np.ndarray]]:
    """(model-dtype perplexity, {candidate: [L] % change with only that layer quantized})."""
    base = perplexity(lm, "auto", seqs, chunk)
    out = {}
    for c in candidates:
        deltas = np.zeros(lm.num_layers)
        for layer in range(lm.num_layers):
            formats = ["auto"] * lm.num_layers
            formats[layer] = c
            deltas[layer] = 100 * (perplexity(lm, formats, seqs, chunk) / base - 1)
        out[c] = deltas
    return base, out


def assign_mix(
    lm: PagedLM,
    seqs: list[list[int]],
    candidates: Sequence[str],
    budget_pct: float,
    *,
    chunk: int = 256,
    verify_seqs: list[list[int]] | None = None,
    verify_chunk: int | None = None,
    log: Callable[[str], object] | None = None,
) -> MixResult:
    """The cheapest per-layer mix of ``candidates`` (and "auto") within ``budget_pct`` % of
    perplexity, verified on ``verify_seqs`` (default: the calibration ``seqs``) prefilled
    ``verify_chunk`` tokens per step (default ``chunk``). Raises ``InvalidArgumentError`` for a
    bad budget, candidate or text."""
    if not budget_pct >= 0:
        raise InvalidArgumentError(f"the perplexity budget must be >= 0 %, got {budget_pct}")
    if not candidates:
        raise InvalidArgumentError("assign_mix needs at least one candidate format")
    if not seqs or len(seqs[0]) < 2:
        raise InvalidArgumentError("assign_mix needs calibration text of at least 2 tokens")
    geom = geometry(lm.model.config)
    cost = {f: layer_bytes_per_token(geom, f, lm.block_size) for f in ["auto", *candidates]}
    calib_chunk = reading_chunk(len(seqs[0]), chunk)
    base, sens = layer_sensitivity(lm, seqs, candidates, chunk=calib_chunk)
    sens["auto"] = np.zeros(lm.num_layers)
    current = ["auto"] * lm.num_layers
    applied = [0] * lm.num_layers  # when each layer last moved (ties of the back-off)
    predicted = 0.0
    while True:  # greedy: the least predicted perplexity per byte saved, within the budget
        best = None
        for layer, cur in enumerate(current):
            for c in candidates:
                saved = cost[cur] - cost[c]
                if saved <= 0:
                    continue
                extra = max(0.0, sens[c][layer]) - max(0.0, sens[cur][layer])
                if predicted + extra > budget_pct:
                    continue
                key = (extra / saved, -saved)
                if best is None or key < best[0]:
                    best = (key, layer, c, extra)
        if best is None:
            break
        _, layer, c, extra = best
        current[layer] = c
        applied[layer] = 1 + max(applied)
        predicted += extra
    # Verification: the sum of single-layer changes is optimistic (errors compound), so the
    # assembled mix is measured and, while over budget, the most sensitive quantized layer
    # moves to the next safer format (a costlier candidate, else the model dtype).
    vseqs = verify_seqs if verify_seqs is not None else seqs
    vchunk = verify_chunk if verify_chunk is not None else calib_chunk
    vbase = base if verify_seqs is None and vchunk == calib_chunk else None
    if vbase is None:
        vbase = perplexity(lm, "auto", vseqs, vchunk)

    def measure() -> float:
        if all(f == "auto" for f in current):
            return 0.0
        return 100 * (perplexity(lm, current, vseqs, vchunk) / vbase - 1)

    measured, backoffs = measure(), 0
    while measured > budget_pct and any(f != "auto" for f in current):
        quantized = [i for i, f in enumerate(current) if f != "auto"]
        layer = max(quantized, key=lambda i: (sens[current[i]][i], applied[i]))
        safer = [c for c in candidates if cost[c] > cost[current[layer]] and c != "auto"]
        current[layer] = min(safer, key=lambda c: cost[c]) if safer else "auto"
        backoffs += 1
        measured = measure()
    if log is not None:
        log(f"# sensitivity measured with a prefill chunk of {calib_chunk} tokens")
        for c in candidates:
            log(f"# sensitivity {c} (% ppl per layer): " + " ".join(f"{x:.2f}" for x in sens[c]))
        log(
            f"# mix: {','.join(current)}\n# mix predicted {predicted:+.2f}%, verified "
            f"{measured:+.2f}% (budget {budget_pct:g}%), {backoffs} layer(s) backed off"
            + (": no layer fits the budget" if all(f == "auto" for f in current) else "")
        )
    return MixResult(
        formats=resolve_formats(current, lm.num_layers),
        base_ppl=base,
        predicted_pct=predicted,
        measured_pct=measured,
        bytes_per_token=sum(cost[f] for f in current),
        sensitivity={c: sens[c] for c in candidates},
        backoffs=backoffs,
        calib_chunk=calib_chunk,
    )
