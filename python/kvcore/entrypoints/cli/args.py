"""Argument checking shared by the ``kvcore`` commands: one-line errors, typed values.

Every bad argument is refused while parsing, before a model loads or a run starts, with one line
on stderr (``kvcore run: error: argument --conversations: ...``) and exit status 2. Errors
raised later (a ``KvCoreError``, ``ValueError`` or ``OSError`` from the engine or the files it
reads) are printed the same way by ``report_errors``; ``KVCORE_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from kvcore.argtypes import (  # noqa: F401  (the commands' argument types, as ca.X)
    device,
    float_in,
    int_at_least,
    int_in,
    name_list,
    non_negative_int,
    positive_int,
    positive_int_list,
)

EXIT_USAGE = 2  # bad arguments or input
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def one_line(text: object) -> str:
    """A message on one line (lines joined by ``; ``)."""
    return "; ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def memory_size(text: str) -> int:
    """An argparse type: a memory size (``8GiB``, ``500MiB``, ``80GB``), in bytes."""
    from kvcore.errors import KvCoreError
    from kvcore.tools.planner import parse_memory

    try:
        return parse_memory(text)
    except KvCoreError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def emit_lines(lines: list[tuple[str, float, str]]) -> None:
    """Print ``name: value unit`` lines (the machine-readable report of a command)."""
    for name, value, unit in lines:
        print(f"{name}: {value:.6g} {unit}".rstrip(), flush=True)


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
