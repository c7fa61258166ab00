"""A real server for tests: `build_app` + uvicorn in a thread on a free loopback port, with the
embedded model. Shared by the server, Responses, sessions and example tests (the session-scoped
`server` fixture in conftest.py loads the model once). `VllmLiveServer` is the same over the vLLM
backend (`--backend vllm`), for the tests that run a client against both backends."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import openai
from vllm_env import TEST_ENGINE_ARGS, VLLM_PYTHON, vllm_test_env

from infercept.engine import AsyncEngine, Engine, NativeBackend
from infercept.engine.policy import Profile
from infercept.server.app import build_app
from infercept.server.settings import ServerSettings

MODEL = "smol"


def serve_in_thread(app, lifespan: str = "on") -> tuple:
    """uvicorn with its lifespan in a daemon thread on a free loopback port: (server, thread, base URL).
    Stop with `server.should_exit = True` and join the thread. `lifespan` "off": an app over a backend
    another app's lifespan starts and stops."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan,
                                           timeout_keep_alive=app.state.settings.keep_alive_s,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def resumes(url: str, how: str = "implicit") -> float:
    """How many requests the server at `url` (its base or its /v1) has served by resuming a paused
    generation, found `how` (its `infercept_resumes_total`): "implicit" by the conversation, "explicit" by
    a named session, "tokens" by a token prompt. A framework test counts them: a resumed step's cached
    share alone would not tell the paused KV from the prefix cache's blocks."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics").text
    pattern = rf'^infercept_resumes_total\{{[^}}]*how="{how}"[^}}]*\}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def profile() -> Profile:
    """A hand-written profile (no measuring at start-up): 10 ms per iteration, ample copy bandwidth."""
    bytes_per_token = 2 * 30 * 3 * 64 * 4
    return Profile(model="test", device="cpu", dtype="float32", bytes_per_token=bytes_per_token, block_size=16,
                   t_fwd_samples=((1, 0.01), (64, 0.01), (128, 0.02)), d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9,
                   saturation_point=64)


class LiveServer:
    """build_app + uvicorn in a thread on a free loopback port; `url` is the OpenAI base URL."""

    def __init__(self, model_dir: str, policy: str, prefix_caching: bool = True, **settings):
        engine = Engine(model_dir, dtype="float32", kv_cache_gb=0.06, host_kv_gb=0.02, max_num_batched_tokens=512,
                        policy=policy, profile=profile(), progress=False, num_threads=1,
                        enable_prefix_caching=prefix_caching)
        self.async_engine = AsyncEngine(engine)
        self.engine = engine
        self.backend = NativeBackend(self.async_engine)
        self.app = build_app(self.backend, ServerSettings(served_model_name=MODEL, **settings))
        self.server, self.thread, self.base = serve_in_thread(self.app)
        self.url = self.base + "/v1"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def on_engine(self, fn):
        """Run `fn` on the engine thread, between steps."""
        async def run():
            return await self.async_engine.call(fn)
        return asyncio.run(run())

    def engine_state(self) -> dict:
        def read():
            bm, sched = self.engine.block_manager, self.engine.scheduler
            bm.check_integrity()
            return {"requests": {rid: r.status.value for rid, r in sched.requests.items()},
                    "tables": {rid for rid, t in list(bm.tables.items()) + list(bm.host_tables.items()) if t},
                    "free": bm.num_free_blocks, "total": bm.device.num_blocks,
                    "host_free": bm.num_free_host_blocks, "host_total": bm.host.num_blocks}
        return self.on_engine(read)

    def paused_kv_locations(self, timeout: float = 15.0) -> list[dict]:
        """Where each paused generation's KV is once the engine has planned every pause (the step it
        owes a fresh pause runs right after the pausing one, engine idle or not)."""
        engine, deadline = self.engine, time.monotonic() + timeout
        while True:
            busy, located = self.on_engine(lambda: (engine.has_unfinished_requests(),
                                                    [engine.kv_location(r) for r in engine.scheduler.paused]))
            if not busy or time.monotonic() > deadline:
                return located
            time.sleep(0.01)

    def assert_no_leak(self, timeout: float = 15.0) -> dict:
        """Nothing runs; every request the engine still holds is a paused generation the store holds;
        only those hold blocks (block_manager.check_integrity passes on the engine thread)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.engine_state()
            if all(s == "intercepted" for s in state["requests"].values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert all(s == "intercepted" for s in state["requests"].values()), state["requests"]
        registered = {e.request_id for e in self.app.state.conversations.paused()}
        assert set(state["requests"]) == registered
        assert state["tables"] <= registered
        if not registered:
            assert state["free"] == state["total"] and state["host_free"] == state["host_total"]
        return state

    def abort_paused(self) -> None:
        """Drop every paused generation (as the TTL would), so a test starts from an empty engine."""
        self.app.state.conversations.release_all("ttl", "the test starts afresh")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class VllmLiveServer:
    """The live server over the vLLM backend: the embedded model in float32 (greedy outputs then match
    the native engine's), policy infercept, prefix caching on, vLLM's OpenMP threads on this machine's
    two cores. Starting vLLM takes ~30 s on an idle machine: share one per module."""

    FLOAT32_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, K and V

    def __init__(self, model_dir: str, pool_tokens: int = 4608, host_tokens: int = 2048, **settings):
        from infercept.engine import VllmBackend

        per_token = self.FLOAT32_KV_BYTES_PER_TOKEN
        # max_model_len must fit the pool; VLLM_CPU_KVCACHE_SPACE would override kv_cache_gb, so it is left unset.
        self.backend = VllmBackend.create(model_dir, python=VLLM_PYTHON, policy="infercept", dtype="float32",
                                          max_model_len=4096, kv_cache_gb=pool_tokens * per_token / 2**30,
                                          host_kv_gb=host_tokens * per_token / 2**30, max_num_seqs=64,
                                          env=vllm_test_env(), engine_args=TEST_ENGINE_ARGS)
        self.app = build_app(self.backend, ServerSettings(served_model_name=MODEL, **settings))
        self.server, self.thread, self.base = serve_in_thread(self.app)
        self.url = self.base + "/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.backend.worker.alive, "the lifespan did not shut the vLLM worker down"
