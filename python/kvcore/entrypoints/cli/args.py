"""Argument checking shared by the ``kvcore`` commands: one-line errors, typed values.

Every bad argument is refused while parsing, before a model loads or a run starts, with one line
on stderr (``kvcore run: error: argument --conversations: ...``) and exit status 2. Errors
raised later (a ``KvCoreError``, ``ValueError`` or ``OSError`` from the engine or the files it
reads) are printed the same way by ``report_errors``; ``KVCORE_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

EXIT_USAGE = 2  # bad arguments or input
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def one_line(text: object) -> str:
    """A message on one line (lines joined by ``; ``)."""
    return "; ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


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


def memory_size(text: str) -> int:
    """An argparse type: a memory size (``8GiB``, ``500MiB``, ``80GB``), in bytes."""
    from kvcore.errors import KvCoreError
    from kvcore.tools.planner import parse_memory

    try:
        return parse_memory(text)
    except KvCoreError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device(text: str) -> str:
    """An argparse type: a device kvcore can run on here (``cpu``, ``cuda``, ``cuda:N``)."""
    from kvcore.config import resolve_device
    from kvcore.errors import KvCoreError

    try:
        return str(resolve_device(text))
    except KvCoreError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@contextmanager
def report_errors(prog: str) -> Iterator[list[int]]:
    """Run a command: its errors become one line on stderr and exit status 2, Ctrl-C exit 130.

    Yields a one-element list holding the exit status (set on an error or an interrupt).
    """
    from kvcore.errors import KvCoreError

    status = [0]
    try:
        yield status
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        status[0] = EXIT_INTERRUPTED
    except (KvCoreError, ValueError, OSError, MemoryError) as e:
        if os.environ.get("KVCORE_DEBUG"):
            raise
        print(f"{prog}: error: {one_line(e) or type(e).__name__}", file=sys.stderr)
        status[0] = EXIT_USAGE
    except RuntimeError as e:  # torch out of memory; anything else is a bug: show it
        if "out of memory" not in str(e) and "not enough memory" not in str(e):
            raise
        print(f"{prog}: error: out of memory: {one_line(e)}", file=sys.stderr)
        status[0] = EXIT_USAGE


def fail(prog: str, message: str) -> NoReturn:
    """Exit 2 with one line, like a parse error (for checks argparse cannot express)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(EXIT_USAGE)


def check(condition: Any, prog: str, message: str) -> None:
    """``fail`` unless ``condition``."""
    if not condition:
        fail(prog, message)
