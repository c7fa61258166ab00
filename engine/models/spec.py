"""What the engine needs to know about a model, read from its Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# model_type -> the switches that tell the families apart
SUPPORTED_MODEL_TYPES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "smollm3": {},  # Llama with RoPE left out of every `no_rope_layer_interval`-th layer (`no_rope_layers`)
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: torch.dtype | None
    hf_config: Any  # the transformers config, for RoPE parameters
    unrotated_layers: frozenset[int] = frozenset()  # layers whose attention has no RoPE (SmolLM3's)

    @classmethod
    def from_hf_config(cls, config: Any, max_model_len: int | None = None) -> "ModelSpec":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2, SmolLM3)")
        family = SUPPORTED_MODEL_TYPES[model_type]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        max_pos = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if window and (model_type == "mistral" or getattr(config, "use_sliding_window", False)):
            # Sliding-window attention is not implemented: within the window it equals full
            # attention, so contexts are limited to the window instead of computed wrongly.
            max_pos = min(max_pos, window)
        if max_model_len is not None:
            max_pos = min(max_pos, max_model_len)
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family.get("qkv_bias", attention_bias),
            o_bias=attention_bias and model_type in ("llama", "qwen3", "smollm3"),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=family.get("qk_norm", False),
            torch_dtype=dtype,
            hf_config=config,
            unrotated_layers=frozenset(i for i, rotated in enumerate(getattr(config, "no_rope_layers", None) or ())
                                       if not rotated),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and attention scaling for the config's RoPE type (default, linear,
        dynamic, yarn, longrope, llama3), computed by transformers' own RoPE helpers so scaled
        variants match the reference exactly."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = self.hf_config
        if hasattr(config, "standardize_rope_params"):
            config.standardize_rope_params()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = self.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            return inv_freq, 1.0
        if rope_type == "dynamic":
            raise UnsupportedModelError("dynamic NTK RoPE changes with sequence length; not supported")
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)
