"""``kvcore serve`` and ``kvcore bench serve`` (dispatched from ``kvcore.entrypoints.cli.main``)."""

from __future__ import annotations

import argparse
import logging


def serve_parser() -> argparse.ArgumentParser:
    """Flags of ``kvcore serve``: the engine's (``EngineArgs``), the server's, scale-out's."""
    from kvcore.engine.args import EngineArgs
    from kvcore.entrypoints.cli.args import Parser, float_in
    from kvcore.entrypoints.openai.args import add_server_args

    p = Parser(  # one-line errors, exit 2 (kvcore.entrypoints.cli.args)
        prog="kvcore serve", description="OpenAI-compatible HTTP server over the kvcore engine."
    )
    EngineArgs.add_cli_args(p)
    add_server_args(p)
    g = p.add_argument_group("scale-out (Ray Serve; docs/scale_out.md)")
    g.add_argument(
        "--replicas", type=int, default=1, help="engine replicas on Ray Serve (1: one process)"
    )
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (default: local)")
    g.add_argument(
        "--router",
        default="prefix",
        choices=("prefix", "p2c", "random", "ray-p2c", "ray-prefix"),
        help="request router over the replicas (ray-p2c: Ray Serve's default; "
        "ray-prefix: Ray Serve LLM's PrefixCacheAffinityRouter)",
    )
    g.add_argument("--router-threshold", type=int, default=2, help="prefix router queue slack")
    g.add_argument(
        "--router-rel-threshold",
        type=float_in(1.0),
        default=1.5,
        help="prefix router: spill only past this queue ratio too",
    )
    g.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        help="disaggregated prefill: P replicas write prompts' KV to --remote-url",
    )
    g.add_argument(
        "--decode-replicas", type=int, default=None, help="with --prefill-replicas (default 1)"
    )
    return p


def serve_main(argv: list[str]) -> int:
    """Entry of ``kvcore serve``."""
    from kvcore.engine.args import EngineArgs
    from kvcore.engine.factory import make_engine
    from kvcore.entrypoints.openai.server import make_state, run_server, start_state

    args = serve_parser().parse_args(argv)
    # Settings are refused here, in one line (exit 2), before an engine process starts.
    EngineArgs.from_cli_args(args).validate()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.replicas < 1:
        serve_parser().error(f"--replicas must be at least 1, got {args.replicas}")
    if args.prefill_replicas < 0 or (args.decode_replicas or 1) < 1:
        serve_parser().error("--prefill-replicas must be >= 0 and --decode-replicas >= 1")
    if args.prefill_replicas:
        args.replicas = args.decode_replicas or 1
    if args.replicas > 1 or args.ray_address or args.prefill_replicas:
        return _serve_replicas(argv, args)
    if args.engine_in_process:
        state = make_state(make_engine(args), args)
    else:
        state = start_state(make_engine, args)
    dtype = state.model_dtype
    print(
        f"kvcore serve: {state.model_name} on http://{args.host}:{args.port} "
        f"(dtype {dtype}, max_model_len {state.max_model_len}, "
        f"{state.engine.snapshot['num_blocks']} KV blocks)",
        flush=True,
    )
    return run_server(state, args.host, args.port, args.shutdown_grace_s, args.log_level)


def _serve_replicas(argv: list[str], args: argparse.Namespace) -> int:
    """``kvcore serve --replicas N``: the Ray Serve deployment, until SIGINT/SIGTERM."""
    import signal
    import threading

    try:
        from kvcore.scaleout.ray_app import deploy
    except ImportError as e:
        need = "kvcore serve --replicas needs Ray Serve: pip install 'ray[serve]'"
        raise SystemExit(f"{need} ({e})") from None
    from ray import serve

    kwargs = (
        {"threshold": args.router_threshold, "rel_threshold": args.router_rel_threshold}
        if args.router == "prefix"
        else {}
    )
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    deploy(
        argv,
        replicas=args.replicas,
        router=args.router,
        router_kwargs=kwargs,
        ray_address=args.ray_address,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        prefill_replicas=args.prefill_replicas,
    )
    print(
        f"kvcore serve: {args.replicas} replicas (+{args.prefill_replicas} prefill) of "
        f"{args.model} on Ray Serve, router "
        f"{args.router}, http://{args.host}:{args.port}",
        flush=True,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, on_signal)
    stop.wait()
    serve.shutdown()
    return 0


def bench_main(argv: list[str]) -> int:
    """Entry of ``kvcore bench serve``."""
    from kvcore.tools.bench_serve import main

    return main(argv)
