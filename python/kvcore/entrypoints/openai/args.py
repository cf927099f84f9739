"""The OpenAI server's own settings (the engine's are ``EngineArgs``): flags of ``kvcore serve``
that the server and the Ray ingress read. Ranges are checked while parsing (exit 2)."""

from __future__ import annotations

import argparse
import os

from kvcore import argtypes as at


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Add the server's flags to ``p``."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=at.int_in(0, 65535), default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("KVCORE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $KVCORE_API_KEY)",
    )
    p.add_argument("--served-model-name", default=None, help="model id clients send (--model)")
    p.add_argument(
        "--max-waiting",
        type=at.non_negative_int,
        default=1024,
        help="answer 503 + Retry-After beyond this many waiting requests (0: no limit)",
    )
    p.add_argument(
        "--max-n", type=at.positive_int, default=128, help="largest n (capped by --max-num-seqs)"
    )
    p.add_argument(
        "--max-body-bytes", type=at.positive_int, default=4 << 20, help="request body cap (413)"
    )
    p.add_argument(
        "--metrics-prefix",
        default="kvcore",
        choices=("kvcore", "vllm"),
        help="metric names: kvcore:* or vllm:*",
    )
    p.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_false",
        help="turn off the live page /dashboard (docs/serving.md, Dashboard)",
    )
    p.add_argument("--shutdown-grace-s", type=at.float_in(0, 3600), default=10.0)
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="step the engine in a thread of the server process (default: its own process, "
        "so HTTP and text never compete with the forward for one GIL)",
    )
    p.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error", "critical")
    )
