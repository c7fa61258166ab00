"""The vLLM backend on NVIDIA GPUs: tensor parallelism, and vLLM's asynchronous scheduling with our
`AsyncInterceptScheduler` (`--async-scheduling`).

On a GPU host (two GPUs for the tensor-parallel tests), with the GPU build of vLLM in `.venv-vllm`:

    make vllm-env                                   # vllm==0.32.0 where nvidia-smi exists (Makefile)
    .venv/bin/python -m pytest -m gpu tests/test_vllm_gpu.py

The GPU tests are marked `gpu` and skip without a CUDA device (the tensor-parallel ones without two), or
without the vLLM environment. They have never run on the machines this project is developed on, which have
no GPU: what they would find there is unknown until they run on one. The tests at the top need no GPU and
run everywhere: the flags for asynchronous scheduling and the scheduler they give vLLM, vLLM's own defaults
where no flag is given, `--vllm-arg` and the named vLLM flags, what the backend refuses before vLLM starts
(data parallelism, a scheduler or connector of one's own under a session policy), and the model the
tensor-parallel tests shard.

Each GPU test is the tool-call pause/resume of tests/test_vllm_backend.py: a turn writes a get_weather call
and pauses with its KV inside vLLM, the tool result is appended, and the resumed turn reuses the paused KV
and decodes greedily what a fresh request of the whole context decodes. `alongside`: while another
request decodes in the same batches, which is where asynchronous scheduling (step N+1 scheduled before step
N's tokens are known) differs from synchronous. float32, as there: in half precision near-tied logits flip
between a full prefill and a resumed one.
"""
from __future__ import annotations

import ast
import asyncio
import glob
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_vllm_backend import (QUESTION, VLLM_PYTHON, WEATHER, chat_prompt, greedy, needs_vllm, run_turn,
                               tool_result_tokens, tool_turn_prompt, wait_for)

from infercept.engine.backend import InterceptParams

from unstarted_worker import WorkerStarted

ROOT = Path(__file__).resolve().parent.parent
GPU = (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), needs_vllm)
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor_parallel_size=2 needs two CUDA devices")
# A share of the GPU vLLM may claim (it checks at start that this much is free) and a KV pool of 1 GiB:
# ~23,000 float32 tokens of SmolLM2, ample here, and room for a second process on a shared GPU.
GPU_ENGINE_ARGS = {"gpu_memory_utilization": 0.4}
KV_CACHE_GB = 1.0


def gpu_test(cls):
    for mark in GPU:
        cls = mark(cls)
    return cls


# -- without a GPU: the flag, the engine arguments, the model the tensor-parallel tests shard --------------


def serve(*flags: str):
    from infercept.server import cli

    return cli.build_parser().parse_args(["serve", "--model", "/nonexistent/model", "--vllm-python",
                                          sys.executable, *flags])


@pytest.mark.parametrize("flags,policy,scheduler,async_scheduling", [
    ((), "infercept", "intercept_scheduler", None),  # vLLM's own choice, which intercept_scheduler follows
    (("--async-scheduling",), "infercept", "AsyncInterceptScheduler", True),
    (("--no-async-scheduling",), "infercept", "InterceptScheduler", False),
    (("--policy", "preserve", "--async-scheduling"), "preserve", "AsyncInterceptScheduler", True),
    (("--policy", "prefix-cache"), "prefix-cache", None, None),  # stock vLLM: its own default
    (("--policy", "prefix-cache", "--async-scheduling"), "prefix-cache", None, True),
])
def test_the_async_scheduling_flag_reaches_vllm_with_our_async_scheduler(worker_configs, flags, policy, scheduler,
                                                                         async_scheduling):
    from infercept.server import cli

    with pytest.raises(WorkerStarted):
        cli.build_backend(serve("--backend", "vllm", *flags))
    (config,) = worker_configs
    engine = config["engine"]
    assert engine.get("async_scheduling") == async_scheduling
    if scheduler is None:
        assert "scheduler_cls" not in engine and not config["policy_channel"]
    else:
        assert engine["scheduler_cls"] == f"engine.vllm_backend.scheduler.{scheduler}"
        assert engine["additional_config"]["infercept"]["policy"] == policy


def test_the_async_scheduling_flag_reaches_either_backend(monkeypatch):
    from infercept.server import cli

    monkeypatch.delenv("INFERCEPT_ASYNC_SCHEDULING", raising=False)
    assert cli.vllm_engine_args(serve("--backend", "vllm", "--async-scheduling")) == {"async_scheduling": True}
    assert cli.vllm_engine_args(serve("--backend", "vllm", "--no-async-scheduling")) == {"async_scheduling": False}
    assert cli.vllm_engine_args(serve("--backend", "vllm")) == {}
    assert cli.engine_kwargs(serve("--async-scheduling"))["async_scheduling"] is True
    with pytest.raises(SystemExit, match="--async-scheduling needs the output stage"):
        cli.build_backend(serve("--backend", "native", "--async-scheduling", "--no-async-output"))
    assert serve().async_scheduling is None
    monkeypatch.setenv("INFERCEPT_ASYNC_SCHEDULING", "1")
    assert serve().async_scheduling is True
    monkeypatch.setenv("INFERCEPT_ASYNC_SCHEDULING", "0")
    assert serve().async_scheduling is False


def test_the_schedulers_the_backend_names_exist_in_the_repository(worker_configs):
    """vLLM imports them by name from the repository root (scheduler.py needs vLLM, so it is read, not
    imported, here): each class subclasses the vLLM scheduler its scheduling mode expects, and the
    function named when vLLM chooses builds one of the two (tests/vllm_scheduler_cases.py runs it)."""
    from infercept.engine.vllm_backend.backend import ASYNC_SCHEDULER_CLS, SCHEDULER_CLS
    from infercept.server import cli

    with pytest.raises(WorkerStarted):
        cli.build_backend(serve("--backend", "vllm"))
    chosen_by_vllm = worker_configs[0]["engine"]["scheduler_cls"]
    bases = {"InterceptScheduler": "Scheduler", "AsyncInterceptScheduler": "AsyncScheduler"}
    for dotted in (SCHEDULER_CLS, ASYNC_SCHEDULER_CLS, chosen_by_vllm):
        module, name = dotted.rsplit(".", 1)
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        (node,) = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name]
        if isinstance(node, ast.ClassDef):
            assert bases[name] in {b.id for b in node.bases if isinstance(b, ast.Name)}
        else:
            assert set(bases) <= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}, name


def test_vllms_own_defaults_stay_vllms_unless_given(worker_configs, monkeypatch):
    """Unset, the server hands vLLM no max_num_seqs, max_num_batched_tokens or async_scheduling (vLLM then
    takes what `vllm serve` takes on the hardware, worker.py); given, each reaches it."""
    from infercept.server import cli

    for name in ("MAX_NUM_SEQS", "MAX_NUM_BATCHED_TOKENS", "ASYNC_SCHEDULING"):
        monkeypatch.delenv(f"INFERCEPT_{name}", raising=False)
    for policy in ("infercept", "prefix-cache"):
        with pytest.raises(WorkerStarted):
            cli.build_backend(serve("--backend", "vllm", "--policy", policy))
    with pytest.raises(WorkerStarted):
        cli.build_backend(serve("--backend", "vllm", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                                "--no-async-scheduling"))
    *defaults, given = (config["engine"] for config in worker_configs)
    for engine in defaults:
        assert not {"max_num_seqs", "max_num_batched_tokens", "async_scheduling"} & set(engine), engine
    assert (given["max_num_seqs"], given["max_num_batched_tokens"], given["async_scheduling"]) == (8, 512, False)


def test_vllm_arg_passes_any_engine_argument_and_the_named_flags_reach_vllm(worker_configs, monkeypatch):
    from infercept.server import cli

    monkeypatch.setenv("INFERCEPT_KV_CACHE_DTYPE", "fp8_e5m2")
    with pytest.raises(WorkerStarted):
        cli.build_backend(serve("--backend", "vllm", "--quantization", "fp8", "--vllm-arg", "block_size=32",
                                "--vllm-arg", "max-num-partial-prefills=2",
                                "--vllm-arg", "enable_chunked_prefill=false",
                                "--vllm-arg", 'compilation_config={"cudagraph_mode": "PIECEWISE"}',
                                "--vllm-arg", "tokenizer_mode=slow", "--vllm-arg", "served_model_name=a=b",
                                "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5",
                                "--pipeline-parallel-size", "1"))
    engine = worker_configs[0]["engine"]
    assert {k: engine[k] for k in ("quantization", "kv_cache_dtype", "block_size", "max_num_partial_prefills",
                                   "enable_chunked_prefill", "compilation_config", "tokenizer_mode",
                                   "served_model_name", "tensor_parallel_size", "gpu_memory_utilization",
                                   "pipeline_parallel_size")} == {
        "quantization": "fp8", "kv_cache_dtype": "fp8_e5m2", "block_size": 32, "max_num_partial_prefills": 2,
        "enable_chunked_prefill": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"},
        "tokenizer_mode": "slow", "served_model_name": "a=b", "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.5, "pipeline_parallel_size": 1}
    for item, error in (("max_num_seqs=8", "flag of its own, --max-num-seqs"),
                        ("kv-cache-dtype=fp8", "flag of its own, --kv-cache-dtype"),
                        ("block_size", "expected KEY=VALUE")):
        with pytest.raises(ValueError, match=error):
            cli.build_backend(serve("--backend", "vllm", "--vllm-arg", item))
    with pytest.raises(SystemExit, match="--kv-cache-dtype, --vllm-arg only apply to --backend vllm"):
        cli.build_backend(serve("--backend", "native", "--vllm-arg", "block_size=32"))
    assert len(worker_configs) == 1


def test_the_policies_own_scheduler_and_connector_are_not_overridden(worker_configs):
    """Under a session policy the backend sets vLLM's scheduler_cls and kv_transfer_config itself: given
    by the user they are refused before vLLM starts; stock vLLM (prefix-cache) takes them. The user's
    additional_config keeps its keys beside the scheduler's."""
    from infercept.server import cli

    for item in ("scheduler_cls=my.Scheduler", 'kv_transfer_config={"kv_connector": "LMCacheConnectorV1"}'):
        with pytest.raises(ValueError, match="sets them itself"):
            cli.build_backend(serve("--backend", "vllm", "--vllm-arg", item))
    assert not worker_configs
    with pytest.raises(WorkerStarted):
        cli.build_backend(serve("--backend", "vllm", "--policy", "prefix-cache", "--vllm-arg", "scheduler_cls=my.S"))
    with pytest.raises(WorkerStarted):
        cli.build_backend(serve("--backend", "vllm", "--vllm-arg", 'additional_config={"mine": 1}'))
    stock, ours = (config["engine"] for config in worker_configs)
    assert stock["scheduler_cls"] == "my.S"
    assert ours["additional_config"]["mine"] == 1 and ours["additional_config"]["infercept"]["policy"] == "infercept"


@pytest.mark.parametrize("policy", ["infercept", "prefix-cache"])
def test_data_parallel_vllm_is_refused_before_the_worker_starts(worker_configs, policy):
    """data_parallel_size > 1 would start an engine core per rank, each with its own scheduler, while the
    worker links one policy channel (and reads one KV pool): refused in `create`, before any worker."""
    from infercept.engine import VllmBackend
    from infercept.server import cli

    with pytest.raises(ValueError, match="data_parallel_size=2 is not supported.*one policy channel"):
        VllmBackend.create("/nonexistent", python="/nonexistent/python", policy=policy,
                           engine_args={"data_parallel_size": 2})
    with pytest.raises(ValueError, match="data_parallel_size=2 is not supported"):
        cli.build_backend(serve("--backend", "vllm", "--policy", policy, "--vllm-arg", "data_parallel_size=2"))
    assert not worker_configs
    with pytest.raises(WorkerStarted):  # one rank is what it always was
        cli.build_backend(serve("--backend", "vllm", "--policy", policy, "--vllm-arg", "data_parallel_size=1"))


def widened_for_tensor_parallel(src: str, dst: str, tp: int) -> str:
    """A copy of the Llama-style checkpoint `src` in `dst`, with attention heads of zero weights added until
    both head counts divide by `tp`; returns `dst`.

    vLLM shards query and KV heads across tensor-parallel ranks, and SmolLM2-135M's 9 and 3 do not divide
    by 2 (vLLM refuses it), so the tensor-parallel tests run on this copy (12 and 4 heads). A zero head
    changes nothing: its query, key and value are 0, so its output is 0, and its o_proj columns are 0 too.
    Each added KV head comes with its group of query heads, at the end (query head i reads KV head
    i // group, in transformers and in vLLM, on every rank)."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    group = heads // kv_heads
    new_kv_heads = -(-kv_heads // tp) * tp
    rows = {"q_proj": new_kv_heads * group * head_dim, "k_proj": new_kv_heads * head_dim,
            "v_proj": new_kv_heads * head_dim}
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    for path in glob.glob(os.path.join(src, "*.safetensors")):
        weights = load_file(path)
        for key, w in weights.items():
            proj = key.split(".")[-2]
            if proj in rows:  # weight [heads * head_dim, hidden] (and its bias, if any): zero rows
                weights[key] = torch.cat([w, w.new_zeros(rows[proj] - w.shape[0], *w.shape[1:])])
            elif proj == "o_proj" and key.endswith(".weight"):  # [hidden, heads * head_dim]: zero columns
                weights[key] = torch.cat([w, w.new_zeros(w.shape[0], rows["q_proj"] - w.shape[1])], dim=1)
        save_file(weights, os.path.join(dst, os.path.basename(path)), metadata={"format": "pt"})
    config.update(num_attention_heads=new_kv_heads * group, num_key_value_heads=new_kv_heads, head_dim=head_dim)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


def test_the_widened_model_computes_what_the_model_computes(default_model_dir, hf_model_fp32, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    widened_dir = widened_for_tensor_parallel(default_model_dir, str(tmp_path / "tp2"), 2)
    with open(os.path.join(widened_dir, "config.json")) as f:
        config = json.load(f)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (12, 4)
    assert config["num_attention_heads"] % 2 == config["num_key_value_heads"] % 2 == 0
    widened = AutoModelForCausalLM.from_pretrained(widened_dir, dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt(tokenizer, QUESTION)])
    with torch.no_grad():
        torch.testing.assert_close(widened(ids).logits, hf_model_fp32(ids).logits, atol=1e-4, rtol=1e-4)


# -- on GPUs ---------------------------------------------------------------------------------------------

def start_on_gpu(model_dir: str, **engine_args):
    """The backend under `infercept` in float32 on the GPU build of vLLM; started."""
    from infercept.engine import VllmBackend

    backend = VllmBackend.create(model_dir, python=VLLM_PYTHON, policy="infercept", dtype="float32",
                                 max_model_len=4096, kv_cache_gb=KV_CACHE_GB,
                                 engine_args=GPU_ENGINE_ARGS | engine_args)
    backend.start()
    if backend.info.device != "cuda":
        backend.shutdown()
        pytest.fail(f"vLLM at {VLLM_PYTHON} runs on {backend.info.device}, not cuda: it is the CPU build "
                    "(run `make vllm-env` on this host after removing .venv-vllm, or set INFERCEPT_VLLM_PYTHON)")
    return backend


async def tool_call_turn(backend, tokenizer, request_id: str, expected_s: float | None = None):
    """tests/test_vllm_backend.py's `tool_call_turn`, inside a running event loop."""
    prompt = tool_turn_prompt(tokenizer)
    intercept = InterceptParams(tool_parser="hermes", tools=(WEATHER,), expected_s=expected_s)
    return prompt, await run_turn(backend.generate(prompt, greedy(40), request_id, intercept))


async def pause_and_resume(backend, tokenizer, request_id: str, alongside: bool) -> None:
    """The tool call pauses with its KV in vLLM, the resume reuses all of it, and the resumed greedy tokens
    equal a fresh request's; `alongside`: while another request decodes in the same steps."""
    busy = None
    if alongside:
        story = chat_prompt(tokenizer, [{"role": "user", "content": "Tell me a long story about the sea."}])
        busy = asyncio.create_task(run_turn(backend.generate(story, greedy(1500, ignore_eos=True),
                                                             f"{request_id}-busy")))
        await asyncio.sleep(0.2)  # it is decoding
    prompt, first = await tool_call_turn(backend, tokenizer, request_id)
    assert first.paused and not first.finished and first.finish_reason == "tool_calls", first
    (call,) = first.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    context = prompt + first.token_ids
    location = await backend.kv_location(request_id)
    assert (location.device, location.host) == (len(context) - 1, 0), location

    appended = tool_result_tokens(tokenizer)
    resumed = await run_turn(backend.resume(request_id, appended, greedy(16), InterceptParams()))
    assert resumed.finished and not resumed.paused and resumed.text
    assert resumed.num_cached_tokens == len(context) - 1  # all the paused KV but its last token, fed again
    if busy is not None:
        assert not busy.done(), "the other request ended before the resume: nothing ran alongside"
        out = await busy
        assert out.finished and len(out.token_ids) == 1500
    fresh = await run_turn(backend.generate(context + appended, greedy(16), f"{request_id}-fresh"))
    assert fresh.token_ids == resumed.token_ids and fresh.text == resumed.text


@gpu_test
@TWO_GPUS
class TestTensorParallel:
    """tensor_parallel_size=2 (`--tensor-parallel-size 2`): our scheduler runs once, in vLLM's engine core,
    and the model's heads are split across the two GPUs."""

    @pytest.fixture(scope="class")
    def backend(self, default_model_dir, tmp_path_factory):
        model = widened_for_tensor_parallel(default_model_dir, str(tmp_path_factory.mktemp("tp2") / "model"), 2)
        backend = start_on_gpu(model, tensor_parallel_size=2)
        yield backend
        backend.shutdown()

    @pytest.mark.parametrize("alongside", [False, True])
    def test_a_tool_call_pauses_and_the_resumed_turn_equals_a_fresh_one(self, backend, tokenizer, alongside):
        asyncio.run(pause_and_resume(backend, tokenizer, f"tp-{alongside}", alongside))


@gpu_test
class TestAsyncScheduling:
    """vLLM's asynchronous scheduling (`--async-scheduling`) with `AsyncInterceptScheduler`, on one GPU."""

    @pytest.fixture(scope="class")
    def backend(self, default_model_dir):
        backend = start_on_gpu(default_model_dir, async_scheduling=True)
        yield backend
        backend.shutdown()

    @pytest.mark.parametrize("alongside", [False, True])
    def test_a_tool_call_pauses_and_the_resumed_turn_equals_a_fresh_one(self, backend, tokenizer, alongside):
        asyncio.run(pause_and_resume(backend, tokenizer, f"async-{alongside}", alongside))

    def test_a_long_pause_leaves_the_device_and_the_resume_equals_a_fresh_run(self, backend, tokenizer):
        """tests/test_vllm_backend.py's long-pause case: the scheduler swaps a paused session to the host
        tier, or discards it (min-waste decides from the measured copy bandwidth), while vLLM schedules
        a step ahead; the resume loads it back, or recomputes only what the prefix cache lost."""
        before = asyncio.run(backend.snapshot())
        prompt, first = asyncio.run(tool_call_turn(backend, tokenizer, "async-long", expected_s=3600.0))
        assert first.paused, first
        context = prompt + first.token_ids
        # The policy decides at vLLM's steps, and an idle vLLM takes none.
        asyncio.run(run_turn(backend.generate([1, 2, 3], greedy(2, ignore_eos=True), "async-long-nudge")))
        location = wait_for(lambda: asyncio.run(backend.kv_location("async-long")), lambda loc: loc.device == 0)
        assert location.device == 0 and location.host + location.discarded == len(context), location

        appended = tool_result_tokens(tokenizer)
        resumed = asyncio.run(run_turn(backend.resume("async-long", appended, greedy(16), InterceptParams())))
        assert resumed.finished and resumed.text
        if location.host:  # swapped: all of it back, nothing recomputed
            hit, recomputed = len(context) - 1, 0
        else:  # discarded: whole blocks stayed cached
            hit = (len(context) - 1) // backend.block_size * backend.block_size
            recomputed = len(context) - 1 - hit
        assert resumed.num_cached_tokens == hit, (resumed.num_cached_tokens, hit)
        after = wait_for(lambda: asyncio.run(backend.snapshot()),
                         lambda s: s.num_recomputed_tokens - before.num_recomputed_tokens == recomputed)
        assert after.num_recomputed_tokens - before.num_recomputed_tokens == recomputed
        fresh = asyncio.run(run_turn(backend.generate(context + appended, greedy(16), "async-long-fresh")))
        assert fresh.token_ids == resumed.token_ids


@pytest.mark.parametrize("gpu", [False, True])
def test_without_kv_cache_gb_vllm_on_a_cpu_gets_the_native_engines_share_of_memory(worker_configs, monkeypatch, gpu):
    """vLLM on a CPU sizes its KV cache to most of the machine (on a 24 GiB machine the kernel's OOM killer
    ended `infercept serve --backend vllm` with default flags): unset, it gets the native engine's default
    share of available memory, or --kv-cache-fraction's (a replica's); on a GPU host vLLM's own rule
    stands; an explicit size always wins."""
    from infercept.engine.vllm_backend import backend
    from infercept.server import cli

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(backend.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if gpu else None)
    monkeypatch.setattr(backend, "available_host_memory_bytes", lambda: 20 * 2**30)
    for flags in ((), ("--kv-cache-fraction", "0.125"), ("--kv-cache-gb", "2")):
        with pytest.raises(WorkerStarted):
            cli.build_backend(serve("--backend", "vllm", *flags))
    default, shared, explicit = (config["engine"].get("kv_cache_memory_bytes") for config in worker_configs)
    assert default == (None if gpu else int(20 * 2**30 * 0.25))
    assert shared == (None if gpu else int(20 * 2**30 * 0.125))
    assert explicit == 2 * 2**30
