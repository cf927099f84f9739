"""The model dtype on the CPU: whether this CPU computes bfloat16 natively, and a startup hint.

kvcore's ``dtype="auto"`` keeps the checkpoint's declared dtype (SmolLM2: its upstream
``bfloat16`` where this CPU runs it at least as fast as fp32, ``cpu_runs_bf16``,
``kvcore.models.loader.auto_dtype``); the exactness tests ask for fp32 to compare token for token
with transformers' fp32 greedy decoding.
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


def cpu_runs_bf16(kvcore_eager: bool) -> bool:
    """Whether a bf16 model runs at least as fast as fp32 here: the CPU computes bf16 natively
    (``cpu_has_native_bf16``), or the forward is kvcore's own eager model code and the native
    kernels' AVX2 linear runs (an AVX2 CPU without a bf16 GEMM, e.g. Zen 3: the GEMMs of many
    rows run on fp32 copies, the few-row ones widen bf16 in registers and stream half the bytes;
    ``kvcore run`` 1.39-2.03x fp32's tokens/s there, docs/engine.md). transformers' modules or a
    compiled forward run torch's bf16 GEMM, ~10x slower than fp32's there."""
    if cpu_has_native_bf16():
        return True
    if not kvcore_eager:
        return False
    from kvcore.models.layers.linear import can_pack_small_avx2, can_prepack, prepack_on

    return prepack_on() and not can_prepack() and can_pack_small_avx2()


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
