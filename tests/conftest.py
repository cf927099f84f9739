"""Session-wide test hooks: tests marked ``cuda`` skip where torch sees no CUDA device."""

import os

# Idle OpenMP threads sleep instead of spinning (read when torch loads): spinning threads make
# multi-threaded CPU runs many times slower when the cores are shared with other work.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
