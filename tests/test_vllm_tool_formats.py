"""The tool-call formats but Hermes -- llama3_json, mistral (both forms), pythonic, qwen3_coder, glm45,
deepseek_v31 -- on the vLLM backend (Hermes: tests/test_vllm_backend.py):
parsed, paused and resumed, streamed, forced, for tool_choice auto, "required" and a named tool.

The families' tiny random-weight models of tests/test_tool_formats.py (their tokenizers, call markers
as special tokens, and templates), with heads of 64 (vLLM's CPU attention has no kernel for their 16), each served
by its own vLLM worker under `preserve`, one family's worker at a time (a module-scoped fixture per family:
pytest runs one family's tests, stops its worker, then starts the next; five at once, on one core of a
2-core machine, took as long and several GB more, which starved the tests beside them). Per family:

* on the backend, a turn of each mode (greedy and sampled) set up as the native engine's test sets it
  up -- under auto a test grammar writes the family's call, under required / named the format's prefill
  and grammar, as vLLM's structured outputs -- must end in valid calls on which vLLM keeps the session
  paused; the conversation with the calls and their results, rendered by the family's template, extends
  the paused tokens, and the resume with the rest reuses all their KV and decodes what a fresh run does
  (`mistral` up to v7 excepted: its template moves the tools, and the server serves such a conversation
  fresh);
* on a live server over the same worker, the checks the native engine's server passes
  (`check_served_calls`): forced calls streamed and returned, their resume, auto under a JSON
  response_format, tool_choice none.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest
from live_server import MODEL, serve_in_thread
from vllm_env import NO_VLLM, TEST_ENGINE_ARGS, VLLM_PYTHON, vllm_test_env
from test_tool_formats import (FAMILIES, OPENAI_TOOLS, QUESTION, SAMPLINGS, build_family, check_paused_on_calls,
                               check_served_calls, forced_turn, tool_format)

from infercept.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(NO_VLLM is not None, reason=NO_VLLM or "")

KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2 * 4  # 2 layers, 2 KV heads of 64, K and V, float32
POOL_TOKENS = 4096


@dataclass
class Served:
    backend: object  # VllmBackend
    tokenizer: object
    name: str
    app: object
    server: object  # uvicorn's, in `thread`
    thread: object
    base: str


def start(name: str, folder: str) -> Served:
    """The family's vLLM worker as the tests start it (`TEST_ENGINE_ARGS`), its OpenMP threads on
    this test process's cores, and a live server over it whose lifespan owns it."""
    from transformers import AutoTokenizer

    from infercept.engine import VllmBackend
    from infercept.server.app import build_app
    from infercept.server.settings import ServerSettings

    backend = VllmBackend.create(folder, python=VLLM_PYTHON, policy="preserve", dtype="float32", max_model_len=2048,
                                 kv_cache_gb=POOL_TOKENS * KV_BYTES_PER_TOKEN / 2**30, host_kv_gb=0,
                                 max_num_batched_tokens=256, engine_args=TEST_ENGINE_ARGS,
                                 env=vllm_test_env())
    app = build_app(backend, ServerSettings(served_model_name=MODEL))
    return Served(backend, AutoTokenizer.from_pretrained(folder), name, app, *serve_in_thread(app))


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    name = request.param
    folder = str(tmp_path_factory.mktemp(f"tiny-{name}-64"))
    build_family(folder, FAMILIES[name], head_dim=64)
    s = start(name, folder)
    try:
        yield s
    finally:
        s.server.should_exit = True
        s.thread.join(timeout=60)
        assert not s.backend.worker.alive, "the lifespan did not shut the vLLM worker down"


async def last(stream):
    async for out in stream:
        pass
    return out


async def every_output(stream) -> list:
    return [out async for out in stream]


def conversation_after(calls, tokenizer) -> str:
    """The question, the assistant's `calls` and a result for each, as the family's template renders them
    for the model's next turn."""
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call{i}", "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
        for i, c in enumerate(calls)]}
    results = [{"role": "tool", "tool_call_id": f"call{i}", "content": "clear"} for i in range(len(calls))]
    return tokenizer.apply_chat_template(QUESTION + [assistant] + results, tools=OPENAI_TOOLS, tokenize=False,
                                         add_generation_prompt=True)


@pytest.mark.parametrize("mode", ["auto", "required", "named"])
def test_the_vllm_backend_pauses_on_the_formats_calls_and_resumes(mode, served):
    name, backend, tokenizer = served.name, served.backend, served.tokenizer
    turns = {sampling: forced_turn(name, mode, sampling, tokenizer) for sampling in SAMPLINGS}

    async def first_turns():
        return await asyncio.gather(*(every_output(backend.generate(prompt_ids, params, f"{name}-{mode}-{sampling}",
                                                                    intercept))
                                      for sampling, (prompt_ids, _, params, intercept) in turns.items()))

    streams = dict(zip(turns, asyncio.run(first_turns())))
    outs = {sampling: stream[-1] for sampling, stream in streams.items()}
    for sampling, out in outs.items():
        check_paused_on_calls(name, mode, out, turns[sampling][1], tokenizer)
    if mode == "auto":  # what a stream of the turn shows before the verdict: none of the call, as content or call
        fmt = tool_format(tokenizer, name)
        for stream in streams.values():
            assert len(stream) > 1 and all(not o.tool_calls and fmt.safe_content(o.text) == "" for o in stream[:-1])
    if not FAMILIES[name].resumes:
        for sampling in turns:
            backend.abort(f"{name}-{mode}-{sampling}")
        return
    for sampling, out in outs.items():
        rid = f"{name}-{mode}-{sampling}"
        context = turns[sampling][0] + out.token_ids
        paused_text = tokenizer.decode(context, skip_special_tokens=False)
        rendered = conversation_after(out.tool_calls, tokenizer)
        assert rendered.startswith(paused_text), (paused_text, rendered)
        appended = tokenizer.encode(rendered[len(paused_text):], add_special_tokens=False)
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        resumed = asyncio.run(last(backend.resume(rid, appended, greedy)))
        assert resumed.finished and resumed.num_cached_tokens == len(context) - 1, (resumed, len(context))
        fresh = asyncio.run(last(backend.generate(context + appended, greedy, f"{rid}-fresh")))
        assert fresh.token_ids == resumed.token_ids


def test_the_server_over_vllm_streams_forced_calls_and_resumes_them(served):
    import openai

    s = served
    client = openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    check_served_calls(s.name, client, s.tokenizer,
                       lambda: s.app.state.conversations.release_all("ttl", "the test starts afresh"))


def test_a_seeded_turn_whose_prompt_takes_several_steps_is_served(served):
    """vLLM 0.32's CPU worker takes back a discarded draw of a seeded request's generator by an offset that a
    CPU generator lacks, which ended the engine at the first such request whose prompt was computed in more
    than one step (engine/vllm_backend/cpu_sampling.py): a seeded turn with a prompt over the step's 256
    tokens is served, and the engine serves on (on each family's worker: a second or so each)."""
    backend, tokenizer = served.backend, served.tokenizer
    piece = tokenizer.encode("the sky is clear and the temperature is warm ", add_special_tokens=False)
    prompt_ids = piece * (700 // len(piece))

    async def turn(request_id: str, **sampling):
        return await last(backend.generate(list(prompt_ids), SamplingParams(max_tokens=4, **sampling), request_id))

    seeded = asyncio.run(turn("seeded-long-prompt", temperature=1.0, seed=3))
    assert seeded.finished and len(seeded.token_ids) == 4 and len(prompt_ids) > 2 * 256
    assert asyncio.run(turn("after-it", temperature=0)).finished
