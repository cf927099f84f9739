"""Typed argparse values shared by every ``kvcore`` command and by ``EngineArgs``.

Each is an argparse ``type=``: it returns the parsed value or raises ``ArgumentTypeError`` with a
one-line reason, so a bad flag is refused while parsing (exit 2), before anything loads.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        value = _int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {text}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def float_in(
    low: float, high: float = math.inf, *, low_open: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
        if not ok:
            bracket = "(" if low_open else "["
            top = "inf)" if high == math.inf else f"{high:g}]"
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {bracket}{low:g}, {top}, got {text}"
            )
        return value

    parse.__name__ = "number"
    return parse


def positive_int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 (an empty string is an empty list)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    parse = int_at_least(1)
    return [parse(t) for t in items]


def name_list(text: str) -> list[str]:
    """An argparse type: a non-empty comma-separated list of names."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def device(text: str) -> str:
    """An argparse type: a device kvcore can run on here (``cpu``, ``cuda``, ``cuda:N``)."""
    from kvcore.config import resolve_device
    from kvcore.errors import KvCoreError

    try:
        return str(resolve_device(text))
    except KvCoreError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
