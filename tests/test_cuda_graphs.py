"""Steps through the static buffers of `cuda_graphs.py`: decode-only steps and mixed steps.

On the CPU the static-shape forward runs without capture: the same buffers, padding and scratch block a
CUDA graph replays, checked token by token against transformers and slot by slot against what a step may
write (with torch implementations of the kernels' contracts in-process, and with the Triton kernels under
Triton's interpreter in a child process). On a GPU (`pytest -m gpu`) the captured graphs are checked
against the same code launched without graphs."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import hf_greedy
from infercept.engine import LLM, SamplingParams
from infercept.engine.attention import paged_prefill_reference
from infercept.engine.cuda_graphs import DecodeGraphs, MixedGraphs, padded_batch_sizes, padded_token_counts
from infercept.engine.outputs import ScheduledChunk, SchedulerOutput
from infercept.engine.triton_prefill import NO_ROWS

CUDA = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, " * 6, "1, 2, 3,",
           "A haiku about the sea:"]


def test_padded_batch_sizes():
    assert padded_batch_sizes(1) == [1]
    assert padded_batch_sizes(5) == [1, 2, 4, 5]
    assert padded_batch_sizes(8) == [1, 2, 4, 8]
    assert padded_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert padded_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_padded_token_counts():
    assert padded_token_counts(16) == [16]
    assert padded_token_counts(40) == [16, 32, 48]
    assert padded_token_counts(256) == [16, 32, 48, 64, 96, 128, 192, 256]
    assert padded_token_counts(2048) == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert padded_token_counts(300) == [16, 32, 48, 64, 96, 128, 192, 256, 304]


def static_graphs(engine, max_batch: int = 8) -> DecodeGraphs:
    """The decode graphs' buffers and forward on the engine's model, without capture."""
    return DecodeGraphs(engine.model, engine.kv_cache, engine.config.device, max_batch,
                        engine.config.scheduler.max_model_len, decode_kernel=None)


def static_mixed_graphs(engine, max_tokens: int = 32, max_seqs: int = 8) -> MixedGraphs:
    """The mixed-step graphs' buffers and forward, without capture, with the kernel's torch reference."""
    return MixedGraphs(engine.model, engine.kv_cache, engine.config.device, max_tokens, max_seqs,
                       engine.config.scheduler.max_model_len, paged_prefill_reference)


def test_static_decode_path_matches_transformers(engine, hf_model_fp32, monkeypatch):
    """Five requests of different lengths: decode steps of 5, then fewer as they finish (padded to 8, 4,
    2), each through the static buffers; every request's greedy tokens equal transformers'."""
    graphs = static_graphs(engine)
    batches = []
    stage = graphs.stage
    monkeypatch.setattr(graphs, "stage", lambda output: batches.append(len(output.chunks)) or stage(output))
    monkeypatch.setattr(engine.runner, "graph_sets", [graphs])
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


def test_the_eager_path_pads_block_tables_with_the_scratch_block(engine, monkeypatch):
    """Eager decode block tables are padded with the scratch block, as the graphs' are, and a pass waits
    for copies over its requests' blocks alone: block 0 is a request's block like any other, and when
    the padding named it, a pass waited for any swap-in that wrote block 0, its own step's too (an H100
    trace, 2026-11-28)."""
    runner, scratch = engine.runner, engine.kv_cache.scratch_block
    params = SamplingParams(temperature=0)
    chunks = [ScheduledChunk("a", [1], 20, [3, 7], True, params, 0),
              ScheduledChunk("b", [2], 40, [9, 2, 4], True, params, 0)]
    _, _, meta = runner.build_metadata(SchedulerOutput(chunks=chunks))
    assert meta.decode_key_blocks.view(2, -1).tolist() == [[3, 7, scratch], [9, 2, 4]]
    waited_over = []
    monkeypatch.setattr(engine.kv_cache, "wait_for_copies", lambda blocks: waited_over.append(sorted(blocks)))
    before = engine.kv_cache.device_kv.clone()
    runner.run(SchedulerOutput(chunks=chunks))
    engine.kv_cache.device_kv.copy_(before)  # the shared engine's blocks as they were
    assert waited_over == [[2, 3, 4, 7, 9]]


def test_static_mixed_path_matches_transformers(engine, hf_model_fp32, monkeypatch):
    """Steps with prefill chunks through the mixed graphs' buffers (32-token steps: prompts in chunks,
    later requests' prefills beside earlier ones' decodes), decode-only steps through the decode graphs';
    every request's greedy tokens equal transformers'."""
    decode, mixed = static_graphs(engine), static_mixed_graphs(engine)
    steps = []
    stage = mixed.stage
    monkeypatch.setattr(mixed, "stage", lambda output: steps.append(
        (mixed.rows_of(output), len(output.chunks), any(len(c.token_ids) == 1 for c in output.chunks)))
        or stage(output))
    monkeypatch.setattr(engine.runner, "graph_sets", [decode, mixed])
    lengths = [6, 9, 12, 3, 7]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS[:2], params[:2])]
    done = {}
    for _ in range(3):
        done |= {o.request_id: o for o in engine.step() if o.finished}
    ids += [engine.add_request(p, q) for p, q in zip(PROMPTS[2:], params[2:])]
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert any(with_decode and n > 1 for _, n, with_decode in steps), steps  # decodes beside a prefill
    assert {16, 32} <= {mixed.padded(rows) for rows, _, _ in steps}, steps  # padded to both sizes
    for request_id, n in zip(ids, lengths):
        prompt = done[request_id].prompt_token_ids
        assert done[request_id].token_ids == hf_greedy(hf_model_fp32, prompt, n)


def test_mixed_padding_writes_only_the_scratch_block(engine):
    """A 5-token chunk after 20 cached tokens and a decode, padded to 16 rows: the step writes the six
    new tokens' slots and the scratch block, nothing else; the buffers say which rows are whose."""
    mixed = static_mixed_graphs(engine, max_tokens=32, max_seqs=4)
    bs, scratch = engine.kv_cache.block_size, engine.kv_cache.scratch_block
    params = SamplingParams(temperature=0)
    chunks = [ScheduledChunk("a", [11, 12, 13, 14, 15], 20, [3, 7], True, params, 0),
              ScheduledChunk("b", [21], 40, [9, 2, 4], True, params, 0)]
    engine.kv_cache.device_kv[:, :, scratch] = 0
    before = engine.kv_cache.device_kv.clone()
    hidden = mixed.run(SchedulerOutput(chunks=chunks))
    assert hidden.shape[0] == 16
    assert mixed.input_ids[:7].tolist() == [11, 12, 13, 14, 15, 21, 0]
    assert mixed.positions[:7].tolist() == [20, 21, 22, 23, 24, 40, 0]
    assert mixed.slot_mapping[:7].tolist() == [7 * bs + 4, 7 * bs + 5, 7 * bs + 6, 7 * bs + 7, 7 * bs + 8,
                                                4 * bs + 8, scratch * bs]
    assert mixed.query_start.tolist() == [0, 5, 6, 6, 6] and mixed.seq_lens.tolist() == [25, 41, 0, 0]
    assert mixed.block_tables[:2, :3].tolist() == [[3, 7, 0], [9, 2, 4]]
    programs = mixed.programs[16]
    assert mixed.map_seq[:programs].tolist()[:2] == [0, 1]
    assert mixed.map_row[:programs].tolist() == [0, 0] + [NO_ROWS] * (programs - 2)
    changed = (engine.kv_cache.device_kv != before).flatten(4).any(-1).any(0).any(0)
    written = {(int(b), int(s)) for b, s in changed.nonzero()}
    assert written - {(scratch, 0)} == {(7, 4), (7, 5), (7, 6), (7, 7), (7, 8), (4, 8)}
    assert (scratch, 0) in written
    engine.kv_cache.device_kv.copy_(before)


def test_mixed_graphs_take_steps_up_to_their_sizes(engine):
    mixed = static_mixed_graphs(engine, max_tokens=32, max_seqs=2)
    params = SamplingParams(temperature=0)
    chunk = lambda name, n: ScheduledChunk(name, [1] * n, 0, [0, 1], True, params, 0)  # noqa: E731
    assert mixed.fits(SchedulerOutput(chunks=[chunk("a", 30), chunk("b", 2)]))
    assert not mixed.fits(SchedulerOutput(chunks=[chunk("a", 30), chunk("b", 3)]))  # 33 tokens
    assert not mixed.fits(SchedulerOutput(chunks=[chunk("a", 1), chunk("b", 1), chunk("c", 1)]))  # 3 sequences
    assert not mixed.fits(SchedulerOutput(chunks=[]))


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
from infercept.engine.cuda_graphs import DecodeGraphs, MixedGraphs
from infercept.engine.model_runner import gpu_attention_kernels
from infercept.engine.triton_decode import paged_decode_attention
from infercept.engine.triton_prefill import paged_prefill_attention
llm = LLM(sys.argv[1], dtype="float32", device="cpu", kv_cache_gb=0.01, max_num_seqs=4, max_num_batched_tokens=16,
          progress=False)
engine = llm.engine
args = (engine.model, engine.kv_cache, engine.config.device)
decode = DecodeGraphs(*args, 4, engine.config.scheduler.max_model_len, paged_decode_attention)
mixed = MixedGraphs(*args, 16, 4, engine.config.scheduler.max_model_len, paged_prefill_attention)
engine.runner.graph_sets = [decode, mixed]
runs = {"decode": 0, "mixed": 0}
for name, graphs in (("decode", decode), ("mixed", mixed)):
    graphs.stage = lambda output, stage=graphs.stage, name=name: runs.__setitem__(name, runs[name] + 1) or stage(output)
if sys.argv[2] == "fused":  # the GPU's fused kernels too (they serve 16-bit models there; any dtype runs them)
    from infercept.engine import triton_fused
    engine.model.use_fused_kernels(triton_fused)
prompts = [[5, 9, 12], list(range(20, 40)), [7] * 17]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 3, 4)]
kernels = [f.__globals__[k] for f, k in ((paged_decode_attention, "_paged_decode_kernel"),
                                         (paged_prefill_attention, "_paged_prefill_kernel"))]
print(json.dumps({"interpreted": [type(k).__name__ for k in kernels], "runs": runs,
                  "tokens": [o.token_ids for o in llm.generate(prompts, params)]}))
"""


@pytest.mark.parametrize("kernels, variant", [("torch", "llama"), ("fused", "llama"), ("fused", "smollm3")])
@pytest.mark.skipif(sys.platform != "linux", reason="Triton runs on Linux")
def test_static_paths_with_the_triton_kernels_match_transformers(tmp_path, default_model_dir, kernels, variant):
    """The GPU's step paths end to end on the CPU: both graph families' static buffers, padding into the
    scratch block and the Triton attention kernels (under the interpreter, in a child process: see
    test_triton_decode.py), 16-token steps so a prompt's chunks run beside other requests' decodes, on a
    tiny random Llama, token by token against transformers; "fused": with the fused Triton kernels of
    triton_fused (norms, SiLU, RoPE + cache write) as well, and on SmolLM3's shape (a layer without RoPE)."""
    from test_architectures import VARIANTS, build_tiny_model

    hf = build_tiny_model(VARIANTS[variant](), tmp_path / "model", default_model_dir)
    env = {**os.environ, "TRITON_INTERPRET": "1", "INFERCEPT_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", TRITON_GRAPH_PATH, str(tmp_path / "model"), kernels], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["interpreted"] == ["InterpretedFunction"] * 2
    assert result["runs"]["decode"] > 0 and result["runs"]["mixed"] > 0, result["runs"]
    expected = [hf_greedy(hf, p, n) for p, n in (([5, 9, 12], 5), (list(range(20, 40)), 3), ([7] * 17, 4))]
    assert result["tokens"] == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_the_eager_engine(default_model_dir, dtype, monkeypatch):
    """Steps replayed from captured graphs give the same code's tokens launched without graphs
    (`enforce_eager`: the same kernels, so bit for bit, in fp32 and bf16): decode steps whose batch
    shrinks through padded sizes, and mixed steps (a long prompt in 64-token chunks beside decodes)."""
    kwargs = dict(dtype=dtype, device="cuda", kv_cache_gb=0.25, host_kv_gb=0.05, max_num_batched_tokens=64, max_num_seqs=8,
                  progress=False)
    graphed = LLM(default_model_dir, **kwargs)
    eager = LLM(default_model_dir, enforce_eager=True, **kwargs)
    decode, mixed = graphed.engine.runner.graph_sets
    assert sorted(decode.graphs) == [1, 2, 4, 8] and sorted(mixed.graphs) == padded_token_counts(2048)
    assert graphed.engine.runner.cuda_graphs and not eager.engine.runner.cuda_graphs
    assert all(not graphs.graphs for graphs in eager.engine.runner.graph_sets)
    # 16-bit models on a GPU run the fused Triton kernels (tests/test_triton_fused.py), fp32 ones the torch path
    from infercept.engine import triton_fused
    assert graphed.engine.model.norm.kernels is (triton_fused if dtype == "bfloat16" else None)
    replays = []
    for graphs in (decode, mixed):
        stage = graphs.stage
        monkeypatch.setattr(graphs, "stage", lambda output, graphs=graphs, stage=stage: replays.append(
            (graphs, graphs.rows_of(output))) or stage(output))
    prompts = PROMPTS + ["Tell me a long story about the sea. " * 12]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 12, 3, 7, 5)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == \
        [o.token_ids for o in eager.generate(prompts, params)]
    assert {5, 1} <= {rows for graphs, rows in replays if graphs is decode}, replays  # 5 pads to 8
    assert len({rows for graphs, rows in replays if graphs is mixed}) >= 2, replays
