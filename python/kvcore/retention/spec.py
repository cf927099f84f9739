"""Retention policies: which KV a sequence keeps (docs/retention.md).

Paging decides where KV lives; retention decides which KV a sequence keeps. A policy is a string:

    full                               keep everything (the default; exact)
    window:W                           the most recent W tokens (StreamingLLM's "window" baseline)
    sink:S+window:W                    the first S tokens (attention sinks) + the most recent W
    h2o:budget=B[+sink=S][+window=W]   S sinks + W recent + the heaviest blocks by accumulated
                                       attention mass, B tokens in all (H2O)

``+`` joins a policy's parts and ``,`` separates policies in a list (``parse_retention_list``).
Sizes are in tokens; the cache keeps whole blocks (``RetentionPolicy.blocks``), so a policy is
rounded *up* to the blocks that hold those tokens. Lossy policies are never a default and never
publish thinned KV to the prefix cache. Sliding-window release of a model's own local layers is
not a policy: it is exact and follows from the model's config.

Ideas: attention sinks from StreamingLLM (Xiao et al., 2023); heavy hitters from H2O (Zhang et
al., 2023).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import numpy as np

from kvcore.errors import InvalidArgumentError

KINDS = ("full", "window", "sink", "h2o")
H2O_DEFAULT_SINK = 4  # tokens; the paper's finding that 4 sinks restore a stable window


class RetentionError(InvalidArgumentError):
    """A retention policy string that does not parse, or sizes that cannot work."""


@dataclass(frozen=True)
class RetentionBlocks:
    """A policy in whole blocks of ``block_size`` tokens (0 where the part is absent)."""

    sink: int  # leading blocks always kept
    window: int  # trailing full blocks kept besides the block being written
    budget: int  # h2o: total blocks kept (sink + window + heavy hitters); 0 otherwise

    @property
    def heavy(self) -> int:
        """h2o: blocks chosen by attention mass."""
        return max(0, self.budget - self.sink - self.window) if self.budget else 0


@dataclass(frozen=True)
class RetentionPolicy:
    kind: str  # one of KINDS
    sink: int = 0  # tokens
    window: int = 0  # tokens
    budget: int = 0  # tokens (h2o)
    label: str = field(default="", compare=False)  # the spelling it was parsed from

    @property
    def lossy(self) -> bool:
        return self.kind != "full"

    @property
    def name(self) -> str:
        """The canonical spelling (parses back to an equal policy)."""
        if self.kind == "full":
            return "full"
        if self.kind == "window":
            return f"window:{self.window}"
        if self.kind == "sink":
            return f"sink:{self.sink}+window:{self.window}"
        return f"h2o:budget={self.budget}+sink={self.sink}+window={self.window}"

    @property
    def metric_name(self) -> str:
        """The spelling it was given (else ``name``), every non-alphanumeric replaced by ``_``
        (``h2o:budget=1024`` -> ``h2o_budget_1024``), for ``name: value`` lines."""
        return re.sub(r"[^0-9A-Za-z]", "_", self.label or self.name)

    def blocks(self, block_size: int) -> RetentionBlocks:
        """Whole blocks that hold the policy's tokens: sinks and window rounded up."""
        if not (isinstance(block_size, int) and block_size > 0):
            raise RetentionError(f"block_size must be a positive int, got {block_size!r}")
        up = lambda n: -(-n // block_size)  # noqa: E731
        if self.kind == "full":
            return RetentionBlocks(0, 0, 0)
        sink, window = up(self.sink), up(self.window)
        budget = up(self.budget) if self.kind == "h2o" else 0
        if self.kind == "h2o" and budget < sink + window:
            raise RetentionError(
                f"{self.name}: at block size {block_size} the budget ({budget} blocks) is below "
                f"sinks plus window ({sink} + {window} blocks)"
            )
        return RetentionBlocks(sink, window, budget)


def _size(part: str, value: str, spec: str) -> int:
    if not re.fullmatch(r"[0-9]+", value.strip()):
        raise RetentionError(
            f"retention {spec!r}: {part} needs a non-negative integer token count, got {value!r}"
        )
    return int(value)


def _parts(spec: str, first: str, sep: str) -> dict[str, int]:
    """``first`` already stripped of its kind; each ``+`` part is ``key{sep}N``."""
    out: dict[str, int] = {}
    for part in spec.split("+")[1:]:
        key, s, value = part.partition(sep)
        key = key.strip()
        if not s or key not in ("sink", "window", "budget"):
            raise RetentionError(
                f"retention {spec!r}: unknown part {part!r} (expected sink{sep}N or window{sep}N)"
            )
        if key in out:
            raise RetentionError(f"retention {spec!r}: {key} given twice")
        out[key] = _size(key, value, spec)
    return out


def parse_retention(spec: str | RetentionPolicy | None) -> RetentionPolicy:
    """One policy from its string (see the module doc). ``None`` is ``full``."""
    p = _parse(spec)
    return (
        p if isinstance(spec, RetentionPolicy) or spec is None else replace(p, label=spec.strip())
    )


def _parse(spec: str | RetentionPolicy | None) -> RetentionPolicy:
    if spec is None:
        return RetentionPolicy("full")
    if isinstance(spec, RetentionPolicy):
        return spec
    if not isinstance(spec, str):
        raise RetentionError(f"retention must be a string, got {type(spec).__name__}")
    s = spec.strip()
    head = s.split("+")[0].strip()
    kind, _, arg = head.partition(":")
    kind = kind.strip()
    if kind == "full":
        if arg or "+" in s:
            raise RetentionError(f"retention {spec!r}: 'full' takes no parts")
        return RetentionPolicy("full")
    if kind == "window":
        if "+" in s:
            raise RetentionError(f"retention {spec!r}: 'window:W' takes no other part")
        w = _size("window", arg, spec)
        if w == 0:
            raise RetentionError(f"retention {spec!r}: the window must be at least 1 token")
        return RetentionPolicy("window", window=w)
    if kind == "sink":
        extra = _parts(s, head, ":")
        if set(extra) != {"window"}:
            raise RetentionError(f"retention {spec!r}: expected sink:S+window:W")
        sink, w = _size("sink", arg, spec), extra["window"]
        if sink == 0 or w == 0:
            raise RetentionError(f"retention {spec!r}: sinks and window must be at least 1 token")
        return RetentionPolicy("sink", sink=sink, window=w)
    if kind == "h2o":
        key, eq, value = arg.partition("=")
        if key.strip() != "budget" or not eq:
            raise RetentionError(f"retention {spec!r}: expected h2o:budget=B[+sink=S][+window=W]")
        budget = _size("budget", value, spec)
        extra = _parts(s, head, "=")
        if "budget" in extra:
            raise RetentionError(f"retention {spec!r}: budget given twice")
        sink = extra.get("sink", H2O_DEFAULT_SINK)
        window = extra.get("window", budget // 2)  # H2O's even split of recent and heavy
        if budget == 0:
            raise RetentionError(f"retention {spec!r}: the budget must be at least 1 token")
        if budget < sink + window:
            raise RetentionError(
                f"retention {spec!r}: budget {budget} is smaller than sinks plus window "
                f"({sink} + {window})"
            )
        return RetentionPolicy("h2o", sink=sink, window=window, budget=budget)
    raise RetentionError(
        f"retention {spec!r}: unknown policy {kind!r} (expected one of {', '.join(KINDS)})"
    )


def parse_retention_list(spec: str) -> list[RetentionPolicy]:
    """Policies separated by ``,`` (``full,sink:4+window:1020,h2o:budget=1024``), in order,
    without duplicates."""
    if not isinstance(spec, str) or not spec.strip():
        raise RetentionError("retention list must be a non-empty string")
    out: list[RetentionPolicy] = []
    for item in spec.split(","):
        p = parse_retention(item)
        if p in out:
            raise RetentionError(f"retention list {spec!r}: {p.name} given twice")
        out.append(p)
    return out


def blocks_to_release(
    policy: RetentionPolicy,
    num_tokens: int,
    block_size: int,
    live: np.ndarray,
    mass: np.ndarray | None = None,
) -> np.ndarray:
    """Logical blocks a sequence of ``num_tokens`` tokens releases now (int64 indices, ascending).

    ``live`` (bool ``[ceil(num_tokens / block_size)]``): the blocks it still holds; ``mass``
    (same length, h2o only): each block's accumulated attention (``paged_attention``'s
    ``block_mass`` summed over steps). Kept: the first ``sink`` blocks, the block being written
    (partial) plus the last ``window`` full blocks, and for h2o the ``heavy`` live blocks of the
    middle with the most mass (ties: the later block). A released block never comes back::

        blocks  0 .. sink-1 | middle (h2o: the heavy ones kept)  | window full blocks | partial
                kept        | released                           | kept               | kept
    """
    n = -(-num_tokens // block_size)
    live = np.asarray(live, dtype=bool)
    if live.shape != (n,):
        raise RetentionError(f"live must have {n} entries (blocks of {num_tokens} tokens)")
    if policy.kind == "full":
        return np.zeros(0, dtype=np.int64)
    b = policy.blocks(block_size)
    full = num_tokens // block_size  # full blocks; block ``full`` (if < n) is being written
    keep = np.zeros(n, dtype=bool)
    keep[: min(b.sink, n)] = True
    keep[max(0, full - b.window) :] = True
    if policy.kind == "h2o" and b.heavy:
        if mass is None or np.shape(mass) != (n,):
            raise RetentionError(f"h2o needs the mass of each of the {n} blocks")
        cand = np.flatnonzero(live & ~keep)
        if len(cand) > b.heavy:  # heaviest first; among equals the later block
            order = np.lexsort((-cand, -np.asarray(mass, dtype=np.float64)[cand]))
            cand = cand[order[: b.heavy]]
        keep[cand] = True
    return np.flatnonzero(live & ~keep).astype(np.int64)
