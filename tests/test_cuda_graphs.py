"""Decode-only steps through the static buffers of `decode_graphs.py`.

On the CPU the static-shape forward runs eagerly (`capture=False`): the same buffers, padding and
scratch block a CUDA graph replays, checked token by token against transformers and slot by slot
against what a step may write. On a GPU (`pytest -m gpu`) the captured graphs are checked against the
eager engine."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

from conftest import hf_greedy
from infercept.engine import LLM, SamplingParams
from infercept.engine.decode_graphs import DecodeGraphs, padded_batch_sizes
from infercept.engine.outputs import ScheduledChunk, SchedulerOutput

CUDA = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 6, "1, 2, 3,",
           "A haiku about the sea:"]


def test_padded_batch_sizes():
    assert padded_batch_sizes(1) == [1]
    assert padded_batch_sizes(5) == [1, 2, 4, 5]
    assert padded_batch_sizes(8) == [1, 2, 4, 8]
    assert padded_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert padded_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def static_graphs(engine, max_batch: int = 8) -> DecodeGraphs:
    """The graph path's buffers and forward on the engine's model, run eagerly."""
    return DecodeGraphs(engine.model, engine.kv_cache, engine.config.device, max_batch,
                        engine.config.scheduler.max_model_len, decode_kernel=None, capture=False)


def test_static_decode_path_matches_transformers(engine, hf_model_fp32, monkeypatch):
    """Five requests of different lengths: decode steps of 5, then fewer as they finish (padded to 8, 4,
    2), each through the static buffers; every request's greedy tokens equal transformers'."""
    graphs = static_graphs(engine)
    batches = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda output: batches.append(len(output.chunks)) or run(output))
    monkeypatch.setattr(engine.runner, "graphs", graphs)
    lengths = [6, 9, 12, 3, 7]  # different finishing steps: the batch shrinks through every padded size
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
           for p, n in zip(PROMPTS, lengths)]
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert {5, 3, 1} <= set(batches), batches  # padded to 8, 4 and run unpadded at 1
    for request_id, n in zip(ids, lengths):
        prompt = done[request_id].prompt_token_ids
        assert done[request_id].token_ids == hf_greedy(hf_model_fp32, prompt, n)


def test_padding_writes_only_the_scratch_block(engine):
    """Three decodes padded to four: the step writes the three requests' slots and the scratch block,
    nothing else of the pool; the buffers hold each row's inputs and the padding row points at scratch."""
    graphs = static_graphs(engine)
    bs, scratch = engine.kv_cache.block_size, engine.kv_cache.scratch_block
    params = SamplingParams(temperature=0)
    tables = [[3, 7], [5], [9, 2, 4]]  # blocks in no particular order; positions 20, 0 and 40
    chunks = [ScheduledChunk(f"r{i}", [100 + i], pos, table, True, params, 0)
              for i, (pos, table) in enumerate(zip([20, 0, 40], tables))]
    engine.kv_cache.device_kv[:, :, scratch] = 0  # earlier padding left the same K/V there
    before = engine.kv_cache.device_kv.clone()
    graphs.run(SchedulerOutput(chunks=chunks))
    assert graphs.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert graphs.positions[:4].tolist() == [20, 0, 40, 0]
    assert graphs.slot_mapping[:4].tolist() == [7 * bs + 4, 5 * bs, 4 * bs + 8, scratch * bs]
    assert graphs.context_lens[:4].tolist() == [21, 1, 41, 1]
    assert graphs.block_tables[:4, :3].tolist() == [[3, 7, scratch], [5, scratch, scratch], [9, 2, 4],
                                                    [scratch] * 3]
    changed = (engine.kv_cache.device_kv != before).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]
    written = {(int(b), int(s)) for b, s in changed.nonzero()}
    assert written - {(scratch, 0)} == {(7, 4), (5, 0), (4, 8)}
    assert (scratch, 0) in written  # the padding row's K/V went to the scratch block
    engine.kv_cache.device_kv.copy_(before)  # the shared engine's blocks as they were


@pytest.mark.parametrize("batch", [1, 3])
def test_static_path_takes_only_decode_steps_that_fit(engine, batch):
    graphs = static_graphs(engine, max_batch=2)
    params = SamplingParams(temperature=0)
    decodes = [ScheduledChunk(f"r{i}", [1], 5, [i], True, params, 0) for i in range(batch)]
    assert graphs.fits(SchedulerOutput(chunks=decodes)) == (batch <= 2)
    prefill = ScheduledChunk("p", [1, 2], 0, [9], True, params, 0)
    assert not graphs.fits(SchedulerOutput(chunks=[prefill]))
    assert not graphs.fits(SchedulerOutput(chunks=[]))


TRITON_GRAPH_PATH = """
import json, sys
from infercept.engine import LLM, SamplingParams
from infercept.engine.decode_graphs import DecodeGraphs
from infercept.engine.model_runner import gpu_decode_kernel
from infercept.engine.triton_decode import paged_decode_attention
llm = LLM(sys.argv[1], dtype="float32", device="cpu", kv_cache_gb=0.01, max_num_seqs=4, progress=False)
engine = llm.engine
engine.runner.graphs = DecodeGraphs(engine.model, engine.kv_cache, engine.config.device, 4,
                                    engine.config.scheduler.max_model_len, paged_decode_attention, capture=False)
if sys.argv[2] == "fused":  # the GPU's fused kernels too (they serve 16-bit models there; any dtype runs them)
    from infercept.engine import triton_fused
    engine.model.use_fused_kernels(triton_fused)
prompts = [[5, 9, 12], list(range(20, 40)), [7] * 17]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 3, 4)]
print(json.dumps({"interpreted": type(paged_decode_attention.__globals__["_paged_decode_kernel"]).__name__,
                  "tokens": [o.token_ids for o in llm.generate(prompts, params)]}))
"""


@pytest.mark.parametrize("kernels", ["torch", "fused"])
@pytest.mark.skipif(sys.platform != "linux", reason="Triton runs on Linux")
def test_static_decode_path_with_the_triton_kernel_matches_transformers(tmp_path, default_model_dir, kernels):
    """The GPU's decode path end to end on the CPU: static buffers, padding into the scratch block and the
    Triton kernel (under its interpreter, in a child process: see test_triton_decode.py), on a tiny
    random Llama, token by token against transformers; "fused": with the fused Triton kernels of
    triton_fused (norms, SiLU, RoPE + cache write) in prefill and decode steps as well."""
    from test_architectures import TINY, build_tiny_model

    hf = build_tiny_model(LlamaConfig(**TINY), tmp_path / "model", default_model_dir)
    env = {**os.environ, "TRITON_INTERPRET": "1", "INFERCEPT_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", TRITON_GRAPH_PATH, str(tmp_path / "model"), kernels], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["interpreted"] == "InterpretedFunction"
    expected = [hf_greedy(hf, p, n) for p, n in (([5, 9, 12], 5), (list(range(20, 40)), 3), ([7] * 17, 4))]
    assert result["tokens"] == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_the_eager_engine(default_model_dir, dtype, monkeypatch):
    """Decode steps replayed from captured graphs give the eager engine's greedy tokens (fp32 and bf16),
    with requests of several lengths so the batch shrinks through padded sizes."""
    kwargs = dict(dtype=dtype, device="cuda", kv_cache_gb=0.25, max_num_batched_tokens=64, max_num_seqs=8,
                  progress=False)
    graphed = LLM(default_model_dir, **kwargs)
    eager = LLM(default_model_dir, enforce_eager=True, **kwargs)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    # 16-bit models on a GPU run the fused Triton kernels (tests/test_triton_fused.py), fp32 ones the torch path
    from infercept.engine import triton_fused
    assert graphed.engine.model.norm.kernels is (triton_fused if dtype == "bfloat16" else None)
    assert eager.engine.runner.graphs is None
    replays = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda output: replays.append(len(output.chunks)) or run(output))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 12, 3, 7)]
    assert [o.token_ids for o in graphed.generate(PROMPTS, params)] == \
        [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert {5, 3, 1} <= set(replays)

