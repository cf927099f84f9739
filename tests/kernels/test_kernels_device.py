"""Device normalisation (issue 15): "cuda" becomes the current "cuda:N" wherever a device is
taken, so a plan made for "cuda" matches a cache allocated on "cuda". The CUDA logic runs here
without a GPU by standing in for torch.cuda's two queries."""

import kvcore_kernels
import numpy as np
import pytest
import torch
from kvcore_kernels import KernelConfigError, normalize_device
from kvcore_kernels.device import same_device


def test_cpu_forms_are_one_device():
    for dev in (None, "cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)):
        out = normalize_device(dev)
        assert out == torch.empty(0).device, dev
        assert out.index is None
    assert same_device("cpu:0", torch.device("cpu"))


def test_cuda_without_index_gets_current(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert normalize_device("cuda") == torch.device("cuda", 3)
    assert normalize_device(torch.device("cuda")) == torch.device("cuda", 3)
    # An explicit index is kept, whatever the current device.
    assert normalize_device("cuda:1") == torch.device("cuda", 1)
    assert normalize_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert normalize_device(2) == torch.device("cuda", 2)  # an int is a CUDA index to torch
    assert same_device("cuda", "cuda:3") and not same_device("cuda", "cuda:0")
    # The unnormalised forms are what broke the kernels' device check on a GPU.
    assert torch.device("cuda") != torch.device("cuda", 3)


def test_cuda_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KernelConfigError, match="no CUDA device"):
        normalize_device("cuda")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "", -1, True, 1.5, object(), ["cpu"]])
def test_bad_inputs(bad):
    with pytest.raises(KernelConfigError):
        normalize_device(bad)


def test_plan_and_cache_store_normalised_devices():
    meta = kvcore_kernels.plan_attention(
        np.array([0, 1]), np.array([1]), np.array([[1]]), 16, device="cpu:0"
    )
    assert meta.device == torch.device("cpu") and meta.device.index is None
    cache = kvcore_kernels.allocate_kv_cache(4, 16, 1, 8, torch.float32, "cpu:0")
    assert cache.device == meta.device
    q = torch.zeros(1, 1, 8)
    kvcore_kernels.paged_attention(q, cache, meta, scale=1.0)  # the device check passes


def test_plan_checks_device_before_laying_out():
    with pytest.raises(KernelConfigError, match="not a device"):
        kvcore_kernels.plan_attention(
            np.array([0, 1]), np.array([1]), np.array([[1]]), 16, device="gpu"
        )


@pytest.mark.cuda
def test_cuda_plan_matches_cache_allocated_on_cuda():
    meta = kvcore_kernels.plan_attention(
        np.array([0, 1]), np.array([1]), np.array([[1]]), 16, device="cuda"
    )
    cache = kvcore_kernels.allocate_kv_cache(4, 16, 1, 64, torch.float16, "cuda")
    assert meta.device == cache.device == torch.device("cuda", torch.cuda.current_device())
    q = torch.zeros(1, 1, 64, dtype=torch.float16, device="cuda")
    kvcore_kernels.paged_attention(q, cache, meta, scale=1.0)
