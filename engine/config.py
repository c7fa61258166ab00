"""Frozen configuration, one dataclass per concern.

Values that depend on the model or the machine are resolved once, when the engine starts, so the
rest of the engine only reads plain numbers. Importing this module does not import torch (the
scheduler and the simulation use its configs without a model); the resolvers import it when called.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Accepted dtype names -> torch attribute names.
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def resolve_dtype(name: str | torch.dtype, model_default: torch.dtype | None) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return model_default or torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(sorted(DTYPES))}")
    return getattr(torch, DTYPES[name])


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device string at all
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, not {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def available_host_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo: what the host can still give without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


# Without a pool size, the device KV pool takes this share of the memory free at start-up (after the
# weights). Memory the server shares -- a CPU's, which is the machine's (the host pool's too), or a GPU
# that replicas share, each sizing its pool whenever it starts, before or after the others -- a quarter.
# A GPU of its own: most of it, the rest left to a step's activations, CUDA graphs and sampling (on an
# H100 80GB with an 8B model in bf16, 50 GB of the 63 free, 12.6 GB left).
SHARED_KV_CACHE_FRACTION, GPU_KV_CACHE_FRACTION = 0.25, 0.8


def kv_cache_fraction_or_default(fraction: float | None, device_type: str) -> float:
    """The device KV pool's share of free memory: `fraction`, or (None) the default of a device of this
    type ("cpu", "cuda")."""
    if fraction is not None:
        return fraction
    return SHARED_KV_CACHE_FRACTION if device_type == "cpu" else GPU_KV_CACHE_FRACTION


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Device pool size. None: `kv_cache_fraction` of the memory free at start-up (None: the device's
    # default, `kv_cache_fraction_or_default`).
    kv_cache_gb: float | None = None
    kv_cache_fraction: float | None = None
    # Host pool for swapped-out KV (paused contexts swap into it).
    host_kv_gb: float = 1.0
    # Prefix caching keeps freed full blocks addressable by content.
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    # Tokens per forward pass (prefill chunks + decodes). On a CPU a few hundred saturates the cores.
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    max_model_len: int = 4096


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: torch.dtype
    device: torch.device
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    num_threads: int | None = None
