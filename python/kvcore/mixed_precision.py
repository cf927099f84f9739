"""Per-layer mixed precision: a storage format per layer, chosen by measured layer sensitivity.

A mix is just a list of format names, one per layer (``allocate_kv_caches`` takes it as is;
the planner counts it layer by layer). ``assign_mix`` picks the cheapest list that stays within
a perplexity budget:

1. sensitivity: the perplexity change when ONLY layer ``l`` uses candidate ``c`` (all others in
   the model dtype), on a calibration text, for every ``(l, c)``;
2. greedy downgrades: starting from the model dtype everywhere, repeatedly apply the move
   (layer -> a cheaper candidate) with the least predicted perplexity per byte saved, while the
   predicted total (the sum of the layers' changes) stays within the budget;
3. verification: the chosen mix is measured; while it is over budget, the last move is undone.

The first and last layers usually come out most sensitive; the table of sensitivities is
returned so callers can print it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from kvcore_kernels.quant import resolve_formats

from kvcore.errors import InvalidArgumentError
from kvcore.eval_kv import PagedLM, perplexity
from kvcore.planner import geometry, layer_bytes_per_token


@dataclass
class MixResult:
    """The chosen per-layer formats and what was measured on the way."""

    formats: list[str]
    base_ppl: float
    predicted_pct: float
    measured_pct: float
    bytes_per_token: float
    sensitivity: dict[str, np.ndarray] = field(default_factory=dict)  # format -> [L] % change


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
    log: Callable[[str], object] | None = None,
) -> MixResult:
    """The cheapest per-layer mix of ``candidates`` (and "auto") within ``budget_pct`` % of
    perplexity on ``seqs``. Raises ``InvalidArgumentError`` for a bad budget or candidate."""
    if not budget_pct >= 0:
        raise InvalidArgumentError(f"the perplexity budget must be >= 0 %, got {budget_pct}")
    if not candidates:
        raise InvalidArgumentError("assign_mix needs at least one candidate format")
    geom = geometry(lm.model.config)
    cost = {f: layer_bytes_per_token(geom, f, lm.block_size) for f in ["auto", *candidates]}
    base, sens = layer_sensitivity(lm, seqs, candidates, chunk=chunk)
    sens["auto"] = np.zeros(lm.num_layers)
    current = ["auto"] * lm.num_layers
    moves: list[tuple[int, str]] = []  # (layer, previous format), in order applied
    predicted = 0.0
    while True:
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
        moves.append((layer, current[layer]))
        current[layer] = c
        predicted += extra
    measured = 100 * (perplexity(lm, current, seqs, chunk) / base - 1)
    while measured > budget_pct and moves:  # the sum of single-layer changes was optimistic
        layer, previous = moves.pop()
        current[layer] = previous
        measured = 100 * (perplexity(lm, current, seqs, chunk) / base - 1)
    if log is not None:
        for c in candidates:
            log(f"# sensitivity {c} (% ppl per layer): " + " ".join(f"{x:.2f}" for x in sens[c]))
        log(f"# mix: {','.join(current)}")
    return MixResult(
        formats=resolve_formats(current, lm.num_layers),
        base_ppl=base,
        predicted_pct=predicted,
        measured_pct=measured,
        bytes_per_token=sum(cost[f] for f in current),
        sensitivity={c: sens[c] for c in candidates},
    )
