"""The model dtype on the CPU: whether this CPU computes bfloat16 natively, and a startup hint.

kvcore's ``dtype="auto"`` keeps the checkpoint's declared dtype (SmolLM2: its upstream
``bfloat16`` where this CPU computes it natively, ``kvcore.models.loader.auto_dtype``); the
exactness tests ask for fp32 to compare token for token with transformers' fp32 greedy decoding.
On a CPU with native bfloat16 (Intel AMX-BF16 or AVX512-BF16: Sapphire Rapids and later, Zen 4
and later) oneDNN runs a bf16 linear several times faster than fp32 (docs/serving.md, "Model
dtype"), so ``kvcore run``/``kvcore serve`` print one line suggesting ``--dtype bfloat16`` when
they run fp32 on such a CPU without having been asked for fp32.
"""

from __future__ import annotations

import functools

import torch

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")  # the --dtype choices (LLM(dtype=))
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names of native bf16 compute


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has AMX-BF16 or AVX512-BF16 (torch's own probe, else /proc/cpuinfo)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private torch.cpu API
    try:
        return any(bool(getattr(torch.cpu, name)()) for name in probes)
    except (AttributeError, RuntimeError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in BF16_CPU_FLAGS)
    except OSError:
        pass
    return False


def dtype_hint(asked: str, model_dtype: torch.dtype, device: torch.device) -> str | None:
    """One line suggesting ``--dtype bfloat16``, or None: only when the dtype was left to the
    checkpoint (``asked == "auto"``), it came out fp32, and the CPU computes bf16 natively."""
    if asked != "auto" or model_dtype != torch.float32 or device.type != "cpu":
        return None
    if not cpu_has_native_bf16():
        return None
    return (
        "hint: running float32 on a CPU with native bfloat16 (AMX/AVX512-BF16); "
        "--dtype bfloat16 computes ~3x faster (docs/serving.md, Model dtype)"
    )
