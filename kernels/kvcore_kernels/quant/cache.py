"""Quantized layer caches: allocation (validated first) and typed views of the block rows.

``allocate_kv_caches`` returns one cache per layer: a plain model-dtype tensor for "auto"
(the layout of ``kvcore_kernels.cache``) and a ``QuantKVCache`` for every quantized format, so
a per-layer mix is just a list of formats. Block ids mean the same block in every layer
(``quant.blocks.copy_blocks`` copies them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcore_kernels.cache import allocate_kv_cache, zeros
from kvcore_kernels.errors import KernelConfigError
from kvcore_kernels.quant.codecs import rotation_matrix
from kvcore_kernels.quant.formats import BlockLayout, KVFormat, block_layout, check_format
from kvcore_kernels.quant.residual import ResidualState

DEFAULT_RESIDUAL_BLOCKS = 256  # KIVI residual slots per (1 + window), unless given


@dataclass(eq=False)
class QuantKVCache:
    """One layer's quantized paged KV cache: ``buffer`` uint8 ``[num_blocks, block_bytes]``.

    ``views[name]`` are typed strided views of the buffer's regions in the logical order
    (``[num_blocks, 2, bs, H, ...]``; KIVI's ``kmin``/``kcode`` ``[num_blocks, H, D]``) over
    the head-segmented rows (``formats`` docstring). With ``rotate`` the stored K (and/or V)
    are ``x @ rotation``. FP8 keeps per-layer scales ``fp8_scale`` float32 ``[2, H]`` (K, V)
    set by the first store unless given. KIVI keeps ``residual`` ``[num_slots, 2, bs, H, D]``
    in the model dtype and the ``ResidualState`` shared by the model's KIVI layers.
    """

    fmt: KVFormat
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model dtype: what store_kv takes and attention returns
    buffer: torch.Tensor
    layout: BlockLayout
    views: dict[str, torch.Tensor] = field(repr=False)
    rotate: str = ""  # "k" / "v" / "kv": which of K and V are stored rotated by ``rotation``
    rotation: torch.Tensor | None = None  # float32 [D, D] orthonormal (formats docstring)
    fp8_scale: torch.Tensor | None = None
    fp8_calibrated: bool = False
    residual: torch.Tensor | None = None
    residual_state: ResidualState | None = field(default=None, repr=False)

    @property
    def num_blocks(self) -> int:
        return self.buffer.shape[0]

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: block rows, FP8 scales and the KIVI residual pool."""
        total = self.buffer.numel()
        for t in (self.fp8_scale, self.residual):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def rotate_in(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """``x @ rotation`` in ``x``'s dtype if ``which`` ("k" or "v") is rotated, else ``x``."""
        if which not in self.rotate:
            return x
        assert self.rotation is not None
        return (x.float() @ self.rotation).to(x.dtype)

    def rotate_out(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """The inverse of ``rotate_in`` (``x @ rotation.T``)."""
        if which not in self.rotate:
            return x
        assert self.rotation is not None
        return (x.float() @ self.rotation.T).to(x.dtype)

    def read_blocks(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        """Region tensors ``[len(blocks), ...]`` of the given blocks (a gather, not a copy
        of the cache)."""
        return {name: v.index_select(0, blocks) for name, v in self.views.items()}

    def write_blocks(self, blocks: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Write region tensors ``[len(blocks), ...]`` (KIVI encodings) into their rows."""
        for name, part in parts.items():
            self.views[name].index_copy_(0, blocks, part.to(self.views[name].dtype))


def _views(buffer: torch.Tensor, layout: BlockLayout, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """Typed views of every region in the logical ``[num_blocks, ..., H, ...]`` order over the
    head-segmented bytes (``formats`` docstring): strided views, no copies."""
    num_blocks = buffer.shape[0]
    segments = buffer.view(num_blocks, num_kv_heads, layout.head_bytes)
    out = {}
    for name, r in layout.regions.items():
        raw = segments[:, :, r.offset : r.offset + r.nbytes]  # [nb, H, nbytes], strided
        typed = raw.view(r.dtype).view(num_blocks, num_kv_heads, *r.shape)
        out[name] = typed.movedim(1, 1 + r.head_axis)
    return out


def resolve_formats(formats: str | Sequence[str], num_layers: int) -> list[str]:
    """One format name per layer: a single name for all layers or a list of exactly
    ``num_layers`` names. Raises ``KernelConfigError`` for a list of the wrong length."""
    if isinstance(formats, str):
        return [formats] * num_layers
    names = list(formats)
    if len(names) != num_layers:
        raise KernelConfigError(
            f"a per-layer format list needs {num_layers} entries (one per layer), got {len(names)}"
        )
    return names


def allocate_kv_caches(
    formats: str | Sequence[str],
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    fp8_scales: float | torch.Tensor | None = None,
    num_residual_blocks: int | None = None,
    kivi_window: int = 0,
    rotate: str | None = None,
) -> list[torch.Tensor | QuantKVCache]:
    """Allocate every layer's cache; every check runs before the first byte is allocated.

    ``formats``: one name or one per layer. ``fp8_scales``: None (calibrate on the first
    store), a number, or float32 ``[2, H]`` / ``[num_layers, 2, H]`` (K then V, per head).
    ``num_residual_blocks``: KIVI residual slots (default ``256 * (1 + kivi_window)``, capped at
    ``num_blocks``), about one per running request per ``(1 + kivi_window)``. ``rotate``:
    None keeps each format's own key/value rotation, "" turns it off, "k" / "v" / "kv" set it.
    """
    device = torch.device(device)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise KernelConfigError(f"num_layers must be an int >= 1, got {num_layers!r}")
    fmts = [
        check_format(n, head_dim=head_dim, dtype=dtype, block_size=block_size, device=device)
        for n in resolve_formats(formats, num_layers)
    ]
    for name, value, low in (
        ("num_blocks", num_blocks, 2),
        ("num_kv_heads", num_kv_heads, 1),
        ("kivi_window", kivi_window, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise KernelConfigError(f"{name} must be an int >= {low}, got {value!r}")
    scales = _check_fp8_scales(fp8_scales, num_layers, num_kv_heads)
    if rotate is not None and rotate not in ("", "k", "v", "kv"):
        raise KernelConfigError(f"rotate must be None, '', 'k', 'v' or 'kv', got {rotate!r}")
    rotation = None
    state = None
    if any(f.kind == "kivi" for f in fmts):
        slots = num_residual_blocks
        if slots is None:
            slots = min(num_blocks, DEFAULT_RESIDUAL_BLOCKS * (1 + kivi_window))
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise KernelConfigError(f"num_residual_blocks must be an int >= 1, got {slots!r}")
        state = ResidualState(num_blocks, block_size, slots, kivi_window, device)
    caches: list[torch.Tensor | QuantKVCache] = []
    for layer, fmt in enumerate(fmts):
        if not fmt.quantized:
            caches.append(
                allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
            )
            continue
        layout = block_layout(fmt, block_size, num_kv_heads, head_dim)
        buffer = zeros((num_blocks, layout.block_bytes), torch.uint8, device)
        cache = QuantKVCache(
            fmt,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            buffer,
            layout,
            _views(buffer, layout, num_kv_heads),
        )
        cache.rotate = fmt.rotate if rotate is None else rotate
        if cache.rotate:
            if rotation is None:
                rotation = rotation_matrix(head_dim).to(device)
            cache.rotation = rotation
        if fmt.kind == "fp8":
            given = scales[layer] if scales is not None else None
            cache.fp8_scale = (
                given.to(device).clone()
                if given is not None
                else torch.ones((2, num_kv_heads), dtype=torch.float32, device=device)
            )
            cache.fp8_calibrated = given is not None
        if fmt.kind == "kivi":
            assert state is not None
            shape = (state.num_slots, 2, block_size, num_kv_heads, head_dim)
            cache.residual = torch.zeros(shape, dtype=dtype, device=device)
            cache.residual_state = state
        caches.append(cache)
    return caches


def _check_fp8_scales(
    scales: float | torch.Tensor | None, num_layers: int, num_kv_heads: int
) -> torch.Tensor | None:
    """User-given FP8 scales as float32 ``[num_layers, 2, H]`` (None: calibrate)."""
    if scales is None:
        return None
    if isinstance(scales, (int, float)) and not isinstance(scales, bool):
        t = torch.full((num_layers, 2, num_kv_heads), float(scales))
    elif isinstance(scales, torch.Tensor):
        t = scales.detach().float().cpu()
        if t.shape == (2, num_kv_heads):
            t = t.expand(num_layers, 2, num_kv_heads)
        if t.shape != (num_layers, 2, num_kv_heads):
            raise KernelConfigError(
                f"fp8_scales must be [2, {num_kv_heads}] or [{num_layers}, 2, {num_kv_heads}], "
                f"got {tuple(scales.shape)}"
            )
    else:
        raise KernelConfigError(f"fp8_scales must be None, a number or a tensor: {scales!r}")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise KernelConfigError("fp8_scales must be finite and > 0")
    return t.contiguous()
