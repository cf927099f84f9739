"""The value format shared by the disk tier (L3) and the shared store (L4).

One block of KV over all layers, in the cache's own storage format (each layer's byte row, so
FP8/INT4 blocks travel at their compressed size), with what it takes to refuse a wrong block:

```
b"KVT1" | u32 header length | header (JSON: fingerprint, num_layers, format, block_size, key)
        | int32 token ids [block_size] | payload (row bytes, layer after layer) | BLAKE2b-128
```

The checksum covers everything before it. ``decode`` returns the payload only when the magic,
length, checksum, header (model fingerprint, layer count, storage format, block size, key) and
token ids all match; anything else (truncated, corrupted, foreign) is a miss (None).
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

MAGIC = b"KVT1"
_DIGEST = 16


class BlockCodec:
    """Encodes and checks block values for one engine (model, format, block size)."""

    def __init__(self, fingerprint: str, num_layers: int, kv_format: str, block_size: int):
        self.fingerprint = fingerprint
        self.num_layers = num_layers
        self.kv_format = kv_format
        self.block_size = block_size

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
        return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()

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
        if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
            return None
        if value[8 : 8 + hlen] != head or value[8 + hlen : 8 + hlen + len(tok)] != tok:
            return None
        return body[8 + hlen + len(tok) :]
