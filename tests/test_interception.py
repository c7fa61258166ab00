"""Pause at interceptions, keep / swap / discard the KV, resume: token-exact under every policy.

The invariant: with greedy sampling, the tokens generated after a resume are identical
whichever strategy held the KV, and identical to a fresh request of the whole conversation.
Last, the server's side of the rule: which chat turns that end in a call pause (a structured answer does not).
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from infercept.engine import Engine, SamplingParams
from infercept.engine.policy import POLICIES, Profile
from infercept.engine.request import InterceptParams
from infercept.engine.tool_format import ToolSpec

FEW_SHOT = ('Q: weather in Tokyo\nA: <tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo"}}</tool_call>\n'
            'Q: weather in Rome\nA: <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
            'Q: weather in Paris\nA:')
TOOL_RESULT = ' {"temperature": 21, "sky": "clear"}\nSo the weather in Paris is'
OTHERS = [f"Request {i}: write a long story about a dragon who learns to cook pasta in Naples. " * 3
          for i in range(3)]
HERMES = InterceptParams(tool_parser="hermes")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make_profile(bytes_per_token: int, block_size: int = 16, swap_blocks_per_step: float = 1.0) -> Profile:
    """A hand-written profile: 10 ms per iteration, copy bandwidth set so the swap budget is
    `swap_blocks_per_step` blocks per iteration (partial swaps across iterations)."""
    bw = swap_blocks_per_step * block_size * bytes_per_token / 0.01
    return Profile(model="test", device="cpu", dtype="float32", bytes_per_token=bytes_per_token,
                   block_size=block_size, t_fwd_samples=((1, 0.01), (32, 0.01), (64, 0.02)),
                   d2h_bytes_per_s=bw, h2d_bytes_per_s=bw, saturation_point=32)


FP32_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4


def make_engine(model_dir: str, policy: str, kv_cache_gb: float = 0.04, **kw) -> Engine:
    kw.setdefault("profile", make_profile(FP32_BYTES_PER_TOKEN))
    return Engine(model_dir, dtype="float32", kv_cache_gb=kv_cache_gb, host_kv_gb=0.05,
                  max_num_batched_tokens=32, policy=policy, progress=False, **kw)


def drain(engine: Engine, check: bool = True) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        if check:
            engine.block_manager.check_integrity()
    return outs


def last_output(outs, request_id):
    return [o for o in outs if o.request_id == request_id][-1]


def assert_all_free(engine: Engine) -> None:
    engine.block_manager.check_integrity()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.device.num_blocks
    assert bm.num_free_host_blocks == bm.host.num_blocks


@pytest.fixture(scope="module")
def fresh_reference(default_model_dir):
    """Greedy continuation of the whole conversation, computed from scratch with no interception."""
    engine = make_engine(default_model_dir, "preserve", kv_cache_gb=0.1, enable_prefix_caching=False)
    cache = {}

    def run(token_ids: list[int], n: int) -> list[int]:
        key = (tuple(token_ids), n)
        if key not in cache:
            rid = engine.add_request(list(token_ids), greedy(n))
            cache[key] = last_output(drain(engine), rid).token_ids
        return cache[key]

    return run


def test_tool_call_pauses_with_parsed_calls(default_model_dir):
    engine = make_engine(default_model_dir, "preserve", kv_cache_gb=0.1)
    rid = engine.add_request(FEW_SHOT, SamplingParams(temperature=0, max_tokens=40), intercept=HERMES)
    out = last_output(drain(engine), rid)
    assert out.paused and not out.finished and out.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    # Paused, not finished: the request, its tokens and its KV stay in the engine.
    assert engine.scheduler.requests[rid].status.value == "intercepted"
    location = engine.kv_location(rid)
    assert location["device"] > 0 and location["host"] == 0
    assert location["device"] + location["discarded"] == engine.scheduler.requests[rid].num_tokens
    engine.abort(rid)
    assert_all_free(engine)


def test_calls_that_do_not_count_end_the_turn_instead_of_pausing(default_model_dir):
    """The engine judges the turn's calls against the request's tools (tool_format.CallJudge): it pauses
    only on calls the client can answer; otherwise the turn finishes and its KV is freed at once."""
    engine = make_engine(default_model_dir, "preserve", kv_cache_gb=0.1)
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    needs_days = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"]}
    cases = {"other tool": (ToolSpec.function("get_time", city), False),
             "schema refuses": (ToolSpec.function("get_weather", needs_days), False),
             "counts": (ToolSpec.function("get_weather", city), True)}
    for what, (tool, pauses) in cases.items():
        intercept = InterceptParams(tool_parser="hermes", tools=(tool,))
        rid = engine.add_request(FEW_SHOT, SamplingParams(temperature=0, max_tokens=40), intercept=intercept)
        out = last_output(drain(engine), rid)
        assert out.paused is pauses and out.finished is not pauses, what
        assert out.finish_reason == ("tool_calls" if pauses else "stop"), what
        assert [c.name for c in out.tool_calls] == (["get_weather"] if pauses else []), what
        if pauses:
            assert "<tool_call>" not in out.content  # the text outside the call
            engine.abort(rid)
        assert_all_free(engine)


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"vllm"}))
def test_resume_equals_fresh_request_under_pressure(default_model_dir, fresh_reference, policy):
    engine = make_engine(default_model_dir, policy)
    rid = engine.add_request(FEW_SHOT, SamplingParams(temperature=0, max_tokens=40), intercept=HERMES)
    assert last_output(drain(engine), rid).paused
    context = list(engine.scheduler.requests[rid].token_ids)

    # Other requests run while it is paused; together they need more blocks than the pool has.
    others = [engine.add_request(p, greedy(12)) for p in OTHERS]
    outs = drain(engine)
    assert all(last_output(outs, o).finished for o in others)
    location = engine.kv_location(rid)
    if policy in ("discard", "improved-discard", "chunked-discard", "prefix-cache"):
        assert location["device"] == 0 and location["host"] == 0  # discarded at once
    if policy == "swap":
        assert location["host"] > 0 and location["device"] == 0

    appended = engine.tokenizer.encode(TOOL_RESULT)
    engine.resume(rid, appended, greedy(10))
    # Resume while others arrive, so the restore (swap-in or recompute) mixes with their work.
    for p in OTHERS[:2]:
        engine.add_request(p, greedy(6))
    resumed = last_output(drain(engine), rid)
    assert resumed.finished and resumed.finish_reason == "length"
    assert resumed.token_ids == fresh_reference(context + appended, 10)
    assert_all_free(engine)


@pytest.mark.parametrize("policy", ["infercept", "prefix-cache"])
def test_preempted_running_requests_end_as_if_run_alone(default_model_dir, fresh_reference, policy):
    """More running work than the pool holds: the newest running request is preempted. `infercept`
    swaps its KV to the host and back (copies are cheap in this profile); `prefix-cache` recomputes it,
    as vLLM does. Either way every request ends with the tokens it gets when run alone."""
    engine = make_engine(default_model_dir, policy, kv_cache_gb=0.02, enable_prefix_caching=False,
                         profile=make_profile(FP32_BYTES_PER_TOKEN, swap_blocks_per_step=100))
    prompts = [engine.tokenizer.encode(f"Story {i}: " + OTHERS[i % 3] * 2) for i in range(5)]
    ids = [engine.add_request(p, greedy(24)) for p in prompts]
    outs = drain(engine)
    stats = engine.stats
    assert stats.num_preemptions > 0
    assert stats.num_preemptions_by_swap == (stats.num_preemptions if policy == "infercept" else 0)
    for rid, prompt in zip(ids, prompts):
        assert last_output(outs, rid).token_ids == fresh_reference(prompt, 24)
    assert_all_free(engine)


def test_pause_on_stop_is_a_request_level_interception(default_model_dir, fresh_reference):
    engine = make_engine(default_model_dir, "infercept")
    rid = engine.add_request("The three primary colors are", greedy(6), intercept=InterceptParams(pause_on_stop=True))
    out = last_output(drain(engine), rid)
    assert out.paused and out.finish_reason == "intercept" and len(out.token_ids) == 6
    context = list(engine.scheduler.requests[rid].token_ids)
    engine.resume(rid, engine.tokenizer.encode(" Also,"), greedy(6))
    second = last_output(drain(engine), rid)
    assert second.paused and len(second.token_ids) == 6  # still interceptible: pauses again
    assert second.token_ids == fresh_reference(context + engine.tokenizer.encode(" Also,"), 6)
    engine.abort(rid)
    assert_all_free(engine)


def test_budgeted_swap_moves_one_block_per_iteration_and_abort_mid_swap_frees_all(default_model_dir):
    # Without +ample-preserve: the default keeps paused KV in place on a CPU while the pool has room.
    # Copies priced as overlapping the forward pass (a GPU's): at a block per 10 ms step, copies priced as
    # the stall they are on a CPU cost the batch more than recomputing this context, and it is discarded.
    profile = dataclasses.replace(make_profile(FP32_BYTES_PER_TOKEN), copy_overlap=1.0)
    engine = make_engine(default_model_dir, "infercept+no-ample-preserve", profile=profile)
    intercept = InterceptParams(pause_on_stop=True, expected_s=30.0)  # a long human turn
    rid = engine.add_request(OTHERS[0], greedy(4), intercept=intercept)
    # Other work runs on while it pauses: each step swaps out at most one block (the budget). (With
    # nothing else to run, the step that plans the pause copies it whole: no forward pass to hide behind.)
    engine.add_request("Count to ten: one, two,", greedy(30))
    hosts = []
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        assert len(out.swap_out) <= 1 and len(out.swap_in) <= 1
        engine._update(out, engine.runner.run(out))
        engine.block_manager.check_integrity()
        if rid in engine.scheduler.paused:
            hosts.append(engine.kv_location(rid)["host"])
    assert engine.scheduler.requests[rid].num_computed_tokens > 32  # several blocks
    assert hosts == sorted(hosts) and hosts[-1] > 16, hosts  # monotone progress, chunked across steps
    # Resume while (partly) on the host: swap-in, also one block per step; abort half-way through it.
    engine.resume(rid, engine.tokenizer.encode(" Then"), greedy(4))
    engine.step()
    assert engine.scheduler.requests[rid].status.value == "swapped"
    engine.abort(rid)
    assert not engine.has_unfinished_requests()
    assert_all_free(engine)


def test_an_idle_engine_brings_a_paused_context_back_before_its_predicted_resume(default_model_dir, monkeypatch):
    """Proactive swap-in with nothing else to run: the plan parks the paused context on the host, and the
    engine thread, which steps only for work, sleeps until the hinted resume is near
    (`Engine.idle_wake_s`) and then brings it back, before the result arrives. (The idle thread's poll
    is stretched so that only the wake can bring it back in time.)"""
    import asyncio

    from infercept.engine import AsyncEngine, async_engine
    monkeypatch.setattr(async_engine, "IDLE_POLL_S", 60.0)
    engine = AsyncEngine(make_engine(default_model_dir, "infercept-paper+prefetch"))
    engine.start()
    hint_s = 3.0

    async def watch():
        hinted = InterceptParams(pause_on_stop=True, expected_s=hint_s)
        outs = [o async for o in engine.generate(FEW_SHOT, greedy(4), request_id="p", intercept=hinted)]
        assert outs[-1].paused
        await asyncio.sleep(0.5)
        parked = await engine.call(lambda: engine.engine.kv_location("p"))
        await asyncio.sleep(hint_s - 0.5 - 0.1)
        back = await engine.call(lambda: engine.engine.kv_location("p"))
        await engine.call(lambda: engine.engine.abort("p"))
        return parked, back

    try:
        parked, back = asyncio.run(watch())
        assert parked["host"] > 0, parked
        assert back["host"] == 0 and back["device"] >= parked["device"] + parked["host"], back
        assert_all_free(engine.engine)
    finally:
        engine.shutdown()


def test_abort_mid_recompute_frees_all(default_model_dir):
    engine = make_engine(default_model_dir, "discard")
    rid = engine.add_request(OTHERS[1], greedy(3), intercept=InterceptParams(pause_on_stop=True))
    drain(engine)
    engine.step() if engine.has_unfinished_requests() else None
    engine.add_request("x", greedy(1))
    drain(engine)  # the discard policy drops the paused KV at the next step
    assert engine.kv_location(rid)["device"] == 0
    engine.resume(rid, engine.tokenizer.encode(" and"), greedy(4))
    # improved/chunked off: the discard baseline recomputes the whole context in one iteration
    out = engine.scheduler.schedule()
    assert out.num_recomputed_tokens == engine.scheduler.requests[rid].num_computed_high
    engine._update(out, engine.runner.run(out))
    engine.abort(rid)
    assert_all_free(engine)


def test_resume_errors(default_model_dir):
    engine = make_engine(default_model_dir, "preserve", kv_cache_gb=0.1)
    rid = engine.add_request("Hello", greedy(2))
    with pytest.raises(ValueError, match="not paused"):
        engine.resume(rid, [1, 2])
    with pytest.raises(KeyError):
        engine.resume("no-such-request", [1, 2])
    drain(engine)
    paused = engine.add_request("Hello", greedy(2), intercept=InterceptParams(pause_on_stop=True))
    drain(engine)
    with pytest.raises(ValueError, match="at least one token"):
        engine.resume(paused, [])
    with pytest.raises(ValueError, match="token ids"):
        engine.resume(paused, [10 ** 9])
    with pytest.raises(ValueError, match="unknown"):
        engine.add_request("Hi", greedy(2), intercept=InterceptParams(tool_parser="nope"))
    engine.abort(paused)
    assert_all_free(engine)


# Where each policy puts a paused context's KV at the interception, for a call expected to take 30 s.
# `infercept` counts the delay each way adds to the resume (expected waste): this profile swaps one block
# per 10 ms iteration, so the ~113-token context would take 7 iterations to come back and 4 (chunks of
# S - 1 = 31) to recompute, with nothing else running to wait for it: discarded (lazily: its blocks stay
# cached). The paper's rule swaps it. The default on this CPU keeps it (+ample-preserve: the pool has room
# for all queued work, so nobody could use the memory a swap or discard would free).
AT_INTERCEPTION = {"discard": "discarded", "improved-discard": "discarded", "chunked-discard": "discarded",
                   "prefix-cache": "discarded", "swap": "host", "budgeted-swap": "host",
                   "heuristic-preserve": "host", "infercept-paper": "host", "infercept+no-ample-preserve": "discarded",
                   "infercept": "device", "preserve": "device"}


@pytest.mark.parametrize("policy", sorted(AT_INTERCEPTION))
def test_the_policy_decides_at_the_interception_with_the_engine_idle(default_model_dir, policy):
    """Nothing else runs, so no later step would ever plan the pause: the engine owes it one step,
    and the KV is where the policy puts it before the tool result comes back (a discard baseline that
    kept its KV on an idle engine measured as fast as InferCept)."""
    engine = make_engine(default_model_dir, policy)
    slow_call = InterceptParams(tool_parser="hermes", expected_s=30.0)
    rid = engine.add_request(FEW_SHOT, SamplingParams(temperature=0, max_tokens=40), intercept=slow_call)
    while not any(o.paused for o in engine.step()):
        pass
    assert engine.has_unfinished_requests(), "a fresh pause must get its plan step"
    drain(engine)
    context = engine.scheduler.requests[rid].num_tokens
    location = engine.kv_location(rid)
    where = AT_INTERCEPTION[policy]
    held = {"device": location["device"], "host": location["host"],
            "discarded": location["discarded"]}[where]
    assert held >= context - 1, (policy, location)  # all of it (the last sampled token has no KV yet)
    engine.abort(rid)
    assert_all_free(engine)


@pytest.mark.parametrize("policy", ["discard", "infercept"])
def test_a_resume_before_the_next_step_still_gets_the_decision(default_model_dir, fresh_reference, policy):
    """The synchronous API may resume before any step planned the pause: a discarding policy still
    drops the KV (the turn recomputes: nothing reported cached), and the tokens equal a fresh run."""
    engine = make_engine(default_model_dir, policy, enable_prefix_caching=False)
    rid = engine.add_request(FEW_SHOT, SamplingParams(temperature=0, max_tokens=40), intercept=HERMES)
    while not any(o.paused for o in engine.step()):
        pass
    context = list(engine.scheduler.requests[rid].token_ids)
    appended = engine.tokenizer.encode(TOOL_RESULT)
    location = engine.resume(rid, appended, greedy(6))
    outs = drain(engine)
    resumed = last_output(outs, rid)
    first = next(o for o in outs if o.request_id == rid)
    if policy == "discard":
        assert location["device"] == location["host"] == 0
        assert first.num_cached_tokens == 0
    else:  # a fresh call with no history: min-waste keeps it for the next iteration
        assert location["device"] == len(context) - 1
        assert first.num_cached_tokens == len(context) - 1
    assert resumed.token_ids == fresh_reference(context + appended, 6)
    assert_all_free(engine)


def test_paused_kv_held_on_an_idle_engine_counts_as_waste(default_model_dir):
    """Memory waste is integrated over the engine's clock, not just over the steps that happen to run:
    a preserved context held through a 10 s tool call with no step meanwhile costs 10 s of its bytes."""
    engine = make_engine(default_model_dir, "preserve")
    now = [1000.0]
    engine.scheduler.clock = lambda: now[0]  # frozen while steps run: only the idle time is charged
    rid = engine.add_request(FEW_SHOT, SamplingParams(temperature=0, max_tokens=40), intercept=HERMES)
    drain(engine)
    held = engine.kv_location(rid)["device"]
    assert held > 0
    stats = engine.stats
    before = stats.memory_waste_until(now[0])
    now[0] += 10.0  # the tool runs; no step does
    assert stats.memory_waste_until(now[0]) - before == pytest.approx(held * stats.bytes_per_token * 10.0)
    engine.resume(rid, engine.tokenizer.encode(TOOL_RESULT), greedy(2))
    at_resume = stats.memory_waste_byte_seconds
    assert at_resume - before == pytest.approx(held * stats.bytes_per_token * 10.0)
    drain(engine)
    now[0] += 5.0  # nothing paused now: nothing held
    assert stats.memory_waste_until(now[0]) == pytest.approx(at_resume)
    assert_all_free(engine)


# -- the server's rule: a structured answer ends, an agent's step pauses -----------------------------

def function_tool(name: str, parameter: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} by {parameter}", "parameters": {
        "type": "object", "properties": {parameter: {"type": "string"}}, "required": [parameter]}}}


WEATHER_TOOL, ALARM_TOOL = function_tool("get_weather", "city"), function_tool("set_alarm", "time")
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def paused_generations(server) -> int:
    """Paused generations as the server's /metrics reports them (the engine's own count, every KV state)."""
    import httpx

    text = httpx.get(server.base + "/metrics", timeout=30).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("infercept_paused_requests{"))


def test_a_structured_answer_ends_instead_of_pausing(srv):
    """One tool, a tool_choice naming it and parallel_tool_calls false (LangChain's
    with_structured_output(method="function_calling")): the call is the answer, returned as any call, and
    the generation ends, since no result will come for it. "required" with that one tool, the name among
    several tools, or the name without parallel_tool_calls false (a one-tool agent loop forcing each
    step) is an agent's step: it pauses."""
    client = srv.client()

    def chat(tools, choice, stream=False, session_id=None, parallel=False):
        return client.chat.completions.create(model="smol", messages=WEATHER_QUESTION, tools=tools, tool_choice=choice,
                                              max_tokens=40, temperature=0, stream=stream, parallel_tool_calls=parallel,
                                              extra_body={"session_id": session_id} if session_id else None)

    answer = chat([WEATHER_TOOL], NAMED_WEATHER)
    assert answer.choices[0].finish_reason == "tool_calls"
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert paused_generations(srv) == 0 and not srv.app.state.conversations.paused()
    srv.assert_no_leak()

    chunks = list(chat([WEATHER_TOOL], NAMED_WEATHER, stream=True))  # streamed as any forced call
    deltas = [d for c in chunks for choice in c.choices for d in choice.delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert paused_generations(srv) == 0
    srv.assert_no_leak()

    response = client.responses.create(model="smol", input="What is the weather in Paris?", temperature=0,
                                       max_output_tokens=40, tools=[{"type": "function", **WEATHER_TOOL["function"]}],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       parallel_tool_calls=False)
    assert [(item.type, item.name) for item in response.output] == [("function_call", "get_weather")]
    assert paused_generations(srv) == 0
    srv.assert_no_leak()

    # A named chat session keeps it: its client may send only the tool results next, which needs the pause.
    for tools, choice, session_id, parallel in (([WEATHER_TOOL], "required", None, False),
                                                ([WEATHER_TOOL, ALARM_TOOL], NAMED_WEATHER, None, False),
                                                ([WEATHER_TOOL], NAMED_WEATHER, None, True),
                                                ([WEATHER_TOOL], NAMED_WEATHER, "structured-answer-session", False)):
        step = chat(tools, choice, session_id=session_id, parallel=parallel)
        assert step.choices[0].finish_reason == "tool_calls"
        assert paused_generations(srv) == 1 and len(srv.app.state.conversations.paused()) == 1, (choice, session_id)
        srv.abort_paused()
