"""The value format shared by the disk tier (L3) and the shared store (L4).

One block of KV over all layers, in the cache's own storage format (each layer's byte row, so
FP8/INT4 blocks travel at their compressed size), with what it takes to refuse a wrong block:

```
b"KVT2" | u32 header length | header (JSON: fingerprint, num_layers, format, block_size, key)
        | int32 token ids [block_size] | payload (row bytes, layer after layer) | MAC
```

The MAC is HMAC-SHA256 truncated to 128 bits (the key derived from the operator's tier secret,
``kvcore.tiers.secret``; SHA-256 runs on the CPU's SHA extensions, 1.3x the speed of keyed
BLAKE2b here, ``benches/bench_tier_mac.py``) over everything before it, the block's key
included: a writer to the store who lacks the secret cannot make a value that passes, whatever
checksum it recomputes.
``decode`` returns the payload only when the magic, length, MAC, header (model fingerprint,
layer count, storage format, block size, key) and token ids all match; anything else
(truncated, corrupted, forged, foreign) is a miss (None). MAC failures are counted
(``auth_failures``) and logged once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import struct
import threading

import numpy as np

MAGIC = b"KVT2"  # KVT1: the unkeyed checksum of before; such values are foreign
_DIGEST = 16
log = logging.getLogger("kvcore")


class BlockCodec:
    """Encodes and checks block values for one engine (model, format, block size)."""

    def __init__(
        self,
        fingerprint: str,
        num_layers: int,
        kv_format: str,
        block_size: int,
        *,
        mac_key: bytes = b"",
    ):
        """``mac_key``: ``kvcore.tiers.secret.derive(secret, "mac")``; empty makes a MAC under a
        known key, an integrity check only (tests and tools, never the engine)."""
        self.fingerprint = fingerprint
        self.num_layers = num_layers
        self.kv_format = kv_format
        self.block_size = block_size
        self._key = bytes(mac_key)
        self.auth_failures = 0
        self._lock = threading.Lock()

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:_DIGEST]

    def _refused(self) -> None:
        with self._lock:
            self.auth_failures += 1
            first = self.auth_failures == 1
        if first:
            log.warning(
                "kvcore: a tier value failed its MAC check (forged, corrupted, or written with "
                "another tier secret); served as a miss (later ones: tier_auth_failures)"
            )

    def _header(self, key: bytes) -> bytes:
        return json.dumps(
            {
                "fingerprint": self.fingerprint,
                "num_layers": self.num_layers,
                "format": self.kv_format,
                "block_size": self.block_size,
                "key": key.hex(),
            },
            sort_keys=True,
        ).encode()

    def encode(self, key: bytes, tokens: np.ndarray, payload: bytes) -> bytes:
        """The stored value of one block."""
        head = self._header(key)
        body = b"".join(
            (
                MAGIC,
                struct.pack("<I", len(head)),
                head,
                np.asarray(tokens, np.int32).tobytes(),
                payload,
            )
        )
        return body + self._mac(body)

    def decode(
        self, value: bytes | None, key: bytes, tokens: np.ndarray, payload_bytes: int
    ) -> bytes | None:
        """The payload of ``value`` if it is this block's (same key, tokens, model, format,
        block size, intact); else None."""
        if value is None or len(value) < 8 + _DIGEST or value[:4] != MAGIC:
            return None
        (hlen,) = struct.unpack_from("<I", value, 4)
        head = self._header(key)
        tok = np.asarray(tokens, np.int32).tobytes()
        if hlen != len(head) or len(value) != 8 + hlen + len(tok) + payload_bytes + _DIGEST:
            return None
        body, digest = value[:-_DIGEST], value[-_DIGEST:]
        if not hmac.compare_digest(self._mac(body), digest):
            self._refused()
            return None
        if value[8 : 8 + hlen] != head or value[8 + hlen : 8 + hlen + len(tok)] != tok:
            return None
        return body[8 + hlen + len(tok) :]
