"""Every supported architecture, as a tiny random model built locally, against transformers fp32.

Each model is saved with `save_pretrained` (safetensors) next to the default model's tokenizer files,
loaded by the engine, and its greedy continuations of three token-id prompts are compared with HF
`generate` (16-token step budget: the 40-token prompt is prefilled in chunks next to the other
prompts' decodes). Weights are random with spread-out logits so that the argmax at every step is far
from a tie, and the test checks that margin on the reference path, so a near-tie would show up as an
explicit failure of the test's premise rather than as a flaky mismatch.

Also here: configurations the engine must reject or handle (unsupported model types, sliding-window
attention, requests larger than the KV pool, max_model_len below the config's positions).
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config, SmolLM3Config)

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
    # RoPE in layer 0, none in layer 1 (SmolLM3-3B: none in every 4th); its own token ids are past this vocabulary
    "smollm3": lambda: SmolLM3Config(**TINY, no_rope_layer_interval=2, bos_token_id=1, eos_token_id=2,
                                     pad_token_id=None),
}


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch, default_model_dir):
    """Whatever the engine caches for these throwaway models (e.g. a measured profile) goes to a
    temporary folder, not the user's cache. `default_model_dir` is resolved first, from the real one."""
    monkeypatch.setenv("INFERCEPT_CACHE", str(tmp_path_factory.mktemp("infercept-cache")))


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights that keep activations O(1) but spread the logits far apart.

    Biases get random values too (HF initializes them to zero, which would hide a bias that is loaded
    into the wrong place); norm weights are near one; the final norm is scaled up so that logits have a
    standard deviation of ~13 and top-1/top-2 gaps are large compared with fp32 rounding.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name == "model.norm.weight":
                p.copy_(8.0 * (1.0 + 0.2 * noise))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(0.2 * noise)


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
    model = llm.engine.model
    tied = model.lm_head is None or model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert tied == spec.tie_word_embeddings

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


def test_smollm3s_layer_without_rope_changes_what_it_generates(tmp_path, default_model_dir):
    """The smollm3 variant above is only a real test if its layer without RoPE changes the output:
    transformers' model with RoPE in that layer too generates something else."""
    config = VARIANTS["smollm3"]()
    assert config.no_rope_layers == [1, 0]
    assert ModelSpec.from_hf_config(config).unrotated_layers == {1}
    hf = build_tiny_model(config, tmp_path, default_model_dir)
    prompt = [random.Random("smollm3").randrange(3, VOCAB) for _ in range(PROMPT_LENGTHS[-1])]
    as_configured = hf_greedy(hf, prompt, NEW_TOKENS)
    hf.model.layers[1].self_attn.use_rope = 1
    assert hf_greedy(hf, prompt, NEW_TOKENS) != as_configured


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


# -- sliding-window attention ------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["mistral", "qwen2"])
def test_sliding_window_config_is_honoured_or_rejected(variant, tmp_path, default_model_dir):
    """A config with an active sliding window (Mistral 7B v0.1 has 4096; Qwen2/3 with
    use_sliding_window) attends only to the last `sliding_window` keys. The engine must either do the
    same or refuse sequences longer than the window; silently attending to everything is wrong."""
    window = 8
    if variant == "mistral":
        config = MistralConfig(**TINY, sliding_window=window)
    else:
        config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=window, max_window_layers=0)
    assert "sliding_attention" in (getattr(config, "layer_types", None) or ["sliding_attention"])
    hf = build_tiny_model(config, tmp_path, default_model_dir)
    rng = random.Random(variant)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 30)]
    refs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    # The premise: with this window HF's output differs from full causal attention.
    hf.config.sliding_window = None
    if hasattr(hf.config, "layer_types"):
        hf.config.layer_types = ["full_attention"] * config.num_hidden_layers
        for layer in hf.model.layers:
            layer.self_attn.sliding_window = None
        hf.model.has_sliding_layers = False
    assert hf_greedy(hf, prompts[1], NEW_TOKENS) != refs[1]

    try:
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_gb=0.05, max_num_batched_tokens=16,
                  host_kv_gb=0.001)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    except (ValueError, UnsupportedModelError):
        return  # refusing is acceptable
    assert [o.token_ids for o in outs] == refs


# -- a request that can never fit the KV pool ----------------------------------------------------------

def test_request_outgrowing_the_whole_pool_terminates(tmp_path, default_model_dir):
    """A pool of 4 blocks x 16 tokens = 64 tokens; a 40-token prompt asking for 40 more tokens can
    never hold all its KV. The engine must end it (e.g. finish_reason "length" at the pool's
    capacity) or refuse it up front, not preempt-and-recompute it forever."""
    hf = build_tiny_model(LlamaConfig(**TINY), tmp_path, default_model_dir)
    del hf
    from infercept.engine.kv_cache import GIB, KVCache
    from infercept.engine.model_loader import load_spec

    spec = load_spec(str(tmp_path))
    block_bytes = KVCache.block_bytes(spec, torch.float32, 16)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_gb=4 * block_bytes / GIB, max_num_batched_tokens=16,
              host_kv_gb=0.0001)
    engine = llm.engine
    assert engine.block_manager.device.num_blocks == 4
    prompt = list(range(100, 140))
    try:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    except ValueError:
        return  # refusing up front is acceptable
    final = None
    for _ in range(200):  # 3 prefill chunks + at most 40 decodes if it ran to completion
        for out in engine.step():
            engine.block_manager.check_integrity()
            if out.finished:
                final = out
        if not engine.has_unfinished_requests():
            break
    assert final is not None, "request never finished: preempted and recomputed forever"
    assert len(prompt) + len(final.token_ids) <= 4 * 16
    assert final.finish_reason == "length"
    assert engine.block_manager.num_free_blocks == 4


# -- max_model_len ---------------------------------------------------------------------------------------

def test_max_model_len_limits_prompt_and_generation(tmp_path, default_model_dir):
    """`max_model_len` below the config's max_position_embeddings: the engine starts, refuses prompts
    of max_model_len tokens and ends generation with "length" when a sequence reaches it."""
    hf = build_tiny_model(LlamaConfig(**TINY), tmp_path, default_model_dir)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_gb=0.05, max_num_batched_tokens=16, host_kv_gb=0.001,
              max_model_len=48)
    assert llm.engine.config.scheduler.max_model_len == 48
    with pytest.raises(ValueError):
        llm.engine.add_request(list(range(100, 148)), SamplingParams(temperature=0))
    prompt = list(range(100, 140))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 48
    assert out.token_ids == hf_greedy(hf, prompt, 8)
