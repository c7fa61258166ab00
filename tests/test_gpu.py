"""CUDA paths: run with `pytest -m gpu` on a GPU host; skipped cleanly without one."""
import pytest
import torch

from infercept.engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_cuda_matches_cpu_fp32(default_model_dir, llm_fp32):
    gpu = LLM(default_model_dir, dtype="float32", device="cuda", kv_cache_gb=0.25, max_num_batched_tokens=32)
    assert [o.token_ids for o in gpu.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in llm_fp32.generate(PROMPTS, GREEDY)]


def test_cuda_bf16_varlen_kernel_matches_torch_path(default_model_dir):
    """With flash-attn installed the runner uses its varlen kernel; compare it with the torch path."""
    fast = LLM(default_model_dir, dtype="bfloat16", device="cuda", kv_cache_gb=0.25, max_num_batched_tokens=32)
    reference = LLM(default_model_dir, dtype="bfloat16", device="cuda", kv_cache_gb=0.25, max_num_batched_tokens=32)
    reference.engine.runner.use_varlen = False
    a = [o.token_ids for o in fast.generate(PROMPTS, GREEDY)]
    b = [o.token_ids for o in reference.generate(PROMPTS, GREEDY)]
    # bf16 kernels round differently; the first tokens must agree, later ones nearly always do.
    assert [x[:4] for x in a] == [x[:4] for x in b]


def test_swap_round_trip_on_cuda_pinned_host_pool(default_model_dir):
    from infercept.engine import Engine

    engine = Engine(default_model_dir, dtype="bfloat16", device="cuda", kv_cache_gb=0.1, host_kv_gb=0.05)
    assert engine.kv_cache.host_kv.is_pinned()
    kv = engine.kv_cache
    kv.device_kv[:, :, 3].normal_()
    before = kv.device_kv[:, :, 3].clone()
    kv.copy_blocks_out([(3, 0)])
    kv.device_kv[:, :, 3].zero_()
    kv.copy_blocks_in([(0, 3)])
    torch.cuda.synchronize()
    assert torch.equal(kv.device_kv[:, :, 3], before)
