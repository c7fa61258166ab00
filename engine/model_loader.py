"""Load a Llama-family model from a local Hugging Face folder (config.json + *.safetensors)."""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open

from .models.llama import LlamaForCausalLM
from .models.spec import ModelSpec


def load_spec(model_dir: str, max_model_len: int | None = None) -> ModelSpec:
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir!r} is not a model folder (no config.json)")
    return ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir), max_model_len)


def load_model(model_dir: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r}")
    # Build on the meta device so no memory is spent on random initial weights.
    with torch.device("meta"):
        model = LlamaForCausalLM(spec).to(dtype)
    model = model.to_empty(device=device)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope_tables(device, dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                loaded |= _load_tensor(model, params, name, f.get_tensor(name))
    expected = {(n, s) for n in params for s in _shards_of(model, n)}
    missing = sorted(n for n, _ in expected - loaded)
    if missing:
        raise ValueError(f"weights missing from {model_dir!r}: {missing[:5]}")
    model.eval()
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        model.prepare_cpu_kernels()
    elif device.type == "cuda":
        from . import triton_fused  # imports Triton: on CUDA hosts only (a third of a second at every CPU start)

        if triton_fused.applies(device, dtype):
            model.use_fused_kernels(triton_fused)
    return model


def _shards_of(model: LlamaForCausalLM, pname: str) -> range:
    fused = pname.split(".")[-2]
    return range(len(model.shard_sizes(fused))) if fused in ("qkv_proj", "gate_up_proj") else range(1)


def _load_tensor(model: LlamaForCausalLM, params: dict, name: str, tensor: torch.Tensor) -> set:
    """Copy one checkpoint tensor into its (possibly fused) parameter; returns {(param, shard)}."""
    name = name.removeprefix("model.")
    if name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return set()  # tied to embed_tokens
    for ckpt, (fused, shard) in model.packed_modules.items():
        if f".{ckpt}." in name:
            pname = name.replace(ckpt, fused)
            sizes = model.shard_sizes(fused)
            start = sum(sizes[:shard])
            with torch.no_grad():
                params[pname][start:start + sizes[shard]].copy_(tensor)
            return {(pname, shard)}
    if name not in params:
        return set()  # e.g. rotary inv_freq buffers some checkpoints carry
    with torch.no_grad():
        params[name].copy_(tensor)
    return {(name, 0)}
