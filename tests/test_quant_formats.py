"""Quantized formats: memory targets, codec error bounds, configuration errors before allocation."""

import pytest
import torch
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant import (
    FORMATS,
    allocate_kv_caches,
    bytes_per_token,
    check_format,
    get_format,
)
from kvcore_kernels.quant.codecs import (
    decode_tokens,
    encode_tokens,
    fp8_calibrate,
    fp8_round,
    kcode_encode,
    kcode_to_scale,
    kivi_decode_blocks,
    kivi_encode_blocks,
    pack_codes,
    rotation_matrix,
    unpack_codes,
    zp_encode,
    zp_min,
)

TARGETS = {"fp8_e4m3": 0.53, "fp8_e5m2": 0.53, "int8": 0.53, "int4": 0.30, "kivi2": 0.19}


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
def test_memory_targets_metadata_included(head_dim, num_kv_heads):
    fp16 = bytes_per_token("auto", num_kv_heads, head_dim, 16, torch.float16)
    assert fp16 == 4 * num_kv_heads * head_dim
    for name, target in TARGETS.items():
        ratio = bytes_per_token(name, num_kv_heads, head_dim, 16, torch.float16) / fp16
        assert ratio <= target, (name, ratio)
    # The KIVI baseline spends the same memory as KIVI-2.
    assert bytes_per_token("int2", 3, 64, 16, torch.float16) == bytes_per_token(
        "kivi2", 3, 64, 16, torch.float16
    )


def test_unknown_format_and_unservable_geometry_fail_before_allocation():
    huge = 1 << 40  # would fail loudly if anything were allocated
    with pytest.raises(KernelConfigError, match="unknown KV format"):
        allocate_kv_caches("int3", 2, huge, 16, 2, 64, torch.float16, "cpu")
    with pytest.raises(KernelConfigError, match="multiple of 32"):
        allocate_kv_caches("int4", 2, huge, 16, 2, 48, torch.float16, "cpu")
    with pytest.raises(KernelConfigError, match="model dtype"):
        allocate_kv_caches("int8", 2, huge, 16, 2, 64, torch.int8, "cpu")
    with pytest.raises(KernelConfigError, match="needs 3 entries"):
        allocate_kv_caches(["int8", "auto"], 3, huge, 16, 2, 64, torch.float16, "cpu")
    with pytest.raises(KernelConfigError, match="unknown KV format"):
        allocate_kv_caches(["int8", "int5", "auto"], 3, huge, 16, 2, 64, torch.float16, "cpu")
    with pytest.raises(KernelConfigError, match="block_size >= 2"):
        check_format("kivi2", head_dim=64, dtype=torch.float16, block_size=1)
    with pytest.raises(KernelConfigError, match="fp8_scales"):
        allocate_kv_caches("fp8_e4m3", 2, huge, 16, 2, 64, torch.float16, "cpu", fp8_scales=-1.0)
    with pytest.raises(KernelConfigError, match="rotate"):
        allocate_kv_caches("int4", 2, huge, 16, 2, 64, torch.float16, "cpu", rotate="q")


def test_mixed_list_gives_plain_tensors_for_auto_layers():
    caches = allocate_kv_caches(["auto", "int8", "kivi2"], 3, 6, 16, 2, 64, torch.float32, "cpu")
    assert isinstance(caches[0], torch.Tensor) and caches[0].shape == (6, 2, 16, 2, 64)
    assert caches[1].fmt.name == "int8" and caches[2].fmt.name == "kivi2"
    assert caches[1].buffer.shape[0] == caches[2].buffer.shape[0] == 6


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_roundtrip(bits):
    q = torch.randint(0, 1 << bits, (5, 3, 64))
    assert torch.equal(unpack_codes(pack_codes(q, bits), bits), q.to(torch.int32))


def test_fp8_rounding_matches_torch_cast():
    x = torch.cat([torch.randn(4000) * 30, torch.randn(4000) * 1e-3]).clamp(-448, 448)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert torch.equal(fp8_round(x, dtype).to(dtype).float(), x.to(dtype).float())


def test_zero_point_grid_covers_the_group_within_an_eighth_step():
    x = torch.cat([torch.randn(4000, 16) * 3, torch.randn(500, 16) * 1e-3 + 5, torch.zeros(1, 16)])
    lo, hi = x.amin(-1), x.amax(-1)
    code, s, z = zp_encode(lo, hi, 15)
    start = zp_min(z, s)
    assert (start <= lo).all() and (start + 15 * s >= hi).all()
    centred = lo.abs() < 15 * s  # the int8 range binds only for groups far from 0
    assert (lo - start)[centred].le(s[centred] / 8 * 1.0001).all()
    assert torch.equal(kcode_to_scale(code), s)


def test_scale_code_rounds_up_within_an_eighth():
    s = torch.rand(10000) * 100 + 1e-3
    back = kcode_to_scale(kcode_encode(s))
    assert (back >= s).all() and (back <= s * 1.125 + 1e-12).all()


def test_rotation_is_orthonormal():
    for d in (64, 96):
        r = rotation_matrix(d)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "int4", "int4_k8", "int2", "fp8_e4m3", "fp8_e5m2"])
def test_token_codecs_error_bounds(name):
    fmt = get_format(name)
    x = torch.randn(50, 3, 64) * 4
    scale = fp8_calibrate(fmt, x) if fmt.kind == "fp8" else None
    parts = encode_tokens(fmt, x, scale)
    y = decode_tokens(fmt, parts, scale)
    err = (y - x).abs()
    if fmt.kind == "fp8":  # relative rounding of the format (normal numbers)
        rel = 2.0 ** -(4 if name == "fp8_e4m3" else 3)
        assert (err <= x.abs() * rel + 1e-3).all()
    elif name == "int8":  # half a step of amax / 127
        step = x.abs().amax(-1, keepdim=True) / 127
        assert (err <= step * 0.51 + 1e-6).all()
    else:  # half a step of the group's range (K groups: fmt.groups[0])
        levels = 15 if fmt.bits == 4 else 3
        g = fmt.groups[0]
        xg = x.view(50, 3, 64 // g, g)
        lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        slack = 1.125 if fmt.bits == 4 else 1.001
        step = (hi - lo) / levels * slack
        if fmt.min8:  # the zero point's scale (codecs.zp_encode), rounded up by <= 1/8
            need = torch.maximum(
                (hi - lo) / (levels - 0.125), torch.where(lo < 0, -lo, lo) / 15.875
            )
            step = need * slack
        assert (err.view(50, 3, 64 // g, g) <= step * 0.5 + 1e-3).all()


def test_kivi_codec_keys_per_channel_values_per_token():
    fmt = get_format("kivi2")
    k = torch.randn(4, 16, 2, 64)
    k[..., 7] += 20.0  # an outlier channel: per-channel statistics are unaffected elsewhere
    v = torch.randn(4, 16, 2, 64)
    fills = torch.tensor([16, 16, 5, 16])
    parts = kivi_encode_blocks(fmt, k, v, fills)
    kd, vd = kivi_decode_blocks(fmt, parts, 0), kivi_decode_blocks(fmt, parts, 1)
    valid = torch.arange(16)[None, :] < fills[:, None]
    krange = torch.where(valid[..., None, None], k, torch.nan)
    kstep = (krange.nan_to_num(-1e9).amax(1) - krange.nan_to_num(1e9).amin(1)) / 3
    kerr = (kd - k).abs()[valid]  # [rows, H, D]
    bound = kstep[:, None].expand(-1, 16, -1, -1)[valid] * 0.5 * 1.125 + 1e-2
    assert (kerr <= bound).all()
    vstep = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / 3
    assert ((vd - v).abs() <= vstep * 0.51 + 1e-2).all()


def test_registry_lists_every_issue_format():
    for name in ("fp8_e4m3", "fp8_e5m2", "int8", "int4", "kivi2", "kivi4", "int2"):
        assert name in FORMATS
