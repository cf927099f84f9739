"""Retention in the engine: the model's exact window release and per-request policies.

What the engine decides once, at construction (docs/retention.md):

* **exact release**: when *every* attention layer of the model has a sliding window (Mistral,
  a Qwen2 config with all layers windowed, a Gemma-3-shaped config without a global layer), the
  scheduler gets ``sliding_window=W`` and releases blocks wholly behind it. A model with some
  full-attention layer keeps every block (hybrid models need KV cache groups, not built yet).
* **lossy policies** (``window:W``, ``sink:S+window:W``): per engine (``retention=``) or per
  request; they need attention kernels that skip null block-table entries, a plain cache
  format and no MLA. ``h2o`` needs the kernels' attention-mass side output: refused here.

Until the kernels accept null entries, exact release still runs: the model runner fills each
released entry with a block the row holds (``fill_released``). The kernels never read it: a
released block lies wholly before the window of the row's first query, where both kernels
start (and mask by window anyway).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcore.errors import InvalidArgumentError
from kvcore.models.windows import layer_windows
from kvcore.retention.spec import RetentionError, RetentionPolicy, parse_retention


def model_windows(config: Any) -> tuple[int | None, ...]:
    """Per layer the sliding window the attention receives (None: full attention)."""
    return layer_windows(config)


def exact_release_window(config: Any, enabled: bool, formats: list[str]) -> int:
    """The window to release behind (tokens), or 0: every layer windowed, release enabled, no
    KIVI layer (its residual window is planned from full tables), no MLA latents."""
    if not enabled or any(f.startswith("kivi") for f in formats):
        return 0
    if getattr(config, "kv_lora_rank", None):  # MLA: windows are not modelled
        return 0
    windows = model_windows(config)
    if not windows or any(w is None for w in windows):
        return 0
    return int(max(windows))  # type: ignore[type-var]


@functools.cache
def kernels_take_null_entries() -> bool:
    """Whether ``kvcore_kernels.plan_attention`` accepts a null (0) entry inside a row's used
    blocks (kernels that mask released blocks). Probed once with a two-block row."""
    import kvcore_kernels

    try:
        kvcore_kernels.plan_attention(
            np.array([0, 1]), np.array([2]), np.array([[0, 1]]), 1, device="cpu"
        )
    except kvcore_kernels.KernelConfigError:
        return False
    return True


def has_released(table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> bool:
    """Whether a row of ``table`` has a null (released) entry inside its used blocks."""
    used = np.arange(table.shape[1])[None, :] < (-(-seq_lens // block_size))[:, None]
    return bool((used & (table == 0)).any())


def fill_released(table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """``table`` with each null entry inside a row's used blocks replaced by the row's last used
    block (exact windows only: such an entry is never read). Returns ``table`` when none."""
    used = np.arange(table.shape[1])[None, :] < (-(-seq_lens // block_size))[:, None]
    holes = used & (table == 0)
    if not holes.any():
        return table
    last = table[np.arange(table.shape[0]), np.maximum(-(-seq_lens // block_size) - 1, 0)]
    out = np.array(table, copy=True)
    out[holes] = np.broadcast_to(last[:, None], table.shape)[holes]
    return out


log = logging.getLogger("kvcore")


@dataclass(frozen=True)
class KvGroups:
    """KV cache groups of a hybrid model (docs/retention.md section 6): ``size`` layers per
    group, one attention kind per group; layer ``l`` uses cache tensor ``layer_slot[l]`` through
    the block table of group ``layer_group[l]`` (group 0: the plan's ``block_table``)."""

    size: int
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    windows: tuple[int, ...]  # per group, tokens; 0: full attention


def kv_groups(windows: tuple[int | None, ...]) -> KvGroups | None:
    """Groups for per-layer ``windows`` when some layers are global and some local (None for a
    uniform model): layers of one window in chunks of the gcd of the per-window layer counts."""
    by_window: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        by_window.setdefault(w or 0, []).append(layer)
    if len(by_window) < 2 or 0 not in by_window:
        return None
    size = math.gcd(*(len(v) for v in by_window.values()))
    group, slot, gw = [0] * len(windows), [0] * len(windows), []
    for w in sorted(by_window):  # 0 (global) first: group 0 keeps every block
        layers = by_window[w]
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start : start + size]):
                group[layer], slot[layer] = len(gw), j
            gw.append(w)
    return KvGroups(size, tuple(group), tuple(slot), tuple(gw))


def engine_groups(config: Any, cache_config: Any, formats: list[str]) -> KvGroups | None:
    """The groups the engine runs for ``config``, or None (uniform model, or a restriction:
    groups need ``sliding_window_release``, ``prefix_caching="off"``, plain formats, no MLA and
    no tiers; a hybrid model outside them keeps every block, which is logged)."""
    if getattr(config, "kv_lora_rank", None):
        return None
    groups = kv_groups(model_windows(config))
    if groups is None or not cache_config.sliding_window_release:
        return None
    why = None
    if cache_config.prefix_caching != "off":
        why = 'prefix_caching="off" (window-aware prefix hits are not built)'
    elif any(f != "auto" for f in formats):
        why = "the model-dtype KV format"
    elif cache_config.host_kv_bytes:
        why = "no KV tiers"
    if why:
        log.warning(
            "kvcore: hybrid model (local and global layers): KV cache groups, which release the "
            "local layers' blocks behind their window, need %s; keeping every block",
            why,
        )
        return None
    return groups


class RetentionSupport:
    """What this engine can run: checks a policy and turns it into the scheduler's blocks."""

    def __init__(self, default: str, block_size: int, formats: list[str], config: Any):
        self.block_size = block_size
        self.formats = formats
        self.config = config
        self.default = self.check(default)

    def check(self, spec: str | RetentionPolicy | None) -> RetentionPolicy:
        """The parsed policy, or ``RetentionError`` if this engine cannot run it."""
        p = parse_retention(spec)
        if not p.lossy:
            return p
        why = None
        if getattr(self.config, "kv_lora_rank", None):
            why = "MLA caches do not support lossy retention"
        elif any(f != "auto" for f in self.formats):
            why = f"quantized KV formats ({', '.join(sorted(set(self.formats)))}) are not supported"
        elif not kernels_take_null_entries():
            why = "the attention kernels do not skip released (null) block-table entries"
        if why:
            raise RetentionError(f"retention {p.name!r}: {why}")
        p.blocks(self.block_size)  # rounding checks (h2o budgets)
        return p

    def blocks(self, policies: list[RetentionPolicy]) -> tuple[np.ndarray, np.ndarray]:
        """``(retention_sink, retention_window)`` block counts for the scheduler (0, 0: full)."""
        sinks, windows = [], []
        for p in policies:
            b = p.blocks(self.block_size)
            # h2o has no scheduler-side rule (it would release the heavy hitters too): the
            # engine's drops (kvcore.retention.h2o) alone keep it within its budget
            sinks.append(0 if p.kind == "h2o" else b.sink)
            windows.append(0 if p.kind == "h2o" else b.window)
        return np.asarray(sinks, np.int64), np.asarray(windows, np.int64)

    def resolve(self, retention: Any, n: int) -> list[RetentionPolicy]:
        """One policy per prompt: None (the engine's default), one spec for all, or a list."""
        if retention is None:
            return [self.default] * n
        if isinstance(retention, str | RetentionPolicy):
            return [self.check(retention)] * n
        if not isinstance(retention, list | tuple) or len(retention) != n:  # like cache_salt
            raise InvalidArgumentError(
                f"retention must be a policy string or a list of {n} (one per prompt)"
            )
        return [self.default if r is None else self.check(r) for r in retention]
