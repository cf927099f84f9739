"""Pure-torch encode/decode of every quantized format: the reference the Triton kernels match.

Per-token formats (fp8, int8, int4, int2) encode ``x: [T, H, D]`` token by token; KIVI encodes
whole blocks ``[n, bs, H, D]`` (keys per channel over the block's tokens, values per token).
Arithmetic is fp32; scales are rounded to their storage dtype BEFORE the codes are computed, so
decoding reproduces exactly what the encoder assumed. Layouts: ``formats`` module docstring.
"""

from __future__ import annotations

import torch

from kvcore_kernels.quant.formats import KCODE_EXP_BIAS, KCODE_MAX, KCODE_MIN, ZP_STEPS, KVFormat

FP16_TINY = 2.0**-14  # smallest normal fp16: the floor of every stored scale
FP16_MAX = 65504.0
FP8_MARGIN = 4.0  # calibrated fp8 scales leave this much headroom above the calibration amax
# (a short first prefill underestimates the range; fp8's relative precision does not depend on
# the scale, so headroom costs only the 2 smallest of ~15 binades)


def rotation_matrix(dim: int, seed: int = 0) -> torch.Tensor:
    """float32 ``[dim, dim]`` orthonormal: seeded random sign flips, then a Hadamard transform
    (a seeded random orthogonal matrix when ``dim`` is not a power of two)."""
    gen = torch.Generator().manual_seed(seed)
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:  # Sylvester's construction
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1
        return signs[:, None] * h / dim**0.5  # flip input signs, then mix
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen))
    return q * torch.sign(torch.diagonal(r))[None, :]


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., D]`` (each < 2**bits) into ``[..., D * bits / 8]`` uint8."""
    if bits == 8:
        return q.to(torch.uint8)
    per = 8 // bits
    shifts = torch.arange(per, device=q.device, dtype=torch.int32) * bits
    q = q.to(torch.int32).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    return (q << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: ``[..., Dp]`` uint8 -> int32 codes ``[..., Dp * 8 / bits]``."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    q = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def rnd(x: torch.Tensor) -> torch.Tensor:
    """Round half up, ``floor(x + 0.5)``: the rounding every encoder (and kernel) uses."""
    return torch.floor(x + 0.5)


def _scale16(s: torch.Tensor) -> torch.Tensor:
    """fp32 scales rounded to their fp16 storage (kept finite and > 0), as fp32."""
    return s.clamp(FP16_TINY, FP16_MAX).to(torch.float16).float()


def fp8_max(fmt: KVFormat) -> float:
    """Largest finite value of the format's FP8 type."""
    assert fmt.fp8_dtype is not None
    return float(torch.finfo(fmt.fp8_dtype).max)


FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}  # mantissa bits, min exp
MAGIC = 12582912.0  # 1.5 * 2**23: (y + MAGIC) - MAGIC rounds y to an integer, half to even


def fp8_round(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 ``y`` (already within the format's range) to the nearest FP8 value, ties to
    even, in fp32 arithmetic, so the cast that follows is exact. Done by hand (bits for normal
    numbers, a magic-number add for subnormals) so that every backend rounds identically."""
    mant, min_exp = FP8_GRID[dtype]
    drop = 23 - mant
    bits = y.view(torch.int32)
    lsb = (bits >> drop) & 1
    normal = ((bits + (1 << (drop - 1)) - 1 + lsb) >> drop << drop).view(torch.float32)
    step = 2.0 ** (min_exp - mant)  # subnormal spacing
    sub = ((y / step + MAGIC) - MAGIC) * step
    return torch.where(y.abs() >= 2.0**min_exp, normal, sub)


def fp8_calibrate(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """float32 ``[H]`` scales from a calibration sample ``x: [T, H, D]`` (per head or tensor)."""
    amax = x.float().abs().amax(dim=(0, 2))  # [H]
    if fmt.per_tensor:
        amax = amax.amax().expand_as(amax)
    scale = amax * (FP8_MARGIN / fp8_max(fmt))
    return torch.where(scale > 0, scale, torch.ones_like(scale)).contiguous()


def zp_encode(lo: torch.Tensor, hi: torch.Tensor, levels: int):
    """Group ``[lo, hi]`` (fp32) -> (e5m3 scale code, scale, int8 zero point ``z``) with the
    grid ``z * s / ZP_STEPS + q * s``, q = 0..levels: ``z = floor(lo * 8 / s)`` starts the grid
    at most ``s / 8`` below ``lo``, and ``s >= (hi - lo) / (levels - 1/8)`` (rounded up) still
    reaches ``hi``. ``s`` is raised where ``lo / s`` would leave int8's range (groups far from
    0 relative to their width)."""
    need = (hi - lo) / (levels - 1.0 / ZP_STEPS)
    need = torch.maximum(need, torch.where(lo < 0, -lo / 16.0, lo / 15.875))
    code = kcode_encode(need)
    s = kcode_to_scale(code)
    z = torch.floor(lo * ZP_STEPS / s).clamp(-128, 127)
    return code, s, z.to(torch.int8)


def zp_min(z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The grid start ``z * s / ZP_STEPS`` (fp32, exact) of int8 zero points and scales."""
    return z.float() * s / ZP_STEPS


def encode_tokens(
    fmt: KVFormat, x: torch.Tensor, fp8_scale: torch.Tensor | None = None, which: int = 0
):
    """Encode ``x: [T, H, D]`` (K if ``which == 0``, else V); returns the codec parts with a
    leading ``[T, ...]`` (``formats.token_regions`` names their regions).

    fp8: ``data``; int8: ``data, scale``; int4 / int2: ``data, scale, min`` in groups of
    ``fmt.groups[which]`` (int4's scale is an e5m3 code; with ``fmt.min8`` its min is an int8
    zero point, ``zp_encode``). ``fp8_scale``: float32 ``[H]`` (fp8 only).
    """
    x = x.float()
    if fmt.kind == "fp8":
        assert fp8_scale is not None
        limit = fp8_max(fmt)
        y = (x / fp8_scale[:, None]).clamp(-limit, limit)
        return {"data": fp8_round(y, fmt.fp8_dtype).to(fmt.fp8_dtype)}
    if fmt.kind == "int8":
        s = _scale16(x.abs().amax(-1) / 127.0)  # [T, H]
        q = rnd(x / s[..., None]).clamp(-127, 127).to(torch.int8)
        return {"data": q, "scale": s.half()}
    t, h, d = x.shape
    group = fmt.groups[which]
    xg = x.view(t, h, d // group, group)
    levels = (1 << fmt.bits) - 1
    if fmt.min8:  # int8 zero point in eighths of the scale (zp_encode)
        code, s, lo_code = zp_encode(xg.amin(-1), xg.amax(-1), levels)
        lo = zp_min(lo_code, s)
        q = rnd((xg - lo[..., None]) / s[..., None]).clamp(0, levels)
        return {"data": pack_codes(q.view(t, h, d), fmt.bits), "scale": code, "min": lo_code}
    lo = xg.amin(-1).clamp(-FP16_MAX, FP16_MAX).half().float()
    lo_code = lo.half()
    if fmt.bits == 4:
        code = kcode_encode((xg.amax(-1) - lo) / levels)
        s = kcode_to_scale(code)
    else:
        s = _scale16((xg.amax(-1) - lo) / levels)
        code = s.half()
    q = rnd((xg - lo[..., None]) / s[..., None]).clamp(0, levels)
    return {"data": pack_codes(q.view(t, h, d), fmt.bits), "scale": code, "min": lo_code}


def decode_tokens(
    fmt: KVFormat, parts: dict, fp8_scale: torch.Tensor | None = None, which: int = 0
):
    """Decode codec parts ``[T, ...]`` of K (``which == 0``) or V back to float32 ``[T, H, D]``."""
    data = parts["data"]
    if fmt.kind == "fp8":
        assert fp8_scale is not None
        return data.float() * fp8_scale[:, None]
    if fmt.kind == "int8":
        return data.float() * parts["scale"].float()[..., None]
    q = unpack_codes(data, fmt.bits).float()
    t, h, d = q.shape
    group = fmt.groups[which]
    qg = q.view(t, h, d // group, group)
    s = kcode_to_scale(parts["scale"]) if fmt.bits == 4 else parts["scale"].float()
    lo = zp_min(parts["min"], s) if fmt.min8 else parts["min"].float()
    return (qg * s[..., None] + lo[..., None]).view(t, h, d)


def kcode_encode(scale: torch.Tensor) -> torch.Tensor:
    """Scales (float32 >= 0; KIVI keys, int4) to uint8 codes, an unsigned 8-bit float: 5
    exponent bits (bias ``KCODE_EXP_BIAS``) and 3 mantissa bits, rounded UP so the encoded range
    covers the group's (at most 12.5% coarser than exact). Exact everywhere (fp32 bits)."""
    bits = scale.float().clamp(KCODE_MIN, KCODE_MAX).view(torch.int32)
    bits = (bits + ((1 << 20) - 1)) & ~((1 << 20) - 1)  # round the mantissa up to 3 bits
    exponent = (bits >> 23) - 127 + KCODE_EXP_BIAS
    return ((exponent << 3) | ((bits >> 20) & 7)).to(torch.uint8)


def kcode_to_scale(code: torch.Tensor) -> torch.Tensor:
    """float32 scale of an e5m3 scale code (inverse of ``kcode_encode``, exact)."""
    c = code.to(torch.int32)
    return (((c >> 3) - KCODE_EXP_BIAS + 127) << 23 | (c & 7) << 20).view(torch.float32)


def kivi_encode_blocks(
    fmt: KVFormat, k: torch.Tensor, v: torch.Tensor, fills: torch.Tensor | None = None
) -> dict:
    """Encode whole blocks ``k, v: [n, bs, H, D]``; rows at or past ``fills[i]`` (int ``[n]``,
    default all ``bs``) are ignored by the key statistics (they hold nothing yet).

    Returns ``data [n, 2, bs, H, Dp]``, ``kmin/kcode [n, H, D]``, ``vscale/vmin [n, bs, H]``.
    """
    levels = (1 << fmt.bits) - 1
    k, v = k.float(), v.float()
    if fills is None:
        lo, hi = k.amin(1), k.amax(1)  # [n, H, D]
    else:
        valid = torch.arange(k.shape[1], device=k.device)[None, :] < fills[:, None]  # [n, bs]
        valid = valid[:, :, None, None]
        lo = torch.where(valid, k, torch.inf).amin(1)
        hi = torch.where(valid, k, -torch.inf).amax(1)
        empty = ~torch.isfinite(lo)  # a block with no valid row: any finite statistics
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    kmin = lo.clamp(-FP16_MAX, FP16_MAX).half().float()
    kcode = kcode_encode((hi - kmin) / levels)
    ks = kcode_to_scale(kcode)
    qk = rnd((k - kmin[:, None]) / ks[:, None]).clamp(0, levels)
    vlo = v.amin(-1).clamp(-FP16_MAX, FP16_MAX).half().float()  # [n, bs, H]
    vs = _scale16((v.amax(-1) - vlo) / levels)
    qv = rnd((v - vlo[..., None]) / vs[..., None]).clamp(0, levels)
    data = torch.stack((pack_codes(qk, fmt.bits), pack_codes(qv, fmt.bits)), dim=1)
    return {
        "data": data,
        "kmin": kmin.half(),
        "kcode": kcode,
        "vscale": vs.half(),
        "vmin": vlo.half(),
    }


def kivi_decode_blocks(fmt: KVFormat, parts: dict, which: int) -> torch.Tensor:
    """Decode K (``which=0``) or V (``which=1``) of blocks: float32 ``[n, bs, H, D]``."""
    q = unpack_codes(parts["data"][:, which], fmt.bits).float()  # [n, bs, H, D]
    if which == 0:
        return q * kcode_to_scale(parts["kcode"])[:, None] + parts["kmin"].float()[:, None]
    return q * parts["vscale"].float()[..., None] + parts["vmin"].float()[..., None]
