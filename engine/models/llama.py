"""Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 (q/k norm), SmolLM2 (tied embeddings).

The differences between these families are config switches (bias on q/k/v, q/k RMSNorm, tied
embeddings, RoPE scaling), so one compact implementation serves all of them. q/k/v and gate/up are
fused into one matmul each: on a CPU at batch 1 every kernel launch costs, and the weights are read
once either way.

Tensors are flattened over the batch: every activation is `[T, ...]` with T the tokens scheduled in
this step, so prefill chunks and decodes of different requests share one forward pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention
from .spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as the reference implementation: normalize in fp32, cast back,
        # then scale, so bf16 results round the same way.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # cos, sin: [T, 1, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = paged_attention(q, k, v, meta, kv_cache[0], kv_cache[1], self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, h, cos, sin, meta, kv_cache):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


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
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.init_rope_tables(torch.get_default_device() if hasattr(torch, "get_default_device") else None)

    def init_rope_tables(self, device, dtype: torch.dtype | None = None) -> None:
        """RoPE tables for every position, computed in fp32 like the reference, then cast once."""
        inv_freq, attention_scaling = self.spec.rope_inv_freq()
        positions = torch.arange(self.spec.max_position_embeddings, dtype=torch.float32)
        emb = (positions[:, None] * inv_freq[None, :]).repeat(1, 2)
        dtype = dtype or torch.float32
        self.register_buffer("cos_table", (emb.cos() * attention_scaling).to(device, dtype), persistent=False)
        self.register_buffer("sin_table", (emb.sin() * attention_scaling).to(device, dtype), persistent=False)

    def shard_sizes(self, fused: str) -> list[int]:
        s = self.spec
        if fused == "qkv_proj":
            return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        return [s.intermediate_size, s.intermediate_size]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)
        cos = self.cos_table[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin_table[positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, meta, kv_cache)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, hidden] -> logits [B, vocab] in fp32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
