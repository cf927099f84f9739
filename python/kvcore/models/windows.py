"""Per-layer attention windows of a transformers model: what each layer can still see.

``layer_windows(config)`` gives, per decoder layer, the ``sliding_window`` that transformers 5.24
hands to the attention function for that layer (``None``: full attention). It follows each
architecture's own code, not a generic reading of the config:

=============  ===============================================================================
mistral        every layer uses ``config.sliding_window`` (``layer_types`` is ignored by the model)
qwen2, qwen3   ``layer_types`` (built from ``use_sliding_window`` / ``max_window_layers``)
gemma2         ``layer_types`` (alternating, local first)
gemma3_text    ``layer_types`` (5 local : 1 global in the released models)
others         full attention everywhere (Llama, SmolLM2, DeepSeek MLA)
=============  ===============================================================================

A layer with window ``W`` lets the query at position ``q`` read keys at positions ``k`` with
``q - W < k <= q`` (the kernels mask ``q - k >= W``, transformers' ``kv_idx > q_idx - W``)::

    positions   0 ........ q-W | q-W+1 ......... q
                never read again    the W keys the query at q reads

Queries only move forward, so once a sequence's next query position is ``p`` a window-``W``
layer never reads a key below ``p - W + 1`` again. A block is dead for the whole model when every
layer that reads it is windowed and the block ends at or below ``min over layers of (p - W + 1)``;
a single full-attention layer keeps every block alive (``visible_tokens`` returns ``None``).
"""

from __future__ import annotations

from typing import Any

_LAYER_TYPED = frozenset({"qwen2", "qwen3", "gemma2", "gemma3_text"})


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per layer the sliding window its attention applies (``None``: full attention)."""
    num_layers = int(config.num_hidden_layers)
    model_type = getattr(config, "model_type", None)
    window = getattr(config, "sliding_window", None)
    if not window:
        return (None,) * num_layers
    if model_type == "mistral":
        return (int(window),) * num_layers
    if model_type in _LAYER_TYPED:
        types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
        return tuple(int(window) if t == "sliding_attention" else None for t in types[:num_layers])
    return (None,) * num_layers


def visible_tokens(windows: tuple[int | None, ...] | list[int | None]) -> int | None:
    """How many of the most recent positions some layer can still read: the largest window when
    every layer is windowed, ``None`` when any layer attends to the full history."""
    if not windows or any(w is None for w in windows):
        return None
    return max(int(w) for w in windows if w is not None)


def window_groups(
    windows: tuple[int | None, ...] | list[int | None],
) -> dict[int | None, list[int]]:
    """Layer indices grouped by window, e.g. Gemma-3-270M: ``{512: [0..4, 6..10, 12..16],
    None: [5, 11, 17]}`` (the groups a hybrid model's per-window block tables would follow)."""
    groups: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        groups.setdefault(w, []).append(i)
    return groups
