"""Engine configuration: the KV cache and the scheduler, validated when built.

Every check raises ``InvalidArgumentError`` before any memory is allocated or request scheduled.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from kvcore_kernels.quant import FORMATS as QUANT_FORMATS

from kvcore.errors import InvalidArgumentError

PREFIX_MODES = ("radix", "hash", "off")
POLICIES = ("fcfs", "priority")
KV_FORMATS = {  # model-dtype storage (a plain cache tensor per layer)
    "auto": None,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Quantized storage (kvcore_kernels.quant): quantized in the store kernel, dequantized as
# attention loads it. A list of these (one per layer) is a per-layer mix.
QUANTIZED_FORMATS = tuple(name for name in QUANT_FORMATS if name != "auto")
DEFAULT_KV_MEMORY_BYTES = 1 << 30  # CPU cap, when neither blocks nor bytes are given
DEFAULT_KV_MEMORY_FRACTION = 0.25  # ... and at most this share of the available RAM
DEVICE_TYPES = ("cpu", "cuda")  # where the kernels run (Triton or their torch twins)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device to run on: ``None`` picks the current CUDA device when there is one, else the
    CPU; ``"cuda"`` becomes ``"cuda:N"`` (the current device). Raises ``InvalidArgumentError``
    for an unknown device, a device kvcore cannot run on, or a CUDA device that is not there."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise InvalidArgumentError(
                f"unknown device {device!r}: give one of {', '.join(DEVICE_TYPES)} or cuda:N"
            ) from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise InvalidArgumentError(f"device must be a string or torch.device, got {device!r}")
    if dev.type not in DEVICE_TYPES:
        raise InvalidArgumentError(
            f"device {str(dev)!r} is not supported: kvcore runs on {', '.join(DEVICE_TYPES)}"
        )
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InvalidArgumentError(f"device {str(dev)!r} was asked for, but CUDA is not available")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise InvalidArgumentError(f"device {str(dev)!r}: there are {count} CUDA devices")
    return torch.device("cuda", index)


def available_memory_bytes() -> int | None:
    """RAM this process may still use: ``MemAvailable``, lowered by a cgroup (v2) limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    try:  # a container's limit is often far below the host's free memory
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit != "max":
            avail = min(avail, max(0, int(limit) - int(used)))
    except (OSError, ValueError):
        pass
    return avail


def default_kv_memory_bytes(device: torch.device) -> int:
    """The KV budget when none is given: 80% of the free memory of a CUDA device; on the CPU
    ``min(1 GiB, 25% of the available RAM)``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    avail = available_memory_bytes()
    if avail is None:
        return DEFAULT_KV_MEMORY_BYTES
    return max(1 << 20, min(DEFAULT_KV_MEMORY_BYTES, int(avail * DEFAULT_KV_MEMORY_FRACTION)))


def blocks_for_request(prompt_len: int, max_tokens: int, block_size: int, n: int = 1) -> int:
    """A pool (the null block included) that holds one request of ``prompt_len`` prompt tokens,
    ``n`` samples of ``max_tokens``: each sample's own blocks, the scheduler's 1% watermark and
    one spare block, rounded up to a multiple of 8."""
    for name, value, low in (
        ("prompt_len", prompt_len, 1),
        ("max_tokens", max_tokens, 1),
        ("block_size", block_size, 1),
        ("n", n, 1),
    ):
        if not (_is_int(value) and value >= low):
            raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {value!r}")
    need = n * -(-(prompt_len + max_tokens) // block_size)
    total = 1 + need + 1 + -(-need // 99)  # null + blocks + spare + watermark (ceil 1%)
    return -(-total // 8) * 8


@dataclass
class CacheConfig:
    """The paged KV cache: block size, size (blocks or a byte budget), format, prefix mode."""

    block_size: int = 16
    num_blocks: int | None = None  # including the null block; wins over kv_memory_bytes
    kv_memory_bytes: int | None = None  # KV budget over all layers (default_kv_memory_bytes)
    # auto (the model dtype) | float32 | float16 | bfloat16 | a quantized format (fp8_e4m3,
    # int8, int4, kivi2, ...: QUANTIZED_FORMATS) | a list of formats, one per layer
    kv_format: str | Sequence[str] = "auto"
    prefix_caching: str = "radix"  # radix | hash | off
    # FP8 scale of K and V (x is stored as x / scale); None: calibrated on the first forward
    kv_scale: float | None = None
    # KIVI: full blocks before each request's newest tokens kept in the model dtype (besides its
    # partial last block), KIVI's full-precision window of recent tokens
    kivi_window: int = 0
    # ---- KV tiers (docs/tiers.md): evicted/preempted KV goes to host memory (L2), a local
    # disk (L3) and a shared Redis (L4), and comes back on a prefix hit. 0 / None: off.
    host_kv_bytes: int = 0  # L2 host-memory budget in bytes (needed by L3, L4 and swap)
    disk_path: str | None = None  # L3 directory of chunk files
    disk_bytes: int = 1 << 30  # L3 byte cap
    remote_url: str | None = None  # L4, e.g. "redis://127.0.0.1:6379/0"
    remote_timeout_s: float = 0.5  # per Redis call; a fetch that takes longer is a miss
    # chained hash of prefix_caching="hash": xxh3 (128-bit, fast) or sha256 (collision-resistant);
    # either way a hash match reuses a block only when its token ids are equal
    prefix_hash: str = "xxh3"
    # ---- retention (docs/retention.md). The engine's default policy for requests: "full"
    # (exact, keep every block), "window:W" or "sink:S+window:W" (lossy, opt-in).
    retention: str = "full"
    # Release blocks wholly behind the sliding window when every layer has one (exact).
    sliding_window_release: bool = True

    def _check_tiers(self) -> None:
        if not (_is_int(self.host_kv_bytes) and self.host_kv_bytes >= 0):
            raise InvalidArgumentError(
                f"host_kv_bytes must be an int >= 0, got {self.host_kv_bytes!r}"
            )
        if not (_is_int(self.disk_bytes) and self.disk_bytes > 0):
            raise InvalidArgumentError(f"disk_bytes must be an int > 0, got {self.disk_bytes!r}")
        if self.disk_path is not None and not (isinstance(self.disk_path, str) and self.disk_path):
            raise InvalidArgumentError(
                f"disk_path must be a directory path, got {self.disk_path!r}"
            )
        if self.remote_url is not None and not (
            isinstance(self.remote_url, str) and self.remote_url.startswith(("redis://", "unix://"))
        ):
            raise InvalidArgumentError(
                f"remote_url must be a redis:// URL, got {self.remote_url!r}"
            )
        if (self.disk_path or self.remote_url) and not self.host_kv_bytes:
            raise InvalidArgumentError(
                "disk_path and remote_url need a host tier: host_kv_bytes > 0"
            )
        if self.prefix_hash not in ("xxh3", "sha256"):
            raise InvalidArgumentError(
                f"prefix_hash must be xxh3 or sha256, got {self.prefix_hash!r}"
            )
        t = self.remote_timeout_s
        if not (isinstance(t, int | float) and not isinstance(t, bool) and 0 < t <= 60):
            raise InvalidArgumentError(f"remote_timeout_s must be in (0, 60], got {t!r}")

    def __post_init__(self) -> None:
        self._check_tiers()
        # The policy's grammar is checked by the engine's builder (kvcore.retention.spec).
        if not isinstance(self.retention, str):
            raise InvalidArgumentError(f"retention must be a string, got {self.retention!r}")
        if not isinstance(self.sliding_window_release, bool):
            raise InvalidArgumentError(
                f"sliding_window_release must be a bool, got {self.sliding_window_release!r}"
            )
        bs = self.block_size
        if not (_is_int(bs) and 1 <= bs <= 256 and bs & (bs - 1) == 0):
            raise InvalidArgumentError(f"block_size must be a power of two in [1, 256], got {bs!r}")
        if self.num_blocks is not None and not (_is_int(self.num_blocks) and self.num_blocks >= 2):
            raise InvalidArgumentError(
                f"num_blocks must be an integer >= 2, got {self.num_blocks!r}"
            )
        if self.kv_memory_bytes is not None and not (
            _is_int(self.kv_memory_bytes) and self.kv_memory_bytes > 0
        ):
            raise InvalidArgumentError(f"kv_memory_bytes must be > 0, got {self.kv_memory_bytes!r}")
        names = [self.kv_format] if isinstance(self.kv_format, str) else self.kv_format
        if not isinstance(names, Sequence) or not names:
            raise InvalidArgumentError(
                f"kv_format must be a format name or a non-empty list of them (one per layer), "
                f"got {self.kv_format!r}"
            )
        if not isinstance(self.kv_format, str):
            self.kv_format = list(self.kv_format)
        for name in names:
            if not isinstance(name, str) or not (name in KV_FORMATS or name in QUANTIZED_FORMATS):
                raise InvalidArgumentError(
                    f"kv_format must be one of {', '.join([*KV_FORMATS, *QUANTIZED_FORMATS])} "
                    f"(or a list of them, one per layer), got {name!r}"
                )
            if len(names) > 1 and name in KV_FORMATS and name != "auto":
                raise InvalidArgumentError(
                    f"a per-layer kv_format list takes auto and quantized formats, not {name!r}"
                )
        if not (_is_int(self.kivi_window) and 0 <= self.kivi_window <= 64):
            raise InvalidArgumentError(
                f"kivi_window must be an int in [0, 64] (blocks), got {self.kivi_window!r}"
            )
        if self.kv_scale is not None and not (
            isinstance(self.kv_scale, int | float)
            and not isinstance(self.kv_scale, bool)
            and 0 < self.kv_scale < float("inf")
        ):
            raise InvalidArgumentError(
                f"kv_scale must be a finite number > 0 or None, got {self.kv_scale!r}"
            )
        if self.prefix_caching not in PREFIX_MODES:
            raise InvalidArgumentError(
                f"prefix_caching must be one of {', '.join(PREFIX_MODES)}, "
                f"got {self.prefix_caching!r}"
            )

    @property
    def quantized(self) -> bool:
        """Whether any layer stores a quantized format (``QuantKVCache`` layers)."""
        names = [self.kv_format] if isinstance(self.kv_format, str) else self.kv_format
        return any(name in QUANTIZED_FORMATS for name in names)

    def layer_formats(self, num_layers: int) -> list[str]:
        """One quantized-or-"auto" format name per layer (for ``allocate_kv_caches``)."""
        if isinstance(self.kv_format, str):
            return [self.kv_format if self.kv_format in QUANTIZED_FORMATS else "auto"] * num_layers
        if len(self.kv_format) != num_layers:
            raise InvalidArgumentError(
                f"a per-layer kv_format list needs one entry per layer ({num_layers}), "
                f"got {len(self.kv_format)}"
            )
        return list(self.kv_format)

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The storage dtype of the model-dtype layers for a model of ``model_dtype``."""
        if isinstance(self.kv_format, str) and self.kv_format in KV_FORMATS:
            return KV_FORMATS[self.kv_format] or model_dtype
        return model_dtype

    def resolve_num_blocks(
        self, bytes_per_block: int, device: torch.device, reserved_bytes: int = 0
    ) -> int:
        """Blocks to allocate (the null block included) for a model needing bytes_per_block;
        ``reserved_bytes`` (KIVI's residual pool) come out of the budget first."""
        if self.num_blocks is not None:
            return self.num_blocks
        budget = self.kv_memory_bytes
        if budget is None:
            budget = default_kv_memory_bytes(device)
        blocks = (budget - reserved_bytes) // bytes_per_block
        if blocks < 2:
            raise InvalidArgumentError(
                f"a KV budget of {budget} bytes ({reserved_bytes} of them for KIVI's residual "
                f"pool) holds {max(blocks, 0)} blocks of {bytes_per_block} bytes: need at least 2"
            )
        return int(blocks)


@dataclass
class SchedulerConfig:
    """Continuous batching: token budget per step, running cap, prefill chunking, policy.

    With ``enable_chunked_prefill`` (the default) a prompt is split over steps to fit the token
    budget beside the running decodes (scheduled first); ``long_prefill_token_threshold``
    further caps one request's prefill chunk per step. Without it a prompt is computed in one
    step or waits, so the budget must hold ``max_model_len`` tokens (checked when the engine
    knows the model's length).
    """

    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 256  # running sequences at most (the n samples of a request count n)
    long_prefill_token_threshold: int = 0  # 0: only the budget caps a prefill chunk
    policy: str = "fcfs"  # fcfs | priority (smaller value first; ties by arrival)
    watermark: float = 0.01  # fraction of the blocks admission keeps free
    enable_chunked_prefill: bool = True  # split prompts over steps (vLLM's flag)
    # KV tiers: a preempted request's KV is recomputed or swapped to the host tier; auto picks
    # per request (recompute cost grows with its computed tokens, swap cost is bytes over the
    # measured copy bandwidth). Without a host tier, auto means recompute.
    preemption: str = "auto"  # auto | recompute | swap

    def __post_init__(self) -> None:
        if self.preemption not in ("auto", "recompute", "swap"):
            raise InvalidArgumentError(
                f"preemption must be auto, recompute or swap, got {self.preemption!r}"
            )
        for name, low in (
            ("max_num_batched_tokens", 1),
            ("max_num_seqs", 1),
            ("long_prefill_token_threshold", 0),
        ):
            value = getattr(self, name)
            if not (_is_int(value) and value >= low):
                raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
        if self.policy not in POLICIES:
            raise InvalidArgumentError(
                f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}"
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise InvalidArgumentError(
                f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}"
            )
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold:
            raise InvalidArgumentError(
                "long_prefill_token_threshold caps prefill chunks: it needs enable_chunked_prefill"
            )
        if not (isinstance(self.watermark, int | float) and 0 <= self.watermark < 1):
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {self.watermark!r}")
