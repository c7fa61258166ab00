"""Our C kernels for bf16 models on CPU (`csrc/cpu_kernels.c`): built once per machine, called by ctypes.

Why our own: on CPUs without native bf16 arithmetic (no AVX512-BF16, no AMX), oneDNN emulates bf16
matmuls at a third of fp32 speed, and on AVX2-only CPUs (AMD EPYC before Zen 4) cannot pre-pack them.
The kernel here widens bf16 weights to fp32 in registers and reaches the memory-bandwidth floor at
batch 1 and 2.5-6x oneDNN / F.linear at batch 8-256 (measured in `benchmarks/cpu_kernels.py`). Whether it is used is decided per machine by timing it against oneDNN
on the model's own weights at load (`choose_linear_backend`), so AMX machines keep oneDNN where it wins.

The shared library is compiled with the system C compiler (`$CC`, default `cc`) into
`$INFERCEPT_CACHE/kernels/`, keyed by a hash of the source and flags, in about a second. Without a
compiler or without AVX512F or AVX2+FMA the engine uses torch's kernels and says so once.
`INFERCEPT_CPU_KERNELS=0` turns ours off, `=1` uses them wherever they apply without timing.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from importlib import resources

import torch

from .env import cache_dir

log = logging.getLogger(__name__)

UNLIMITED = 1 << 30  # choose_linear_backend's answer when ours wins at every size
COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
ISA_FLAGS = {"avx512": ["-mavx512f", "-mfma"], "avx2": ["-mavx2", "-mfma"]}  # csrc picks its vectors by these


@functools.cache
def cpu_isa() -> str | None:
    """The widest vector instruction set the kernels have code for on this CPU: avx512, avx2 or None."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return None
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def _flags() -> list[str]:
    return COMMON_FLAGS + ISA_FLAGS[cpu_isa()]


def _build(source: bytes, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        src = os.path.join(tmp, "cpu_kernels.c")
        with open(src, "wb") as f:
            f.write(source)
        out = os.path.join(tmp, "cpu_kernels.so")
        cc = os.environ.get("CC") or "cc"
        subprocess.run([cc, *_flags(), "-o", out, src], check=True, capture_output=True)
        os.replace(out, target)  # atomic: concurrent builders (test servers) never see half a file


def enabled() -> bool:
    """Our kernels are built and not turned off by INFERCEPT_CPU_KERNELS=0 (read at each model load)."""
    return os.environ.get("INFERCEPT_CPU_KERNELS") != "0" and library() is not None


def signature() -> str:
    """Names the kernels a model load would use, for caches of measurements (profiles)."""
    return f"cpu-kernels-{_source_key()}" if enabled() else "torch-kernels"


def _source() -> bytes:
    return resources.files("infercept.engine").joinpath("csrc/cpu_kernels.c").read_bytes()


def _source_key() -> str:
    return hashlib.sha256(_source() + " ".join(_flags()).encode()).hexdigest()[:16]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None when they cannot be had here (reason logged once)."""
    if cpu_isa() is None:
        log.info("CPU kernels: neither AVX512F nor AVX2+FMA on this CPU; using torch's kernels")
        return None
    target = os.path.join(cache_dir(), "kernels", f"cpu_kernels-{_source_key()}.so")
    if not os.path.exists(target):
        try:
            _build(_source(), target)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("CPU kernels: could not compile (%s %s); using torch's kernels", e,
                        detail.decode(errors="replace")[:500])
            return None
    lib = ctypes.CDLL(target)
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.linear_bf16.argtypes = [ptr] * 4 + [i32] * 4
    lib.linear_bf16.restype = i32
    lib.add_rms_norm_bf16.argtypes = [ptr] * 4 + [i32, i32, f32, i32]
    lib.add_rms_norm_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [ptr, ptr, i32, i32, i32]
    lib.silu_mul_bf16.restype = None
    lib.rope_and_cache_bf16.argtypes = [ptr] * 7 + [i32] * 4
    lib.rope_and_cache_bf16.restype = None
    lib.paged_decode_attention_bf16.argtypes = [ptr, i64, ptr, ptr, ptr, i32, ptr, ptr] + [i32] * 5 + [f32, i32]
    lib.paged_decode_attention_bf16.restype = i32
    return lib


def linear_applies(weight: torch.Tensor) -> bool:
    """The kernel's contract: a contiguous bf16 [N, K] weight on the CPU with K a multiple of 32."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.is_contiguous() and weight.shape[1] % 32 == 0)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ weight.T + bias for bf16 x [M, K] (made contiguous), fp32 accumulation, one rounding."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    status = library().linear_bf16(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                   y.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1],
                                   torch.get_num_threads())
    if status != 0:
        raise MemoryError("CPU linear kernel: out of scratch memory")
    return y


def fastest_seconds(fn, repeats: int = 5) -> float:
    """Fastest of a few runs: other processes on the cores only ever add time."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def choose_linear_backend(weight: torch.Tensor, torch_linear) -> int:
    """Largest batch (tokens per call) up to which our kernel beats `torch_linear` on `weight`, timed
    here on this machine's cores; 0 when it never does or does not apply. A policy, kept apart from
    the kernels: the model's linears only read the number it returns."""
    if not linear_applies(weight) or not enabled():
        return 0
    if os.environ.get("INFERCEPT_CPU_KERNELS") == "1":
        return UNLIMITED
    limit = 0
    with torch.inference_mode():
        for tokens in (1, 8, 64, 256):
            x = torch.randn(tokens, weight.shape[1], dtype=weight.dtype)
            ours = fastest_seconds(lambda: linear_bf16(x, weight, None))
            theirs = fastest_seconds(lambda: torch_linear(x))
            if ours >= theirs:
                break
            limit = tokens if tokens < 256 else UNLIMITED
    log.info("CPU kernels: our bf16 linear for up to %s tokens per call", limit)
    return limit


def decode_kernels_apply(hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> bool:
    """Whether the decode-step kernels below fit a model's shapes (their C contracts)."""
    return (enabled() and hidden_size % 16 == 0 and intermediate_size % 16 == 0
            and head_dim % 32 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (bf16 rounding; skipped when delta is None); returns RMSNorm(h) * weight."""
    y = torch.empty_like(h)
    library().add_rms_norm_bf16(h.data_ptr(), None if delta is None else delta.contiguous().data_ptr(),
                                weight.data_ptr(), y.data_ptr(), h.shape[0], h.shape[1], eps,
                                torch.get_num_threads())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    half = gate_up.shape[1] // 2
    y = torch.empty(gate_up.shape[0], half, dtype=gate_up.dtype)
    library().silu_mul_bf16(gate_up.data_ptr(), y.data_ptr(), gate_up.shape[0], half, torch.get_num_threads())
    return y


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> None:
    """RoPE on qkv's q and k heads in place, then k and v into their cache slots."""
    library().rope_and_cache_bf16(qkv.data_ptr(), positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(),
                                  k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), qkv.shape[0],
                                  num_heads, num_kv_heads, head_dim)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """q [B, H, D] (rows may be strided, heads contiguous); caches [slots, Hkv, D]; block_tables
    [B, max_blocks] int64; context_lens [B] int64. Returns [B, H, D]."""
    B, H, D = q.shape
    out = torch.empty(B, H, D, dtype=q.dtype)
    status = library().paged_decode_attention_bf16(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], context_lens.data_ptr(), out.data_ptr(), B, H, k_cache.shape[1], D, block_size,
        scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError("CPU attention kernel: out of scratch memory")
    return out
