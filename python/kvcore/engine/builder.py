"""Construction of an ``LLMEngine``: the wiring from ``EngineArgs`` to its parts.

``build(args)`` checks the settings, loads the model, sizes the KV cache (bytes per block over
the layers' formats, KIVI's residual pool, retention's KV cache groups), and builds the Rust
scheduler, the model runner, the KV tiers and the sampler, in that order. Everything that can be
refused is refused before the model loads (settings) or before any memory is allocated (sizes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from kvcore_kernels import KernelConfigError

from kvcore.config import CacheConfig, SchedulerConfig, resolve_device
from kvcore.engine.args import EngineArgs
from kvcore.engine.inputs import check_engine_args, eos_ids
from kvcore.engine.request import build_scheduler
from kvcore.engine.sampler import Sampler
from kvcore.engine.stats import EngineStats
from kvcore.errors import InvalidArgumentError, KvCoreError
from kvcore.models.loader import load_model
from kvcore.models.sizes import kivi_residual_bytes, kivi_residual_slots, kv_bytes_per_block
from kvcore.retention.h2o import H2OTracker
from kvcore.retention.release import (
    RetentionSupport,
    engine_groups,
    exact_release_window,
    kernels_take_null_entries,
)
from kvcore.retention.spec import parse_retention
from kvcore.runner.model_runner import COMPILE_BY_DEFAULT, ModelRunner
from kvcore.tiers.build import build_tier_manager, tier_scheduler_args


@dataclass
class EngineParts:
    """What ``build`` makes; ``LLMEngine`` keeps each as an attribute of the same name."""

    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    model: Any
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    retention: RetentionSupport
    h2o: H2OTracker
    sliding_window: int
    kv_groups: Any
    eos_token_ids: list[int]
    scheduler: Any
    runner: ModelRunner
    tiers: Any
    sampler: Sampler
    stats: EngineStats


def _load(model: Any, tokenizer: Any, **kw: Any) -> tuple[Any, Any]:
    """``load_model`` with what a broken checkpoint raises (bad JSON, bad UTF-8, unreadable or
    truncated files, a bad safetensors file) turned into one typed line."""
    try:
        return load_model(model, tokenizer, **kw)
    except KvCoreError:
        raise
    except (OSError, UnicodeError, ValueError, EOFError) as e:
        raise InvalidArgumentError(f"cannot load {model!r}: {type(e).__name__}: {e}") from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        raise InvalidArgumentError(f"cannot load {model!r}: SafetensorError: {e}") from None


def build(args: EngineArgs) -> EngineParts:
    """The engine's parts for ``args`` (loads the model)."""
    if not isinstance(args, EngineArgs):
        raise InvalidArgumentError(f"expected EngineArgs, got {type(args).__name__}")
    args.validate()
    cache_config = args.create_cache_config()
    scheduler_config = args.create_scheduler_config()
    parse_retention(cache_config.retention)  # RetentionError (an InvalidArgumentError)
    model, tokenizer, dtype, device = args.model, args.tokenizer, args.dtype, args.device
    max_model_len, seed, kernel_backend = args.max_model_len, args.seed, args.kernel_backend
    enforce_eager, compile = args.enforce_eager, args.compile
    if args.threads is not None:
        if not (isinstance(args.threads, int) and args.threads >= 1):
            raise InvalidArgumentError(f"threads must be an int >= 1, got {args.threads!r}")
        torch.set_num_threads(args.threads)
    dev = resolve_device(device)
    check_engine_args(seed, kernel_backend, dev)
    if max_model_len is not None and not (isinstance(max_model_len, int) and max_model_len > 1):
        raise InvalidArgumentError(f"max_model_len must be an int > 1, got {max_model_len!r}")
    # auto dtype: bf16 on an AVX2 CPU only for kvcore's eager forward (kvcore.models.dtype)
    impl = args.model_impl if args.model_impl != "auto" else os.environ.get("KVCORE_MODEL_IMPL")
    eager = impl != "transformers" and not (
        compile if compile is not None else COMPILE_BY_DEFAULT.get(dev.type, False)
    )
    model, tokenizer = _load(
        model, tokenizer, dtype=dtype, device=dev, seed=seed, kvcore_eager=eager
    )
    config = model.config
    vocab_size = int(config.vocab_size)
    limit = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
    max_model_len = min(max_model_len or limit, limit)
    cc, sc = cache_config, scheduler_config
    kv_dtype = cc.kv_dtype(model.dtype)
    block_size = cc.block_size
    formats = cc.layer_formats(int(config.num_hidden_layers))
    residual_slots = kivi_residual_slots(
        sc.max_num_seqs, sc.max_num_batched_tokens, block_size, cc.kivi_window
    )
    try:
        bytes_per_block = kv_bytes_per_block(config, block_size, kv_dtype, formats)
        reserved = kivi_residual_bytes(config, block_size, kv_dtype, formats, residual_slots)
    except KernelConfigError as e:
        raise InvalidArgumentError(f"kv_format: {e}") from None
    # Retention (docs/retention.md): policies are checked before anything runs; a hybrid
    # model's KV cache groups make a block hold one group's layers.
    retention = RetentionSupport(cc.retention, block_size, formats, config)
    h2o = H2OTracker(block_size)
    sliding_window = exact_release_window(config, cc.sliding_window_release, formats)
    kv_groups = engine_groups(config, cc, formats)
    if kv_groups is not None:
        g = kv_groups.size
        bytes_per_block = kv_bytes_per_block(config, block_size, kv_dtype, formats[:g])
    num_blocks = cc.resolve_num_blocks(bytes_per_block, dev, reserved)
    eos_token_ids = eos_ids(model, tokenizer)
    tier_args, codec = tier_scheduler_args(
        cc, sc, model, bytes_per_block, formats, secret_file=args.tier_secret_file
    )
    scheduler = build_scheduler(
        num_blocks,
        cache_config,
        scheduler_config,
        max_model_len,
        eos_token_ids[0] if eos_token_ids else None,
        sliding_window=sliding_window,
        group_windows=None if kv_groups is None else list(kv_groups.windows[1:]),
        **tier_args,
    )
    try:
        runner = ModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_dtype=kv_dtype,
            kv_formats=formats,
            kv_scale=cc.kv_scale,
            num_residual_blocks=min(residual_slots, num_blocks),
            kivi_window=cc.kivi_window,
            backend=kernel_backend,
            enforce_eager=enforce_eager,
            compile=compile,
            # "auto" leaves the choice to the runner (and $KVCORE_MODEL_IMPL)
            model_impl=None if args.model_impl == "auto" else args.model_impl,
            max_num_seqs=sc.max_num_seqs,
            max_model_len=max_model_len,
            kv_groups=kv_groups,
        )
    except KernelConfigError as e:  # e.g. int4 on a head dim that is not a multiple of 32
        raise InvalidArgumentError(f"kv_format {cc.kv_format!r}: {e}") from None
    # Kernels that cannot take null entries get the released ones filled (never read).
    releases = sliding_window > 0 or kv_groups is not None
    runner.fill_released = releases and not kernels_take_null_entries()
    tiers = None  # KV tiers (kvcore.tiers): L2 host, L3 disk, L4 Redis
    if codec is not None:
        tiers = build_tier_manager(cc, runner.kv_caches, tier_args["host_blocks"], codec)
        runner.tier_hook = tiers.apply
    sampler = Sampler(vocab_size, dev, seed=seed)
    stats = EngineStats(num_blocks=num_blocks, block_size=block_size)
    return EngineParts(
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        model=model,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        retention=retention,
        h2o=h2o,
        sliding_window=sliding_window,
        kv_groups=kv_groups,
        eos_token_ids=eos_token_ids,
        scheduler=scheduler,
        runner=runner,
        tiers=tiers,
        sampler=sampler,
        stats=stats,
    )
