"""Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 (q/k norm), SmolLM2 (tied embeddings).

The differences between these families are config switches (bias on q/k/v, q/k RMSNorm, tied
embeddings, RoPE scaling), so one compact implementation serves all of them. q/k/v and gate/up are
fused into one matmul each: on a CPU at batch 1 every kernel launch costs, and the weights are read
once either way.

Tensors are flattened over the batch: every activation is `[T, ...]` with T the tokens scheduled in
this step, so prefill chunks and decodes of different requests share one forward pass.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import cpu_kernels
from ..attention import AttentionMetadata, paged_attention
from .spec import ModelSpec


@functools.cache
def cpu_packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pre-pack `dtype` linear weights on this CPU. Its bf16 packing needs
    AVX512BW/VL/DQ or AVX-NE-CONVERT and raises without them (seen on AVX2-only EPYCs), so ask once."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


class Linear(nn.Linear):
    """nn.Linear with two CPU fast paths for bf16/fp16, mechanism switches set once at load:

    - our bf16 kernel (`cpu_kernels.py`) for calls of up to `cpu_kernel_max_tokens` tokens: on CPUs
      without native bf16 arithmetic it is 1.2-1.4x oneDNN at batch 1 and 2.5-3x at batch 8-256
      (`benchmarks/cpu_kernels.py`);
    - a weight pre-packed into oneDNN's blocked layout: on CPUs with AVX512-BF16/AMX this skips the
      per-call reorder F.linear pays, most of a small-batch matmul's cost (bit-identical results).
    """

    packed: torch.Tensor | None = None
    cpu_kernel_max_tokens: int = 0

    def pack_for_cpu(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.cpu_kernel_max_tokens:
            return cpu_kernels.linear_bf16(x, self.weight, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    # The fused add + norm (`add_rms_norm`) of cpu_kernels (CPU, bf16) or triton_fused (CUDA, 16-bit),
    # set at load (LlamaForCausalLM.prepare_cpu_kernels / use_fused_kernels); None: the torch path.
    kernels = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, cast back, then scale: the reference's order of operations, so bf16
        # results round the same way (the fused F.rms_norm gives bit-identical fp32 results here).
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h plus a block's output delta (None: nothing to add), and its norm."""
        if self.kernels is not None:
            return self.kernels.add_rms_norm(h, delta, self.weight, self.eps), h  # h updated in place
        if delta is not None:
            h = h + delta
        return self(h), h


@dataclass
class Rotary:
    """RoPE inputs of one step: the positions and tables, and (torch path) each row's cos/sin; a layer
    without RoPE gets the identity (every position at a table row of cos 1, sin 0; no cos/sin)."""

    positions: torch.Tensor  # [T]
    cos_table: torch.Tensor  # [max_positions, D]
    sin_table: torch.Tensor  # [max_positions, D], first half negated (see apply_rope)
    cos: torch.Tensor | None = None  # [T, 1, D]; None on the torch path: no RoPE
    sin: torch.Tensor | None = None


def rotated(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    return x if rotary.cos is None else apply_rope(x, rotary.cos, rotary.sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) written as
    roll(x) * [-sin1, sin2]: the same products (negation is exact), in 4 kernels instead of 6."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    # The fused RoPE + cache write and decode attention (`rope_and_cache`, `paged_decode_attention`) of
    # cpu_kernels or triton_fused, as RMSNorm.kernels; only without q/k norms.
    kernels = None

    def forward(self, x: torch.Tensor, rotary: Rotary, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        heads = qkv.view(T, H + 2 * Hkv, self.head_dim)  # q heads, then k heads, then v
        if self.kernels is not None:  # RoPE in place (seen through `heads`) and the cache written by one kernel
            self.kernels.rope_and_cache(qkv, rotary.positions, rotary.cos_table, rotary.sin_table, kv_cache[0],
                                       kv_cache[1], meta.slot_mapping, H, Hkv, self.head_dim)
            q, k = heads[:, :H], heads[:, H:H + Hkv]
        elif self.q_norm is None:
            # RoPE on q and k together: one set of kernels for H + Hkv heads.
            qk = rotated(heads[:, :H + Hkv], rotary)
            q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D]
        else:
            q = rotated(self.q_norm(heads[:, :H]), rotary)
            k = rotated(self.k_norm(heads[:, H:H + Hkv]), rotary)
        v = heads[:, H + Hkv:]  # [T, Hkv, D]
        o = paged_attention(q, k, v, meta, kv_cache[0], kv_cache[1], self.scale, kernels=self.kernels)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    kernels = None  # the fused `silu_mul`, as RMSNorm.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, h, delta, rotary, meta, kv_cache):
        """h: the residual stream, still without `delta` (the previous layer's MLP output, or None);
        returns the stream without this layer's MLP output, and that output: the next norm adds it."""
        x, h = self.input_layernorm.add_and_norm(h, delta)
        x, h = self.post_attention_layernorm.add_and_norm(h, self.self_attn(x, rotary, meta, kv_cache))
        return h, self.mlp(x)


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (fused parameter name, shard index); q/k/v and gate/up are stored fused
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_rope_tables(torch.get_default_device() if hasattr(torch, "get_default_device") else None)

    def init_rope_tables(self, device, dtype: torch.dtype | None = None) -> None:
        """RoPE tables for every position, computed in fp32 like the reference, then cast once."""
        with torch.device("cpu"):  # not meta: transformers' RoPE helpers copy their result to the CPU
            inv_freq, attention_scaling = self.spec.rope_inv_freq()
            positions = torch.arange(self.spec.max_position_embeddings, dtype=torch.float32)
            emb = (positions[:, None] * inv_freq[None, :]).repeat(1, 2)
        dtype = dtype or torch.float32
        self.register_buffer("cos_table", (emb.cos() * attention_scaling).to(device, dtype), persistent=False)
        sin = emb.sin() * attention_scaling
        sin[:, :sin.shape[1] // 2] *= -1  # sign of rotate_half folded in, see apply_rope
        self.register_buffer("sin_table", sin.to(device, dtype), persistent=False)
        # The identity, for layers without RoPE: one row, cos 1 and sin 0, which every position reads
        row = dict(device=device, dtype=dtype)
        self.register_buffer("unrotated_cos", torch.ones(1, emb.shape[1], **row), persistent=False)
        self.register_buffer("unrotated_sin", torch.zeros(1, emb.shape[1], **row), persistent=False)

    def shard_sizes(self, fused: str) -> list[int]:
        s = self.spec
        if fused == "qkv_proj":
            return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        return [s.intermediate_size, s.intermediate_size]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)
        rotary = Rotary(positions, self.cos_table, self.sin_table)
        if self.layers[0].self_attn.kernels is None:
            rotary.cos = self.cos_table[positions].unsqueeze(1)  # [T, 1, D]
            rotary.sin = self.sin_table[positions].unsqueeze(1)  # [T, 1, D], first half negated
        unrotated = None
        if self.spec.unrotated_layers:
            unrotated = Rotary(torch.zeros_like(positions), self.unrotated_cos, self.unrotated_sin)
        delta = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, delta = layer(h, delta, unrotated if i in self.spec.unrotated_layers else rotary, meta, kv_cache)
        return self.norm.add_and_norm(h, delta)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> logits [B, vocab] in fp32."""
        return self.lm_head(hidden).float()

    def use_fused_kernels(self, kernels) -> None:
        """Residual add + RMSNorm, SiLU-and-multiply, RoPE + cache write and decode attention through
        `kernels` (a module with cpu_kernels' functions, as triton_fused on a GPU)."""
        for module in self.modules():
            if isinstance(module, (MLP, RMSNorm)):  # (q/k norms never take the add_and_norm path)
                module.kernels = kernels
            elif isinstance(module, Attention) and module.q_norm is None:
                module.kernels = kernels

    def prepare_cpu_kernels(self) -> None:
        """CPU bf16/fp16 only (fp32 gains nothing): time our bf16 kernel against oneDNN on one layer's
        largest weight, use it for the batch sizes where it wins, and pack every weight for oneDNN
        unless ours serves every batch size."""
        probe = self.layers[0].mlp.gate_up_proj
        can_pack = cpu_packing_available(probe.weight.dtype)
        if can_pack:
            probe.pack_for_cpu()  # oneDNN's side of the timing
        limit = cpu_kernels.choose_linear_backend(probe.weight.detach(), probe.forward)
        s = self.spec
        fused = probe.weight.dtype == torch.bfloat16 and cpu_kernels.decode_kernels_apply(
            s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads, s.head_dim)
        for module in self.modules():
            if isinstance(module, Linear):
                applies = cpu_kernels.linear_applies(module.weight)
                module.cpu_kernel_max_tokens = limit if applies else 0
                if not can_pack or (applies and limit >= cpu_kernels.UNLIMITED):
                    module.packed = None
                elif module.packed is None:
                    module.pack_for_cpu()
        self.use_fused_kernels(cpu_kernels if fused else None)
