"""``EngineArgs.validate``: every engine setting checked before anything loads or binds.

One typed error (``InvalidArgumentError``, a ``KvCoreError``) per bad input, with a one-line
message; the CLI turns it into ``kvcore: error: ...`` and exit 2. The configs check their own
fields (``CacheConfig``, ``SchedulerConfig``); this module checks the rest: the model and
tokenizer arguments (a checkpoint folder's ``config.json`` and safetensors headers are read,
not the weights), dtype, seed, booleans, device threads, and that the disk tier's directory can
be written.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvcore.errors import InvalidArgumentError
from kvcore.models.dtype import DTYPE_NAMES

SEED_LIMIT = 2**63  # torch's generators take seeds below 2**64; the Rust side int64
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_checkpoint_dir(path: Path) -> None:
    """A checkpoint folder's ``config.json`` (UTF-8 JSON object) and every ``*.safetensors``
    header (length, UTF-8 JSON, offsets inside the file) are sound."""
    config = path / "config.json"
    if not config.is_file():
        raise InvalidArgumentError(f"{path} holds no config.json")
    try:
        data = json.loads(config.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidArgumentError(f"{config} is not a JSON file: {type(e).__name__}") from None
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{config} is not a JSON object")
    for weights in sorted(path.glob("*.safetensors")):
        try:
            size = weights.stat().st_size
            with weights.open("rb") as f:
                head = f.read(8)
                (n,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
                if n > size - 8 or n > 100 << 20:
                    raise ValueError("header length past the end of the file")
                header = json.loads(f.read(n).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                lo, hi = entry["data_offsets"]
                if not (_is_int(lo) and _is_int(hi) and 0 <= lo <= hi <= size - 8 - n):
                    raise ValueError(f"tensor {name} lies outside the file")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(
                f"{weights} is not a safetensors file ({type(e).__name__}: {e})"
            ) from None


def check_model(model: Any) -> None:
    if isinstance(model, str | os.PathLike):
        spec = str(model)
        if not spec:
            raise InvalidArgumentError("model must be a model name or a checkpoint path, got ''")
        path = Path(spec)
        if path.is_dir():
            check_checkpoint_dir(path)
        elif path.exists():
            raise InvalidArgumentError(f"model {spec!r} is a file, not a checkpoint directory")
        return
    if not hasattr(model, "config"):
        raise InvalidArgumentError(
            f"model must be a name, a checkpoint path or a PreTrainedModel, got "
            f"{type(model).__name__}"
        )


def check_tokenizer(tokenizer: Any) -> None:
    if tokenizer is None:
        return
    if isinstance(tokenizer, str | os.PathLike):
        if not Path(tokenizer).exists():
            raise InvalidArgumentError(f"tokenizer path {str(tokenizer)!r} does not exist")
        return
    if not (callable(getattr(tokenizer, "encode", None)) and hasattr(tokenizer, "decode")):
        raise InvalidArgumentError(
            f"tokenizer must be a path or a tokenizer object, got {type(tokenizer).__name__}"
        )


def check_disk_path(disk_path: str) -> None:
    """The disk tier's directory exists or can be made, and a file can be written in it."""
    path = Path(disk_path)
    try:
        if path.exists() and not path.is_dir():
            raise InvalidArgumentError(f"disk_path {disk_path!r} is not a directory")
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise InvalidArgumentError(
            f"disk_path {disk_path!r} is not a writable directory: {e.strerror or e}"
        ) from None


def validate(args: Any) -> None:
    """Raises ``InvalidArgumentError`` for the first bad setting of ``args`` (EngineArgs)."""
    check_model(args.model)
    check_tokenizer(args.tokenizer)
    dtype = args.dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in _FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"dtype must be one of {', '.join(DTYPE_NAMES)} or a float torch dtype, got {dtype}"
            )
    elif dtype not in DTYPE_NAMES:
        raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    if not (_is_int(args.seed) and 0 <= args.seed < SEED_LIMIT):
        raise InvalidArgumentError(f"seed must be an int in [0, 2**63), got {args.seed!r}")
    if not isinstance(args.enforce_eager, bool):
        raise InvalidArgumentError(f"enforce_eager must be a bool, got {args.enforce_eager!r}")
    if args.compile is not None and not isinstance(args.compile, bool):
        raise InvalidArgumentError(f"compile must be a bool or None, got {args.compile!r}")
    if args.threads is not None and not (_is_int(args.threads) and args.threads >= 1):
        raise InvalidArgumentError(f"threads must be an int >= 1, got {args.threads!r}")
    mml = args.max_model_len
    if mml is not None and not (_is_int(mml) and mml > 1):
        raise InvalidArgumentError(f"max_model_len must be an int > 1, got {mml!r}")
    cc = args.create_cache_config()  # the configs check their own fields
    args.create_scheduler_config()
    if cc.disk_path:
        check_disk_path(cc.disk_path)
    if args.tier_secret_file is not None:
        from kvcore.tiers.secret import load_secret

        load_secret(args.tier_secret_file, None)
