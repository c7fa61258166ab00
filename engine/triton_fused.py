"""Fused kernels for 16-bit models on CUDA, in Triton: the GPU counterparts of cpu_kernels'
`add_rms_norm`, `silu_mul`, `rope_and_cache` and `paged_decode_attention` (triton_decode's), with the
same signatures, so the model takes either module as its `kernels`.

Why: at small batch a decode step's time on a GPU is the weights' memory traffic plus a few
microseconds per kernel, and the torch path spends five kernels on each residual add + RMSNorm (add,
cast to fp32, norm, cast back, scale), two on SiLU-and-multiply, and six on RoPE and the KV cache
write (two products, a roll, a sum, two index copies). On an H100 with the Llama-3-8B shape these small
kernels took about 1 ms of a 7 ms batch-1 step (2026-11-27, torch.profiler under
`benchmarks/gpu/step_profile.py`); fused, each is one kernel a layer.

Each rounds where the torch path rounds (the sum to the model's dtype, the normalized value to it
before the scale, SiLU to it before the product, each RoPE product before their sum), so results match
it to the last bit up to the order of the fp32 sum of squares. Checked on CPU through Triton's
interpreter (tests/test_triton_fused.py).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine runs without Triton; the model keeps its torch path
    triton = None

from .triton_decode import paged_decode_attention

__all__ = ["add_rms_norm", "applies", "paged_decode_attention", "rope_and_cache", "silu_mul"]

SILU_COLUMNS = 1024  # columns of the [T, I] output one SiLU-and-multiply program writes


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(h_ptr, delta_ptr, weight_ptr, out_ptr, stride_h, stride_d, stride_o, N, eps,
                             HAS_DELTA: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_N)
        mask = offs < N
        x = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual stream in the model's dtype
            tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        normed = (xf * rms).to(x.dtype)
        w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * stride_o + offs, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype),
                 mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
                 mask=mask)

    @triton.jit
    def _rope_and_cache_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                               stride_t, stride_cos, stride_ks, stride_kh, stride_vs, stride_vh,
                               H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
        """One program per (token, head) of qkv's H q heads, Hkv k heads and Hkv v heads, in that order:
        RoPE in place on q and k heads, k and v heads also into their cache slot."""
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, D_PAD)
        mask = offs < D
        row = qkv_ptr + t * stride_t + head * D
        x = tl.load(row + offs, mask=mask, other=0.0)
        slot = tl.load(slots_ptr + t)
        if head < H + HKV:
            pos = tl.load(positions_ptr + t)
            cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)  # first half negated
            rolled = tl.load(row + (offs + D // 2) % D, mask=mask, other=0.0)  # roll by D / 2 (either way)
            x = ((x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
                 + (rolled.to(tl.float32) * sin).to(x.dtype).to(tl.float32)).to(x.dtype)
            tl.store(row + offs, x, mask=mask)
            if head >= H:
                tl.store(k_cache_ptr + slot * stride_ks + (head - H) * stride_kh + offs, x, mask=mask)
        else:
            tl.store(v_cache_ptr + slot * stride_vs + (head - H - HKV) * stride_vh + offs, x, mask=mask)


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Triton is here, the device is a GPU, and the model is 16-bit (fp32 models keep the torch path, the
    one the token-by-token comparisons against transformers run)."""
    return triton is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta in place (in h's dtype; skipped when delta is None); returns RMSNorm(h) * weight."""
    T, N = h.shape
    assert h.stride(1) == 1 and (delta is None or delta.stride(1) == 1)
    out = torch.empty_like(h)
    if T:
        block = triton.next_power_of_2(N)
        _add_rms_norm_kernel[(T,)](h, h if delta is None else delta, weight, out, h.stride(0),
                                   0 if delta is None else delta.stride(0), out.stride(0), N, eps,
                                   HAS_DELTA=delta is not None, BLOCK_N=block, num_warps=min(16, max(1, block // 256)))
    return out


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> None:
    """RoPE on qkv's q and k heads in place, then k and v into their cache slots. qkv [T, (H + 2 Hkv) D]
    rows contiguous; tables [max_positions, D] (sin's first half negated: `init_rope_tables`); caches
    [num_slots, Hkv, D]; positions, slots [T]."""
    T = qkv.shape[0]
    assert qkv.stride(1) == 1 and cos_table.stride() == sin_table.stride() and k_cache.stride(2) == 1 == v_cache.stride(2)
    if T:
        _rope_and_cache_kernel[(T, num_heads + 2 * num_kv_heads)](
            qkv, positions, cos_table, sin_table, k_cache, v_cache, slots, qkv.stride(0), cos_table.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            H=num_heads, HKV=num_kv_heads, D=head_dim, D_PAD=triton.next_power_of_2(head_dim), num_warps=1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    T, two_i = gate_up.shape
    assert gate_up.stride(1) == 1
    out = torch.empty(T, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _silu_mul_kernel[(T, triton.cdiv(two_i // 2, SILU_COLUMNS))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                      two_i // 2, BLOCK=SILU_COLUMNS, num_warps=4)
    return out
