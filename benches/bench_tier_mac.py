"""Cost of authenticating tier values: ``BlockCodec.encode``/``decode`` with the keyed MAC
(HMAC-SHA256/128 keyed by the tier secret) against the same codec with the unkeyed BLAKE2b-128
checksum it replaced, against keyed BLAKE2b (the other stdlib choice) and against the bare copy
of the payload, per block of SmolLM2-135M (30 layers,
3 KV heads, head dim 64, block 16, bf16: 368,640 bytes). Prints ``name: value unit`` lines.

    python benches/bench_tier_mac.py [--blocks 200]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np
from kvcore.tiers.codec import BlockCodec
from kvcore.tiers.secret import derive

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2


class Blake2Codec(BlockCodec):
    """The codec with BLAKE2b-128 (keyed by ``mac_key``; unkeyed when empty) as its digest."""

    def _mac(self, body: bytes) -> bytes:
        return hashlib.blake2b(body, digest_size=16, key=self._key).digest()


def rate(fn, blocks: int, repeat: int = 3) -> float:
    """Best of ``repeat`` runs, in GB/s of payload."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(blocks):
            fn()
        best = min(best, time.perf_counter() - start)
    return blocks * BLOCK_BYTES / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, default=200)
    args = p.parse_args()
    key, toks = b"k" * 32, np.arange(16)
    payload = os.urandom(BLOCK_BYTES)
    mac = derive(b"s" * 32, "mac")
    codecs = (
        ("hmac_sha256", BlockCodec("fp", 30, "auto/torch.bfloat16", 16, mac_key=mac)),
        ("blake2b_keyed", Blake2Codec("fp", 30, "auto/torch.bfloat16", 16, mac_key=mac)),
        ("blake2b_unkeyed_before", Blake2Codec("fp", 30, "auto/torch.bfloat16", 16)),
    )
    lines = [("copy_payload", rate(lambda: bytearray(payload), args.blocks), "GB/s")]
    for name, codec in codecs:
        value = codec.encode(key, toks, payload)
        lines.append(
            (
                f"encode_{name}",
                rate(lambda c=codec: c.encode(key, toks, payload), args.blocks),
                "GB/s",
            )
        )  # noqa: E501
        lines.append(
            (
                f"decode_{name}",
                rate(lambda c=codec, v=value: c.decode(v, key, toks, BLOCK_BYTES), args.blocks),
                "GB/s",
            )
        )  # noqa: E501
    for name, value, unit in lines:
        print(f"{name}: {value:.3g} {unit}", flush=True)


if __name__ == "__main__":
    main()
