"""KV storage formats: the registry, their per-block byte layouts and their configuration checks.

A quantized layer cache is ONE ``uint8`` tensor ``[num_blocks, block_bytes]``: every byte a
block needs (codes, scales, zero points) sits in that block's row, so copying, sharing or
moving a block (copy-on-write, tier moves) carries its metadata with it. A row is ``H``
head segments of ``head_bytes`` each (``block_bytes = H * head_bytes``): everything one KV head
of one block holds, codes first (K then V), its scales right after them, so the attention
kernel's tile of one KV head is one contiguous run of codes plus one of scales (docs/kernels.md,
"Quantized layouts")::

    row = [ head 0 | head 1 | ... | head H-1 ]      head segment = [ data | scales... | pad ]

Each format cuts a head segment into named regions (``H`` = num_kv_heads, ``D`` = head_dim,
``bs`` = block_size, ``G = D / 32``); shapes are per head segment::

    format     region  per-head shape         dtype    meaning
    fp8_*      data    [2, bs, D]             float8   x / s_head          (s: float32 [2, H],
                                                                           per layer, not per block)
    int8       data    [2, bs, D]             int8     round(x / s)        symmetric
               scale   [2, bs]                float16  s = amax / 127      per token per head
    int4       data    [2, bs, D/2]           uint8    2 codes per byte    asymmetric
               kscale  [bs, D/16]             uint8    s = range / 15 as an e5m3 code (below)
               kmin    [bs, D/16]             int8     z: x = (q + z / 8) * s  (zero point, below)
               vscale  [bs, D/32]             uint8    values: groups of 32
               vmin    [bs, D/32]             int8
    int4_k8    as int4 with keys in groups of 8: kscale / kmin [bs, D/8]
    int2       data    [2, bs, D/4]           uint8    4 codes per byte    plain per-token 2-bit
               kscale  [bs, G]                float16  s = range / 3       (the KIVI baseline)
               kmin    [bs, G]                float16  x = q * s + min
               vscale  [bs, G], vmin [bs, G]  float16  the same for values
    kivi2/4    data    [2, bs, D*b/8]         uint8    packed codes        b = 2 or 4 bits
               kmin    [D]                    float16  keys: per channel over the block's tokens
               vscale  [bs]                   float16  values: per token (group = D)
               vmin    [bs]                   float16  x = q * s + min
               kcode   [D]                    uint8    s as an e5m3 code (below)

The typed views the torch code uses (``QuantKVCache.views``) put the head axis back where the
model's ``[2, bs, H, ...]`` order has it (``Region.head_axis``), so the codecs see logical shapes
(``data [nb, 2, bs, H, Dp]``, ``kmin [nb, H, D]``, ``vscale [nb, bs, H]``) over the new bytes.

Packed codes: element ``d`` of a row lives in byte ``d * b // 8`` at bit ``(d % (8 // b)) * b``.
An e5m3 code is a scale as an unsigned 8-bit float (5 exponent bits, bias 16, 3 mantissa bits:
2^-16 .. 61440) rounded UP, so the encoded range always covers the group's (at most 12.5%
coarser than exact). int4's minimum is an int8 zero point ``z`` in eighths of the scale
(``codecs.zp_encode``): the grid starts at ``z * s / 8``, at most ``s / 8`` below the group's
minimum, and the scale is sized so that the grid still reaches the maximum, so the error stays
within half a step. It costs one byte where an fp16 minimum costs two, which pays for int4's key
groups of 16 (keys are what suffers at 4 bits) at int4's old bytes per token. (An integer zero
point, z in whole steps, snaps the grid by up to a step: +2% perplexity on SmolLM2; an FP8
minimum is off by up to 1/8 of the minimum itself, about a step for centred groups.)

Key rotation (``KVFormat.rotate``): formats marked "k" store ``k @ R`` and attention uses
``q @ R`` (``R``: a D x D orthonormal Hadamard matrix with seeded random signs, QuaRot's
incoherence processing), which leaves every score ``q . k`` unchanged but spreads a few large
key channels over all of them, so per-token groups quantize far better; "v" does the same to
values and rotates the attention output back (``out @ R^T``). Measured on SmolLM2 (README).

Why these metadata types (bytes per token per head for D = 64, bs = 16; fp16 K+V = 256):
int8 64+2 per K or V = 0.516 (an fp32 scale would be 0.531, over the 0.53 target); int4 with
an fp16 scale and an fp16 min is 0.3125, with an e5m3 scale code and an fp16 min 0.297 (an
integer zero point also fits, 0.297, but snaps the grid to multiples of the scale: +2% more
perplexity on SmolLM2); kivi2 with an fp16 scale and min per key channel per block is 0.203,
with an e5m3 code and an fp16 min 0.1875. The
int2 baseline spends the same 0.1875 on an fp16 scale and min per group of 32. KIVI's partial
last block (and an optional window of recent full blocks) is kept in the model dtype in a small
residual pool (``kvcore_kernels.quant.residual``), counted per request by the capacity planner,
not per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore_kernels.errors import KernelConfigError

MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GROUP = 32  # default int4 / int2 group along the head dimension
ZP_STEPS = 8  # an int8 zero point counts the grid start in 1/8 steps of the scale
ROW_ALIGN = 16  # block rows are padded to a multiple of this many bytes
KCODE_EXP_BIAS = 16  # KIVI key scale code: an unsigned e5m3 float, 2^(e - 16) * (1 + m / 8)
KCODE_MIN = 2.0**-16  # code 0
KCODE_MAX = 1.875 * 2.0**15  # code 255
TRITON_HEAD_DIMS = (64, 128, 256)  # what the Triton kernels compile for (CUDA devices)


@dataclass(frozen=True)
class KVFormat:
    """One storage format: how a token's K and V are encoded and what metadata it needs."""

    name: str
    kind: str  # "model" | "fp8" | "int8" | "intg" (groupwise per token) | "kivi"
    bits: int  # bits per stored element (0 for "model": the model dtype)
    fp8_dtype: torch.dtype | None = None
    per_tensor: bool = False  # fp8: one scale per layer for K and V instead of one per head
    description: str = ""
    rotate: str = ""  # "", "k", "v" or "kv": Hadamard-rotate keys / values (docstring)
    groups: tuple[int, int] = (GROUP, GROUP)  # intg: K and V group sizes along the head dim
    min8: bool = False  # intg: group minima as int8 zero points in 1/8 steps (else fp16)

    @property
    def quantized(self) -> bool:
        """Whether the cache is a ``QuantKVCache`` (False: a plain model-dtype tensor)."""
        return self.kind != "model"

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits if self.bits in (2, 4) else 1


FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("auto", "model", 0, description="the model dtype (no quantization)"),
        KVFormat("fp8_e4m3", "fp8", 8, torch.float8_e4m3fn, False, "FP8 E4M3, per-head", "k"),
        KVFormat("fp8_e5m2", "fp8", 8, torch.float8_e5m2, False, "FP8 E5M2, per-head", "k"),
        KVFormat("fp8_e4m3_tensor", "fp8", 8, torch.float8_e4m3fn, True, "FP8 E4M3", "k"),
        KVFormat("fp8_e5m2_tensor", "fp8", 8, torch.float8_e5m2, True, "FP8 E5M2", "k"),
        KVFormat("int8", "int8", 8, description="INT8 symmetric, scale per token per head"),
        KVFormat(
            "int4",
            "intg",
            4,
            description="INT4 asymmetric, K groups of 16, V groups of 32, 8-bit minima",
            rotate="k",
            groups=(16, 32),
            min8=True,
        ),
        KVFormat(
            "int4_k8",
            "intg",
            4,
            description="INT4 asymmetric, K groups of 8, V groups of 32, 8-bit minima",
            rotate="k",
            groups=(8, 32),
            min8=True,
        ),
        KVFormat("int2", "intg", 2, description="plain per-token 2-bit, group 32 (baseline)"),
        KVFormat(
            "kivi4", "kivi", 4, description="KIVI 4-bit: K per channel, V per token", rotate="kv"
        ),
        KVFormat(
            "kivi2", "kivi", 2, description="KIVI 2-bit: K per channel, V per token", rotate="kv"
        ),
    )
}


def get_format(name: object) -> KVFormat:
    """The registered format called ``name``; ``KernelConfigError`` listing them otherwise."""
    if isinstance(name, KVFormat):
        return name
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise KernelConfigError(f"unknown KV format {name!r}; known: {', '.join(FORMATS)}")
    return fmt


def check_format(
    name: object,
    *,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device | str | None = None,
) -> KVFormat:
    """Resolve ``name`` and check that the kernels can serve it for this geometry and dtype.

    Raises ``KernelConfigError`` (nothing is allocated) for an unknown format, a model dtype
    other than fp32/fp16/bf16, a head dim the format cannot pack (int4/int2 need a multiple of
    32, kivi a multiple of 8 // bits), on CUDA a head dim the Triton kernels do not compile for,
    or FP8 on a CUDA device older than sm89.
    """
    fmt = get_format(name)
    if dtype not in MODEL_DTYPES:
        raise KernelConfigError(f"model dtype must be one of {MODEL_DTYPES}, got {dtype}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise KernelConfigError(f"head_dim must be a positive int, got {head_dim!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise KernelConfigError(f"block_size must be a positive int, got {block_size!r}")
    if not fmt.quantized:
        return fmt
    if fmt.kind == "intg" and head_dim % max(fmt.groups):
        raise KernelConfigError(
            f"{fmt.name} quantizes groups of {max(fmt.groups)} along the head dim: head_dim "
            f"{head_dim} is not a multiple of {max(fmt.groups)}"
        )
    if fmt.kind == "kivi":
        if head_dim % fmt.codes_per_byte:
            raise KernelConfigError(
                f"{fmt.name} packs {fmt.codes_per_byte} codes per byte: head_dim {head_dim} "
                f"is not a multiple of {fmt.codes_per_byte}"
            )
        if block_size < 2:
            raise KernelConfigError(f"{fmt.name} quantizes keys over a block: block_size >= 2")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        if head_dim not in TRITON_HEAD_DIMS:
            raise KernelConfigError(
                f"{fmt.name} on CUDA: the Triton kernels serve head_dim {TRITON_HEAD_DIMS}, "
                f"got {head_dim}"
            )
        if fmt.kind == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
            raise KernelConfigError(f"{fmt.name} needs a GPU with FP8 support (sm89 or newer)")
    return fmt


@dataclass(frozen=True)
class Region:
    """One named slab of a head segment: byte offset in the segment, per-head shape, element
    dtype, and where the head axis goes in the logical per-block shape (``head_axis``)."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    head_axis: int  # logical per-block shape = shape[:head_axis] + (H,) + shape[head_axis:]

    @property
    def nbytes(self) -> int:
        """Bytes of this region in one head segment."""
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BlockLayout:
    """The regions of one head segment, the segment's size (padded to ``ROW_ALIGN``) and the
    row's (``num_kv_heads`` segments)."""

    regions: dict[str, Region]
    head_bytes: int
    block_bytes: int


def block_layout(fmt: KVFormat, block_size: int, num_kv_heads: int, head_dim: int) -> BlockLayout:
    """The byte layout of one block of a quantized format (see the module docstring)."""
    bs, d = block_size, head_dim
    if not fmt.quantized:
        raise KernelConfigError("the model-dtype format has no quantized block layout")
    packed = d * fmt.bits // 8 if fmt.bits < 8 else d
    data_dtype = {"fp8": fmt.fp8_dtype, "int8": torch.int8}.get(fmt.kind, torch.uint8)
    specs: list[tuple[str, tuple[int, ...], torch.dtype, int]] = [
        ("data", (2, bs, packed), data_dtype, 2)
    ]
    if fmt.kind == "int8":
        specs.append(("scale", (2, bs), torch.float16, 2))
    elif fmt.kind == "intg":  # K and V each: [bs, G] scales and minima (their own group size)
        scale_dtype = torch.uint8 if fmt.bits == 4 else torch.float16
        min_dtype = torch.int8 if fmt.min8 else torch.float16
        for kv, group in zip("kv", fmt.groups, strict=True):
            specs.append((kv + "scale", (bs, d // group), scale_dtype, 1))
            specs.append((kv + "min", (bs, d // group), min_dtype, 1))
    elif fmt.kind == "kivi":
        specs += [
            ("kmin", (d,), torch.float16, 0),
            ("vscale", (bs,), torch.float16, 1),
            ("vmin", (bs,), torch.float16, 1),
            ("kcode", (d,), torch.uint8, 0),
        ]
    regions: dict[str, Region] = {}
    offset = 0
    for name, shape, dtype, head_axis in specs:
        region = Region(name, offset, shape, dtype, head_axis)
        regions[name] = region
        offset += region.nbytes
        offset += -offset % 4  # keep every region 4-byte aligned (fp16 views, vector loads)
    head_bytes = offset + (-offset % ROW_ALIGN)
    return BlockLayout(regions, head_bytes, head_bytes * num_kv_heads)


def bytes_per_token(
    fmt: KVFormat | str, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> float:
    """K+V bytes one token takes in one layer, metadata included (block row / block_size).

    ``dtype`` is the model dtype (what "auto" stores). Excludes per-layer constants (the FP8
    scales) and KIVI's residual pool, which the capacity planner counts per request.
    """
    fmt = get_format(fmt)
    if not fmt.quantized:
        return 2.0 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    return block_layout(fmt, block_size, num_kv_heads, head_dim).block_bytes / block_size


# Kernel-facing encoding of a format: one integer kind and the byte offsets of up to five regions.
KIND_FP8_E4M3, KIND_FP8_E5M2, KIND_INT8, KIND_INT4, KIND_INT2, KIND_KIVI = range(6)
_META_REGIONS = (("scale", "kscale", "kmin"), ("kmin", "kcode"), ("vscale",), ("vmin",))


def kernel_kind(fmt: KVFormat) -> int:
    """The ``KIND`` constexpr the Triton kernels branch on."""
    if fmt.kind == "fp8":
        return KIND_FP8_E5M2 if fmt.fp8_dtype == torch.float8_e5m2 else KIND_FP8_E4M3
    if fmt.kind == "intg":
        return KIND_INT4 if fmt.bits == 4 else KIND_INT2
    return {"int8": KIND_INT8, "kivi": KIND_KIVI}[fmt.kind]


def region_offsets(layout: BlockLayout) -> tuple[int, int, int, int, int]:
    """Byte offsets in a head segment of: data, then int8 ``scale`` / intg ``kscale`` / kivi
    ``kmin``, then intg ``kmin`` / kivi ``kcode``, then ``vscale``, ``vmin`` (0 if absent)."""
    offsets = [layout.regions["data"].offset]
    taken: set[str] = set()
    for names in _META_REGIONS:
        name = next((n for n in names if n in layout.regions and n not in taken), None)
        taken.add(name or "")
        offsets.append(layout.regions[name].offset if name else 0)
    return tuple(offsets)  # type: ignore[return-value]


def token_regions(fmt: KVFormat, which: int) -> dict[str, tuple[str, bool]]:
    """Per-token formats: codec part -> (region name, whether the region has a leading K/V axis
    to index with ``which``) for K (``which=0``) or V (1)."""
    out = {"data": ("data", True)}
    if fmt.kind == "int8":
        out["scale"] = ("scale", True)
    elif fmt.kind == "intg":
        kv = "kv"[which]
        out["scale"] = (kv + "scale", False)
        out["min"] = (kv + "min", False)
    return out
