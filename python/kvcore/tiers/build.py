"""Engine wiring of the tiers: scheduler arguments from the configs, then the TierManager.

The key root handed to the Rust core is SHA-256 of the model fingerprint, the storage format,
the block size and the layer count, so no key of one engine can name a block of another model,
format or geometry; the namespace (``cache_salt``) is inside every key of the chain.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from kvcore.config import CacheConfig, SchedulerConfig
from kvcore.errors import InvalidArgumentError
from kvcore.tiers import BlockCodec, DiskStore, RedisStore, TierManager, model_fingerprint
from kvcore.tiers.secret import ENV, derive, load_secret

log = logging.getLogger("kvcore")


def tier_scheduler_args(
    cc: CacheConfig,
    sc: SchedulerConfig,
    model: Any,
    bytes_per_block: int,
    formats: list[str],
    *,
    secret_file: str | None = None,
) -> tuple[dict[str, Any], BlockCodec | None]:
    """Keyword arguments of ``_kvcore.Scheduler`` for the tiers, and the value codec (None and
    ``{}`` when tiers are off). The codec's MAC key and ``salt_key`` come from the tier secret
    (``kvcore.tiers.secret``; ``secret_file`` first)."""
    host_blocks = cc.host_kv_bytes // bytes_per_block if cc.host_kv_bytes else 0
    if cc.host_kv_bytes and host_blocks < 1:
        raise InvalidArgumentError(
            f"host_kv_bytes={cc.host_kv_bytes} holds no block of {bytes_per_block} bytes"
        )
    if host_blocks == 0:
        if sc.preemption == "swap":
            raise InvalidArgumentError("preemption='swap' needs a host tier (host_kv_bytes > 0)")
        return {}, None
    if any(f.startswith("kivi") for f in formats):
        raise InvalidArgumentError("KV tiers do not support KIVI formats (residual pools)")
    kv_format = ",".join(formats) if isinstance(cc.kv_format, list) else str(cc.kv_format)
    kv_format = f"{kv_format}/{cc.kv_dtype(model.dtype)}"
    shared = bool(cc.disk_path or cc.remote_url)
    if shared:
        if cc.remote_url and secret_file is None and not os.environ.get(ENV):
            log.warning(
                "kvcore: the shared KV store is authenticated with this host's local secret; "
                "replicas on other hosts need the same --tier-secret-file (or %s)",
                ENV,
            )
        secret = load_secret(secret_file, cc.disk_path)
    else:  # L2 only: nothing leaves the process
        secret = os.urandom(32)
    codec = BlockCodec(
        model_fingerprint(model),
        int(model.config.num_hidden_layers),
        kv_format,
        cc.block_size,
        mac_key=derive(secret, "mac"),
    )
    codec.salt_key = derive(secret, "salt")  # type: ignore[attr-defined]
    root = hashlib.sha256(
        f"{codec.fingerprint}|{kv_format}|{cc.block_size}|{codec.num_layers}".encode()
    ).digest()
    args = {
        "host_blocks": host_blocks,
        "tier_fetch": bool(cc.disk_path or cc.remote_url),
        "tier_publish": bool(cc.disk_path or cc.remote_url),
        "tier_root": root,
        "bytes_per_block": bytes_per_block,
        "preemption": sc.preemption,
    }
    return args, codec


def build_tier_manager(
    cc: CacheConfig, kv_caches: list[Any], host_blocks: int, codec: BlockCodec
) -> TierManager:
    """The TierManager for an engine's caches."""
    disk = DiskStore(cc.disk_path, cc.disk_bytes) if cc.disk_path else None
    remote = RedisStore(cc.remote_url, timeout_s=cc.remote_timeout_s) if cc.remote_url else None
    return TierManager(
        kv_caches,
        host_blocks,
        codec,
        disk=disk,
        remote=remote,
        fetch_timeout_s=max(2.0, 4 * cc.remote_timeout_s),
    )
