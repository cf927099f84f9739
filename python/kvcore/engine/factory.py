"""The engine of parsed ``kvcore serve`` flags: the one place the server (and each Ray replica)
builds it, in the engine-core process (``kvcore.engine.core_proc``, which receives this function
by name) or in the server's own process (``--engine-in-process``)."""

from __future__ import annotations

import argparse
import sys

from kvcore.engine.args import EngineArgs
from kvcore.engine.llm_engine import LLMEngine
from kvcore.models.dtype import dtype_hint


def make_engine(args: argparse.Namespace) -> LLMEngine:
    """``LLMEngine(EngineArgs.from_cli_args(args))``; prints a hint when another dtype would be
    faster on this machine."""
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    hint = dtype_hint(args.dtype, engine.model.dtype, engine.runner.device)
    if hint:
        print(f"kvcore: {hint}", file=sys.stderr)
    return engine
