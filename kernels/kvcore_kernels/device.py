"""Device normalisation: every device the kernels take is compared in one canonical form.

``torch.device("cuda")`` does not compare equal to a tensor's ``cuda:0``, so a plan made for
``"cuda"`` refused a cache allocated on ``"cuda"`` (its tensors report ``cuda:0``). Every entry
point that takes a device normalises it here: an index-less accelerator device gets the current
index (``torch.cuda.current_device()`` for CUDA); ``"cpu:0"`` becomes ``cpu`` (what CPU tensors
report). Bottom layer: imports nothing else from the package but the error type.
"""

from __future__ import annotations

import torch

from kvcore_kernels.errors import KernelConfigError


def normalize_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as the ``torch.device`` a tensor allocated there reports.

    ``None`` -> cpu; ``"cuda"`` -> ``cuda:<current>``; ``"cuda:1"`` / ``torch.device`` / an int
    (a CUDA index, as torch reads it) kept with their index; ``"cpu:0"`` -> ``cpu``. Raises
    ``KernelConfigError`` for anything that is not a device (bad strings, bools, negative ints).
    """
    if device is None:
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, str | int | torch.device):
        raise KernelConfigError(f"device must be a torch.device, str or int, got {device!r}")
    if isinstance(device, int) and device < 0:
        raise KernelConfigError(f"device index must be >= 0, got {device}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise KernelConfigError(f"not a device: {device!r} ({e})") from None
    if dev.type == "cpu":
        return torch.device("cpu")  # CPU tensors report no index
    if dev.index is not None:
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise KernelConfigError("device 'cuda' asked for, but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    module = getattr(torch, dev.type, None)  # xpu, mps, ...: their own current index
    current = getattr(module, "current_device", None)
    return torch.device(dev.type, current()) if callable(current) else torch.device(dev.type, 0)


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` name the same device once normalised."""
    return normalize_device(a) == normalize_device(b)
