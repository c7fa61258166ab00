"""Shared fixtures: one default model (engine + HF reference) per test session, and how `make test`
shares the cores between its pytest-xdist workers (`_pin_xdist_worker`, `pytest_collection_modifyitems`).

Everything heavy is session-scoped so the whole suite loads SmolLM2-135M once into the engine and
once into transformers (once per worker under xdist). The engine instance uses a 32-token budget so that
prompts longer than 32 tokens are prefilled in chunks, in the same forward passes as other requests'
decodes.
"""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _pin_xdist_worker() -> None:
    """Under pytest-xdist, each worker on its own share of the cores (subprocesses inherit it; vLLM binds
    its threads to them: `vllm_env.cores_for_tests`), with as many torch threads. OpenMP threads spin while
    they wait for each other, so two workers whose threads shared both cores ran the suite several times
    slower than one worker (2-core CPU, 2026-11-28)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < int(count):
        return  # fewer cores than workers: nothing to split
    # (a worker that replaces a crashed one is numbered past the count: gw2 of two)
    mine = cores[int(worker.removeprefix("gw")) % int(count)::int(count)]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))


_pin_xdist_worker()

# The slowest files (`make test --durations`, 2-core CPU, 2026-11-28: 40-200 s each), started first so that
# no worker is left running one of them alone at the end. Only the order changes with this list.
SLOW_FIRST = ("test_vllm_backend.py", "test_interception.py", "test_langchain.py", "test_async_output.py",
              "test_replicas.py", "test_soak.py", "test_vllm_tool_formats.py", "test_agents_sdk.py",
              "test_server_robustness.py", "test_responses_mcp.py", "test_guided_decoding.py", "test_pydantic_ai.py")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: `-n TEST_WORKERS --dist loadfile --no-loadscope-reorder`, each file
    one unit of work, in this order), the slowest files first. Without xdist the order stays."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow_rank = {name: i for i, name in enumerate(SLOW_FIRST)}
        items.sort(key=lambda item: slow_rank.get(item.path.name, len(SLOW_FIRST)))  # stable: files stay whole


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation of `ids` by a transformers model: exactly `n` new token ids.

    End-of-sequence is neither a stop nor suppressed (like the engine's `ignore_eos=True`): `generate`
    merges the model's own generation_config, so its eos is cleared there for the call. (Passing
    `min_new_tokens` instead would ban eos and change the argmax.)
    """
    import copy

    from transformers import GenerationConfig

    saved = model.generation_config
    no_eos = copy.deepcopy(saved)
    no_eos.eos_token_id = None
    model.generation_config = no_eos
    input_ids = torch.tensor([list(ids)], dtype=torch.long)
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=GenerationConfig(do_sample=False, max_new_tokens=n,
                                                                    pad_token_id=0))
    finally:
        model.generation_config = saved
    new = out[0, input_ids.shape[1]:].tolist()
    assert len(new) == n, f"HF generated {len(new)} tokens, wanted {n}"
    return new


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits of the last position for one prompt: [vocab]."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0, -1].float()
    return logits.clone()  # a normal tensor, so callers may edit it


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from infercept.engine.download import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def hf_model_fp32(default_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def llm_fp32(default_model_dir):
    from infercept.engine import LLM

    torch.manual_seed(0)
    return LLM(default_model_dir, dtype="float32", kv_cache_gb=0.25, max_num_batched_tokens=32,
               host_kv_gb=0.01, seed=0)


@pytest.fixture
def engine(llm_fp32):
    """The shared engine, checked to be idle and leak-free before and after each test."""
    eng = llm_fp32.engine
    assert not eng.has_unfinished_requests()
    eng.block_manager.check_integrity()
    yield eng
    # A failing test may leave requests behind; clear them so later tests start clean.
    for request_id in list(eng.scheduler.requests):
        eng.abort(request_id)
    eng.block_manager.check_integrity()
    assert eng.block_manager.num_free_blocks == eng.block_manager.device.num_blocks


@pytest.fixture(scope="session")
def server(default_model_dir):
    """The live server every HTTP test shares (loaded once per test session)."""
    from live_server import LiveServer

    # preserve: a paused generation keeps its KV on the device whatever runs meanwhile, so how much of a
    # resumed prompt is cached is deterministic (min-waste may rightly discard it).
    live = LiveServer(default_model_dir, "preserve")
    yield live
    live.close()
    assert not live.async_engine._running  # the lifespan shut the engine down


@pytest.fixture(scope="session")
def discard_server(default_model_dir):
    """The paper's recompute baseline, as servers were in 2023: paused KV is discarded at once and there is
    no prefix cache, so a resume recomputes everything. Shared by the tests that compare against it."""
    from live_server import LiveServer

    live = LiveServer(default_model_dir, "discard", prefix_caching=False)
    yield live
    live.close()


@pytest.fixture
def srv(server):
    """The shared server, leak-free before and after each test."""
    server.abort_paused()
    server.assert_no_leak()
    yield server
    server.abort_paused()
    server.assert_no_leak()


@pytest.fixture(scope="session")
def agent_server_url(agent_server):
    """The /v1 base URL of `agent_server`."""
    return agent_server[0]


@pytest.fixture(scope="session")
def agent_server(default_model_dir):
    """One live OpenAI-compatible server (real embedded model, real HTTP on a loopback port) shared by
    the integration tests (LangChain, OpenAI shim, examples); yields its /v1 base URL and its app.

    A hand-written profile skips the start-up measurement; the model is served as "smol". Responses
    requests may name MCP servers on the loopback (`--mcp-allow-url`), as the MCP examples' own do.
    """
    from live_server import profile, serve_in_thread

    from infercept.engine import AsyncEngine, Engine, NativeBackend
    from infercept.server.app import build_app
    from infercept.server.settings import McpSettings, ServerSettings

    engine = Engine(default_model_dir, dtype="float32", kv_cache_gb=0.1, host_kv_gb=0.02, max_num_batched_tokens=512,
                    policy="infercept", profile=profile(), progress=False, num_threads=1)
    async_engine = AsyncEngine(engine)
    app = build_app(NativeBackend(async_engine), ServerSettings(
        served_model_name="smol", mcp=McpSettings(allow_urls=("http://127.0.0.1:*/mcp",))))
    server, thread, base = serve_in_thread(app)
    yield base + "/v1", app
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="session")
def vllm_agent_server_url(default_model_dir):
    """The same over the vLLM backend (`--backend vllm`, `live_server.VllmLiveServer`), started the first
    time a test asks for it and shared by every framework test after that (vLLM takes ~30 s to start);
    skips without the vLLM environment."""
    from live_server import VllmLiveServer
    from vllm_env import NO_VLLM

    if NO_VLLM:
        pytest.skip(NO_VLLM)
    live = VllmLiveServer(default_model_dir)
    yield live.url
    live.close()


@pytest.fixture(scope="module", params=["native", "vllm"])
def backend_url(request):
    """The /v1 URL of the shared live server on each backend, for tests that run a framework on both."""
    return request.getfixturevalue("agent_server_url" if request.param == "native" else "vllm_agent_server_url")


@pytest.fixture
def worker_configs(monkeypatch):
    """The configurations `VllmBackend.create` hands the vLLM worker, which is not started
    (tests/unstarted_worker.py: the start raises `WorkerStarted`)."""
    from unstarted_worker import record_worker_configs

    return record_worker_configs(monkeypatch)
