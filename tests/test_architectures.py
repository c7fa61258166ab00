"""Every supported architecture, as a tiny random model built locally, against transformers fp32.

Each model is saved with `save_pretrained` (safetensors) next to the default model's tokenizer files,
loaded by the engine, and its greedy continuations of three token-id prompts are compared with HF
`generate`. Weights are drawn with a large standard deviation so that the argmax at every step is
far from a tie, and the test checks that margin on the reference path so a near-tie shows up as
an explicit failure of the test's premise rather than a flaky mismatch.
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

from conftest import hf_greedy
from infercept.engine import LLM, SamplingParams
from infercept.engine.models import SUPPORTED_MODEL_TYPES, UnsupportedModelError
from infercept.engine.models.spec import ModelSpec

VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 21, 40)  # one decode-sized, one just over the 16-token budget, one ~3 chunks
MIN_MARGIN = 1e-2  # top-1 vs top-2 logit gap required on the reference path

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)

VARIANTS = {
    "llama": lambda: LlamaConfig(**TINY),
    "llama-tied-smollm2": lambda: LlamaConfig(**TINY, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "llama-untied-bias": lambda: LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=True,
                                             mlp_bias=True),
    "llama3-rope": lambda: LlamaConfig(**TINY, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**TINY),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16),
    "qwen3-bias-wide-head": lambda: Qwen3Config(**TINY, head_dim=32, attention_bias=True),
}


def randomize(model: torch.nn.Module, seed: int, std: float = 0.5) -> None:
    """Large random weights (biases too, which HF initializes to zero; norms near one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(std * noise)


def build_tiny_model(config, folder, default_model_dir: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed)
    if getattr(config, "tie_word_embeddings", False):
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{default_model_dir}/{name}", folder)
    return model


def min_margin(model, prompt: list[int], continuation: list[int]) -> float:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_model_matches_transformers(variant, tmp_path, default_model_dir):
    config = VARIANTS[variant]()
    hf = build_tiny_model(config, tmp_path, default_model_dir)
    rng = random.Random(variant)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]

    llm = LLM(str(tmp_path), dtype="float32", kv_cache_gb=0.05, max_num_batched_tokens=16, host_kv_gb=0.001)
    spec = llm.engine.spec
    assert spec.model_type == config.model_type
    assert spec.num_kv_heads == 2 and spec.num_heads == 4
    assert spec.tie_word_embeddings == bool(getattr(config, "tie_word_embeddings", False))
    assert (llm.engine.model.lm_head is None) == spec.tie_word_embeddings

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.device.num_blocks

    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf, prompt, NEW_TOKENS)
        margin = min_margin(hf, prompt, ref)
        assert margin > MIN_MARGIN, f"near-tie in the reference ({margin:.2e}); pick another seed"
        assert out.finish_reason == "length"
        assert out.token_ids == ref, f"{variant}, prompt of {len(prompt)} tokens"


def test_llama3_rope_differs_from_default():
    """The llama3 variant above is only a real test if its RoPE frequencies are actually rescaled."""
    scaled = ModelSpec.from_hf_config(VARIANTS["llama3-rope"]())
    plain = ModelSpec.from_hf_config(LlamaConfig(**TINY, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 500000.0}))
    inv_scaled, _ = scaled.rope_inv_freq()
    inv_plain, _ = plain.rope_inv_freq()
    assert inv_scaled.shape == inv_plain.shape == (TINY["hidden_size"] // TINY["num_attention_heads"] // 2,)
    assert torch.allclose(inv_scaled[0], inv_plain[0])  # highest frequency is kept
    assert not torch.allclose(inv_scaled, inv_plain)  # low frequencies are divided by `factor`


def test_unsupported_model_type_is_rejected(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        LLM(str(tmp_path), dtype="float32", kv_cache_gb=0.01)
    message = str(info.value)
    assert "gpt2" in message
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in message
    assert isinstance(info.value, ValueError)  # callers catching ValueError still see it


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path), dtype="float32", kv_cache_gb=0.01)
