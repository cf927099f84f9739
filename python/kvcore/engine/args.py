"""EngineArgs: every engine setting, declared once (the idea of vLLM's ``EngineArgs``).

``LLM(**kwargs)``, the flags of ``kvcore run`` / ``generate`` / ``serve``, the server and the Ray
replicas are all derived from the fields below: a field's metadata names its flag, its argparse
type and its help, and ``from_cli_args`` maps the parsed flags back (MiB flags to bytes).
``LLMEngine(args)`` builds the engine; ``cache_config`` / ``scheduler_config`` split the
fields into the two configs the engine and the Rust scheduler take.

Checks run in two places, both before a model loads: argparse types while parsing flags, and
``validate`` (the configs' own checks plus the engine-level ones) for every path.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from kvcore import argtypes as at
from kvcore.config import CacheConfig, SchedulerConfig
from kvcore.errors import InvalidArgumentError
from kvcore.models.dtype import DTYPE_NAMES

MIB = 1 << 20


def _arg(default: Any, help: str, **cli: Any) -> Any:
    """A field with its CLI flag: ``flag`` (default ``--name``), ``type``, ``choices``,
    ``action``, ``unit`` (the flag counts units of this many; bytes fields take MiB), or
    ``cli=False`` for settings with no flag (objects, or Python-only knobs)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """The settings of one engine. Field names are ``LLM``'s keyword arguments."""

    # ---- model
    model: Any = _arg(
        "smollm2-135m", "smollm2-135m | gemma3-270m | tiny-llama | tiny-gemma3 | ... | a path"
    )
    tokenizer: Any = _arg(None, "a tokenizer object or path (default: the model's)", cli=False)
    dtype: Any = _arg(
        "auto",
        "model (and KV) dtype; auto: the checkpoint's (SmolLM2: bfloat16 where the CPU runs it "
        "faster than fp32: AMX/AVX512-BF16, or AVX2 with kvcore's own eager forward; else "
        "float32; docs/serving.md)",
        choices=DTYPE_NAMES,
    )
    device: Any = _arg(None, "cpu | cuda | cuda:N (default: cuda if any)", type=at.device)
    threads: int | None = _arg(None, "torch intra-op threads", type=at.positive_int)
    max_model_len: int | None = _arg(None, "longest sequence", type=at.int_at_least(2))
    seed: int = _arg(0, "sampling seed", type=at.non_negative_int)
    kernel_backend: str = _arg(
        "auto", "attention kernels: auto | triton | torch", choices=("auto", "triton", "torch")
    )
    model_impl: str = _arg(
        "auto",
        "model code: auto (kvcore's where the family has it) | kvcore | transformers",
        choices=("auto", "kvcore", "transformers"),
    )
    enforce_eager: bool = _arg(False, "no CUDA graphs", action="store_true")
    compile: bool | None = _arg(None, "torch.compile the forward (default: off)", cli=False)
    # ---- KV cache (CacheConfig)
    block_size: int = _arg(16, "tokens per KV block", type=at.positive_int)
    num_blocks: int | None = _arg(None, "KV blocks (null included)", type=at.int_at_least(2))
    kv_memory_bytes: int | None = _arg(
        None,
        "KV budget in MiB (default: generate sizes it to the request; run takes min(1 GiB, 25%% "
        "of the available RAM) on the CPU, 80%% of free GPU memory on CUDA)",
        flag="--kv-memory-mb",
        type=at.positive_int,
        unit=MIB,
    )
    kv_format: Any = _arg(
        "auto",
        "KV storage: auto | float16 | bfloat16 | fp8_e4m3 | int8 | int4 | kivi2 | ... "
        "(a comma-separated list: one per layer)",
        type=at.name_list,
    )
    kv_scale: float | None = _arg(None, "FP8 scale of K and V (None: calibrated)", cli=False)
    kivi_window: int = _arg(0, "KIVI full-precision window, blocks", cli=False)
    prefix_caching: str = _arg("radix", "prefix cache mode", choices=("radix", "hash", "off"))
    prefix_hash: str = _arg("xxh3", "chained block hash of --prefix-caching hash", cli=False)
    host_kv_bytes: int = _arg(
        0, "L2 host-memory KV tier, MiB", flag="--host-kv-mb", type=at.non_negative_int, unit=MIB
    )
    disk_path: str | None = _arg(None, "L3 disk tier directory")
    disk_bytes: int = _arg(
        1 << 30, "L3 byte cap, MiB", flag="--disk-mb", type=at.int_at_least(1), unit=MIB
    )
    remote_url: str | None = _arg(None, "L4 shared store, redis://host:port/db")
    remote_timeout_s: float = _arg(
        0.5, "per Redis call; a slower fetch is a miss", type=at.float_in(0, 60, low_open=True)
    )
    tier_secret_file: str | None = _arg(
        None,
        "file of the secret that authenticates L3/L4 values (default: $KVCORE_TIER_SECRET, "
        "else one created in the disk tier or cache directory; docs/tiers.md)",
    )
    retention: str = _arg("full", "default retention policy (docs/retention.md)", cli=False)
    sliding_window_release: bool = _arg(True, "release blocks behind a window", cli=False)
    # ---- scheduler (SchedulerConfig)
    max_num_seqs: int = _arg(256, "running sequences at most", type=at.positive_int)
    max_num_batched_tokens: int = _arg(2048, "token budget of one step", type=at.positive_int)
    long_prefill_token_threshold: int = _arg(0, "cap of one prefill chunk", cli=False)
    enable_chunked_prefill: bool = _arg(
        True,
        "compute each prompt in one step (needs a budget of --max-model-len tokens)",
        flag="--no-chunked-prefill",
        action="store_false",
    )
    policy: str = _arg("fcfs", "fcfs | priority", cli=False)
    watermark: float = _arg(0.01, "fraction of the blocks admission keeps free", cli=False)
    preemption: str = _arg("auto", "on a full pool", choices=("auto", "recompute", "swap"))
    # ---- whole configs (Python only): when given, they replace the fields above
    cache_config: CacheConfig | None = _arg(None, "a CacheConfig", cli=False)
    scheduler_config: SchedulerConfig | None = _arg(None, "a SchedulerConfig", cli=False)

    # ---- derived configs --------------------------------------------------------------

    def create_cache_config(self) -> CacheConfig:
        """The ``CacheConfig`` of these settings (``cache_config`` itself when given)."""
        if self.cache_config is not None:
            if not isinstance(self.cache_config, CacheConfig):
                raise InvalidArgumentError(
                    f"cache_config must be a CacheConfig, got {self.cache_config!r}"
                )
            return self.cache_config
        return CacheConfig(**{f.name: getattr(self, f.name) for f in fields(CacheConfig)})

    def create_scheduler_config(self) -> SchedulerConfig:
        """The ``SchedulerConfig`` of these settings (``scheduler_config`` itself when given)."""
        if self.scheduler_config is not None:
            if not isinstance(self.scheduler_config, SchedulerConfig):
                raise InvalidArgumentError(
                    f"scheduler_config must be a SchedulerConfig, got {self.scheduler_config!r}"
                )
            return self.scheduler_config
        return SchedulerConfig(**{f.name: getattr(self, f.name) for f in fields(SchedulerConfig)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """``EngineArgs(**kwargs)`` with an unknown name refused as ``InvalidArgumentError``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidArgumentError(
                f"unknown engine argument(s) {', '.join(unknown)} (see kvcore.engine.args)"
            )
        return cls(**kwargs)

    def validate(self) -> None:
        """Checks every setting before anything loads or binds (``InvalidArgumentError``,
        one line; ``kvcore.engine.validate``). ``LLMEngine`` and the CLI call it."""
        from kvcore.engine.validate import validate

        validate(self)

    def replace(self, **changes: Any) -> EngineArgs:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    # ---- the CLI ------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field that has one (metadata ``cli`` not False)."""
        for f in fields(cls):
            meta = dict(f.metadata)
            if meta.pop("cli", True) is False:
                continue
            flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
            meta.pop("unit", None)
            action = meta.get("action")
            default = f.default
            if isinstance(default, int) and not isinstance(default, bool) and "unit" in f.metadata:
                default //= f.metadata["unit"]
            if f.name == "kv_format":
                default = [default]
            if action in ("store_true", "store_false"):
                parser.add_argument(flag, dest=f.name, help=meta["help"], action=action)
            else:
                parser.add_argument(flag, dest=f.name, default=default, **meta)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The settings of parsed flags (fields without a flag keep their defaults)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.metadata.get("cli", True) is False or not hasattr(ns, f.name):
                continue
            value = getattr(ns, f.name)
            unit = f.metadata.get("unit")
            if unit and value is not None:
                value *= unit
            values[f.name] = value
        fmt = values.get("kv_format")
        if isinstance(fmt, list) and len(fmt) == 1:
            values["kv_format"] = fmt[0]
        values.update(overrides)
        return cls(**values)
