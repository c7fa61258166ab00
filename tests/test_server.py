"""The HTTP server end to end: a real uvicorn on a loopback port, driven by the official `openai` SDK
(sync and async, streaming and not) and by raw HTTP where the SDK would refuse to send bad input.

The central check is the resume invariant (a resumed generation equals a recomputed one) through the
OpenAI API: the request that brings a tool result back resumes the paused generation (almost all of its
prompt is cached), and its greedy output
equals that of a server that recomputed everything (another instance with the discard policy, and a
fresh token-level request of the whole conversation).
"""
from __future__ import annotations

import asyncio
import inspect
import json

import httpx
import openai
import pytest
import torch

from infercept.server.app import build_app
from infercept.engine.backend import ToolFormat
from infercept.engine.hermes_format import example_exchanges
from infercept.server.chat import AssistantTurn, Call, Message, tool_specs
from infercept.server.protocol import ToolParam
from infercept.server.conversations import ConversationStore, Paused
from infercept.server.settings import ConversationPolicy, ServerSettings
from live_server import MODEL

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature": 21, "sky": "clear"}'
CALL_TOKENS = 40  # a Hermes call of get_weather is 31 tokens with its EOS
ANSWER_TOKENS = 10


def greedy(**kw) -> dict:
    return {"model": MODEL, "temperature": 0, **kw}


def sse_events(response: httpx.Response) -> list:
    """`data:` payloads of an SSE response, JSON-decoded except the final [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- basics ---------------------------------------------------------------------------------------

def test_health_models_and_metrics(srv):
    assert httpx.get(srv.base + "/health").json() == {"status": "ok"}
    models = srv.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert srv.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        srv.client().models.retrieve("gpt-4o")
    text = httpx.get(srv.base + "/metrics").text
    for name in ("infercept_requests_total", "infercept_time_to_first_token_seconds_bucket",
                 "infercept_recomputed_tokens_total", "infercept_swapped_out_blocks_total",
                 "infercept_memory_waste_byte_seconds_total", "infercept_kv_device_usage",
                 'infercept_paused_requests{kv_state="device",model="smol"}',
                 "infercept_inter_token_latency_seconds_bucket", "infercept_prefix_cache_hit_blocks_total",
                 "infercept_prefix_cache_blocks"):
        assert name in text, name


def inter_token_count(srv) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(srv.base + "/metrics").text):
        for sample in family.samples:
            if sample.name == "infercept_inter_token_latency_seconds_count":
                return sample.value
    raise AssertionError("no inter-token latency histogram")


def resumed_kv(srv) -> dict[str, float]:
    """`infercept_resumed_kv_total` by place (where resumed generations found their KV)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["place"]: s.value for family in text_string_to_metric_families(httpx.get(srv.base + "/metrics").text)
            for s in family.samples if s.name == "infercept_resumed_kv_total"}


def test_plain_chat_sync_and_async_agree(srv):
    messages = [{"role": "user", "content": "Name a color."}]
    sync = srv.client().chat.completions.create(messages=messages, max_tokens=8, **greedy())
    assert sync.object == "chat.completion" and sync.id.startswith("chatcmpl-")
    choice = sync.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")
    assert sync.usage.total_tokens == sync.usage.prompt_tokens + sync.usage.completion_tokens

    async def run():
        client = srv.async_client()
        return await client.chat.completions.create(messages=messages, max_tokens=8, **greedy())

    gaps_before = inter_token_count(srv)
    again = asyncio.run(run())
    assert again.choices[0].message.content == choice.message.content
    assert inter_token_count(srv) - gaps_before == again.usage.completion_tokens - 1  # one gap per later token
    # The repeat finds the first one's full prompt blocks in the prefix cache.
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16


# -- the tool loop ----------------------------------------------------------------------------------

def tool_turn(client: openai.OpenAI, **kw):
    first = client.chat.completions.create(messages=QUESTION, tools=TOOLS, max_tokens=CALL_TOKENS, **greedy(), **kw)
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0].message
    return first


def test_tool_loop_resumes_and_equals_recompute(srv, discard_server):
    client = srv.client()
    first = tool_turn(client)
    message = first.choices[0].message
    assert message.content is None
    (call,) = message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # The generation is paused in the engine, KV on the device, and registered.
    state = srv.assert_no_leak()
    assert list(state["requests"].values()) == ["intercepted"]

    # Arguments edited by the client: not the turn the model generated, so no resume; served fresh.
    edited = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]}
    other_turn = client.chat.completions.create(
        messages=QUESTION + [edited, {"role": "tool", "tool_call_id": call.id, "content": RESULT}],
        tools=TOOLS, max_tokens=2, **greedy())
    # Only the prefix cache helps: the blocks before the edited turn are the paused generation's.
    reused = other_turn.usage.prompt_tokens_details.cached_tokens
    assert 0 < reused < other_turn.usage.prompt_tokens - 16 and reused % 16 == 0

    # The SDK's own message object goes back, as agents do (it carries refusal/annotations fields).
    conversation = QUESTION + [message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    resumed_before = resumed_kv(srv)
    second = client.chat.completions.create(messages=conversation, tools=TOOLS, max_tokens=ANSWER_TOKENS,
                                            extra_body={"return_token_ids": True}, **greedy())
    usage = second.usage
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
    # Cached: the whole paused context but its last token (the EOS, sampled but never fed back).
    assert usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1
    after = resumed_kv(srv)
    assert {p: after[p] - resumed_before[p] for p in after} == {"device": 1, "host": 0, "recompute": 0}
    answer = second.choices[0].message.content
    prompt_ids, output_ids = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    assert answer and len(prompt_ids) == usage.prompt_tokens and len(output_ids) == usage.completion_tokens
    srv.assert_no_leak()

    # The same prompt as a new token-level completion: it finds the blocks in the prefix cache and gives
    # the same tokens (the server below checks the same against a recomputation from scratch).
    again = client.completions.create(prompt=prompt_ids, max_tokens=len(output_ids), extra_body={"return_token_ids": True},
                                      **greedy())
    assert again.choices[0].model_extra["token_ids"] == output_ids
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // 16 * 16

    # Another server whose policy discards paused KV at once: with nothing else running, the KV is
    # dropped at the tool call, the resume recomputes it, and the answer is the same.
    other = discard_server.client()
    first_b = tool_turn(other)
    (call_b,) = first_b.choices[0].message.tool_calls
    located = discard_server.paused_kv_locations()
    assert located and located[0]["device"] == 0 and located[0]["host"] == 0
    # JSON-equal arguments written differently still name the generated turn (and resume).
    respaced = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_b.id, "type": "function", "function": {"name": "get_weather", "arguments": '{ "city":"Paris" }'}}]}
    conversation_b = QUESTION + [respaced, {"role": "tool", "tool_call_id": call_b.id, "content": RESULT}]
    resumed_before = resumed_kv(discard_server)
    second_b = other.chat.completions.create(messages=conversation_b, tools=TOOLS, max_tokens=ANSWER_TOKENS,
                                             extra_body={"return_token_ids": True}, **greedy())
    assert second_b.usage.prompt_tokens_details.cached_tokens == 0
    after = resumed_kv(discard_server)
    assert {p: after[p] - resumed_before[p] for p in after} == {"device": 0, "host": 0, "recompute": 1}
    assert second_b.model_extra["prompt_token_ids"] == prompt_ids
    assert second_b.choices[0].model_extra["token_ids"] == output_ids
    assert second_b.choices[0].message.content == answer
    discard_server.assert_no_leak()


def test_streamed_tool_loop_async(srv):
    async def run():
        client = srv.async_client()
        stream = await client.chat.completions.create(messages=QUESTION, tools=TOOLS, max_tokens=CALL_TOKENS,
                                                      stream=True, stream_options={"include_usage": True}, **greedy())
        calls: dict[int, dict] = {}
        finish, usage, content = None, None, ""
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    slot["id"] = d.id or slot["id"]
                    slot["name"] += (d.function.name or "") if d.function else ""
                    slot["arguments"] += (d.function.arguments or "") if d.function else ""
                finish = choice.finish_reason or finish
        assert finish == "tool_calls" and content == "" and usage.completion_tokens > 0
        (call,) = calls.values()
        assert call["id"].startswith("call_") and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris"}
        # The SDK's accumulated form of the call goes back; the next turn streams from the resume.
        assistant = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}
        stream = await client.chat.completions.create(
            messages=QUESTION + [assistant, {"role": "tool", "tool_call_id": call["id"], "content": RESULT}],
            tools=TOOLS, max_tokens=ANSWER_TOKENS, stream=True, stream_options={"include_usage": True}, **greedy())
        text, usage = "", None
        async for chunk in stream:
            usage = chunk.usage or usage
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return text, usage

    text, usage = asyncio.run(run())
    assert text and usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens


def test_a_last_step_with_tool_choice_none_resumes(srv):
    """An agent's final step forbids further calls: its prompt is the calling steps' prompt plus the tool
    result, so it resumes the paused generation, and its answer is text that uses the result."""
    client = srv.client()
    first = tool_turn(client)
    (call,) = first.choices[0].message.tool_calls
    conversation = QUESTION + [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    last = client.chat.completions.create(messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=20,
                                          **greedy())
    assert last.choices[0].finish_reason == "stop" and not last.choices[0].message.tool_calls
    assert last.usage.prompt_tokens_details.cached_tokens >= 0.9 * last.usage.prompt_tokens
    assert "clear" in last.choices[0].message.content and "<" not in last.choices[0].message.content  # from RESULT


def test_a_step_without_tools_resumes_with_the_paused_tools_when_the_server_is_told_to(srv, monkeypatch):
    """A step that sends the call's result back without tools (AutoGen's reflection) renders another
    prompt, so it is served fresh; with --resume-without-tools the server renders it with the paused
    prompt's tools and tool_choice none: it resumes, and answers what that request sent whole answers."""
    from dataclasses import replace

    from live_server import resumes

    client, store = srv.client(), srv.app.state.conversations

    def reflect():
        first = tool_turn(client)
        (call,) = first.choices[0].message.tool_calls
        conversation = QUESTION + [first.choices[0].message,
                                   {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
        before = resumes(srv.url)
        answer = client.chat.completions.create(messages=conversation, max_tokens=20, **greedy())
        return first, conversation, answer, resumes(srv.url) - before

    first, _, fresh, resumed = reflect()
    assert resumed == 0 and fresh.usage.prompt_tokens_details.cached_tokens < 0.5 * fresh.usage.prompt_tokens
    srv.abort_paused()
    monkeypatch.setattr(store, "policy", replace(store.policy, resume_without_tools=True))
    first, conversation, answer, resumed = reflect()
    assert resumed == 1 and answer.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    monkeypatch.setattr(store, "policy", replace(store.policy, resume_without_tools=False))
    whole = client.chat.completions.create(messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=20,
                                           **greedy())
    assert answer.choices[0].message.content == whole.choices[0].message.content

def test_explicit_session_continuation(srv):
    client = srv.client()
    first = tool_turn(client, extra_body={"session_id": "agent-7"})
    assert first.model_extra["session_id"] == "agent-7"
    (call,) = first.choices[0].message.tool_calls
    # Only the tool result, continuing the stored conversation, named by the header.
    tool_message = [{"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = client.chat.completions.create(messages=tool_message, tools=TOOLS, max_tokens=4,
                                            extra_headers={"X-Session-Id": "agent-7"}, **greedy())
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * second.usage.prompt_tokens
    # Not paused any more: continuing it again with a tool result is a conflict; an unknown session is 404.
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(messages=tool_message, tools=TOOLS, max_tokens=4,
                                       extra_body={"session_id": "agent-7"}, **greedy())
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(messages=tool_message, tools=TOOLS, max_tokens=4,
                                       extra_body={"session_id": "nobody"}, **greedy())


def test_tool_choice_modes(srv):
    client = srv.client()
    auto = tool_turn(client)
    # "none": the same prompt as "auto" (the tools stay rendered), and the model, which calls get_weather
    # in "auto", answers in text instead, with no trace of a call.
    none = client.chat.completions.create(messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=12, **greedy())
    assert none.choices[0].finish_reason in ("stop", "length") and not none.choices[0].message.tool_calls
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens
    assert none.usage.prompt_tokens_details.cached_tokens >= 0.9 * none.usage.prompt_tokens
    assert none.choices[0].message.content.strip() and "<" not in none.choices[0].message.content
    # A required call: the server starts the assistant turn with the call's opening (the model fills in
    # the rest); the output is parsed and validated like any call.
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
                                             tool_choice=choice, max_tokens=28, **greedy())
        assert out.choices[0].finish_reason == "tool_calls"
        (call,) = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}


# -- streaming shapes -------------------------------------------------------------------------------

def test_chat_stream_shapes(srv):
    body = greedy(messages=[{"role": "user", "content": "Count to three."}], max_tokens=6, stream=True,
                  stream_options={"include_usage": True})
    with httpx.stream("POST", srv.url + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
        assert c["object"] == "chat.completion.chunk" and c["model"] == MODEL
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    *body_chunks, finish_chunk, usage_chunk = chunks
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all(set(c["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"} for c in body_chunks)
    assert set(finish_chunk["choices"][0]) == {"index", "delta", "logprobs", "finish_reason", "stop_reason"}
    assert finish_chunk["choices"][0]["finish_reason"] == "length" and finish_chunk["choices"][0]["delta"] == {}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in body_chunks)
    full = srv.client().chat.completions.create(messages=body["messages"], max_tokens=6, **greedy())
    assert text == full.choices[0].message.content
    # Without include_usage there is no usage key at all.
    with httpx.stream("POST", srv.url + "/chat/completions", json=body | {"stream_options": None}, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all("usage" not in c for c in events[:-1])


# -- completions ------------------------------------------------------------------------------------

def test_completions_token_prompts_and_token_level_resume(srv):
    client = srv.client()
    tok = srv.engine.tokenizer
    prompt = tok.encode("The three primary colors are")
    text = client.completions.create(prompt="The three primary colors are", max_tokens=5, logprobs=2, **greedy())
    ids = client.completions.create(prompt=prompt, max_tokens=5, extra_body={"return_token_ids": True}, **greedy())
    assert text.choices[0].text == ids.choices[0].text and text.object == "text_completion"
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == text.choices[0].text and len(lp.top_logprobs[0]) == 2

    # `intercept`: the stop pauses the generation; the next prompt extends it token for token.
    first = client.completions.create(prompt=prompt, max_tokens=5, extra_body={
        "return_token_ids": True, "intercept": {"kind": "human", "expected_s": 0.5}}, **greedy())
    generated = first.choices[0].model_extra["token_ids"]
    assert first.choices[0].finish_reason == "length" and generated == ids.choices[0].model_extra["token_ids"]
    assert len(srv.app.state.conversations.paused()) == 1
    extended = prompt + generated + tok.encode(" Also,")
    resumed = client.completions.create(prompt=extended, max_tokens=6, extra_body={"return_token_ids": True},
                                        **greedy())
    assert resumed.usage.prompt_tokens_details.cached_tokens == len(prompt) + len(generated) - 1
    fresh = client.completions.create(prompt=extended, max_tokens=6, extra_body={"return_token_ids": True},
                                      **greedy())
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert resumed.choices[0].model_extra["token_ids"] == fresh.choices[0].model_extra["token_ids"]

    # A batch of prompts, streamed: each index ends with its finish reason, then usage, then [DONE].
    body = {"model": MODEL, "prompt": [prompt, tok.encode("Once upon a time")], "max_tokens": 3, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + "/completions", json=body, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in events[:-2]
                if c["choices"][0]["finish_reason"]}
    assert finished == {0: "length", 1: "length"}
    streamed = "".join(c["choices"][0]["text"] for c in events[:-2] if c["choices"][0]["index"] == 0)
    assert streamed == ids.choices[0].text[:len(streamed)] and streamed


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(srv):
    """vLLM's `return_tokens_as_token_ids`: every token in logprobs, alternatives too, is "token_id:<id>",
    the ids those of the output (what RL frameworks rebuild a rollout's tokens from); the text is the same."""
    client = srv.client()
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    chat = client.chat.completions.create(messages=QUESTION, max_tokens=6, logprobs=True, top_logprobs=2,
                                          extra_body=extra, **greedy())
    content = chat.choices[0].logprobs.content
    assert [lp.token for lp in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(lp.top_logprobs[0].token == lp.token and lp.bytes == list(lp.token.encode()) for lp in content)
    plain = client.chat.completions.create(messages=QUESTION, max_tokens=6, **greedy())
    assert chat.choices[0].message.content == plain.choices[0].message.content
    text = client.completions.create(prompt="The three primary colors are", max_tokens=4, logprobs=1,
                                     echo=True, extra_body=extra, **greedy())
    lp, choice = text.choices[0].logprobs, text.choices[0]
    ids = choice.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(label.startswith("token_id:") for top in lp.top_logprobs[1:] for label in top)
    tok = srv.engine.tokenizer
    assert lp.text_offset[-1] == len(choice.text) - len(tok.decode(ids[-1:]))  # offsets into the text


def test_allowed_token_ids_and_bad_words_reach_the_sampler(srv):
    """vLLM's `allowed_token_ids` and `bad_words` on chat completions, completions and Responses: the
    output keeps to the allowed ids and never writes the bad word; an id outside the vocabulary is a 400."""
    client, tok = srv.client(), srv.engine.tokenizer
    plain = client.completions.create(prompt="The capital of France is", max_tokens=8, **greedy())
    word = plain.choices[0].text.split()[0].strip(".,")  # the answer's first word
    avoided = client.completions.create(prompt="The capital of France is", max_tokens=8,
                                        extra_body={"bad_words": [word]}, **greedy())
    assert word in plain.choices[0].text and word not in avoided.choices[0].text
    allowed = sorted(set(tok.encode(" yes no maybe", add_special_tokens=False)))
    chat = client.chat.completions.create(messages=QUESTION, max_tokens=4, extra_body={
        "allowed_token_ids": allowed, "return_token_ids": True}, **greedy())
    assert set(chat.choices[0].model_extra["token_ids"]) <= set(allowed)
    response = client.responses.create(model=MODEL, input="Is Paris in France?", max_output_tokens=4, temperature=0,
                                       extra_body={"allowed_token_ids": allowed})
    assert set(tok.encode(response.output_text, add_special_tokens=False)) <= set(allowed)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(messages=QUESTION, max_tokens=4, extra_body={"allowed_token_ids": [10 ** 9]},
                                       **greedy())
    assert refused.value.body["param"] == "allowed_token_ids"
    with pytest.raises(openai.BadRequestError, match="grammar"):  # a forced call: the grammar decides
        client.chat.completions.create(messages=QUESTION, max_tokens=4, tools=TOOLS, tool_choice="required",
                                       extra_body={"allowed_token_ids": allowed}, **greedy())


def test_skip_special_tokens_false_keeps_the_special_tokens_in_the_text(srv):
    """vLLM's `skip_special_tokens`: a special token the model writes (here one forced by logit_bias) is
    left out of the text by default and kept with false."""
    client, tok = srv.client(), srv.engine.tokenizer
    special = tok.convert_ids_to_tokens(1)
    assert special in tok.all_special_tokens
    ask = dict(messages=QUESTION, max_tokens=2, logit_bias={"1": 100}, **greedy())
    kept = client.chat.completions.create(**ask, extra_body={"skip_special_tokens": False, "return_token_ids": True})
    assert kept.choices[0].model_extra["token_ids"] == [1, 1] and kept.choices[0].message.content == special * 2
    assert not client.chat.completions.create(**ask).choices[0].message.content
    text = client.completions.create(prompt="Hi", max_tokens=2, logit_bias={"1": 100},
                                     extra_body={"skip_special_tokens": False}, **greedy())
    assert text.choices[0].text == special * 2


def test_request_id_names_the_response_and_may_repeat(srv):
    """vLLM's `request_id`: the response is "chatcmpl-<id>" ("cmpl-<id>"), an X-Request-Id header naming it
    first; two requests at once may name one id (their engine requests differ), a sample's id has its index."""
    client = srv.client()
    ask = dict(messages=QUESTION, max_tokens=2, **greedy())

    async def twice():
        aio = srv.async_client()
        return await asyncio.gather(*(aio.chat.completions.create(**ask, extra_body={"request_id": "trace-7"})
                                      for _ in range(2)))

    one, two = asyncio.run(twice())
    assert one.id == two.id == "chatcmpl-trace-7" and one.choices[0].message.content == two.choices[0].message.content
    raw = client.chat.completions.with_raw_response.create(**ask, extra_headers={"X-Request-Id": "from-header"},
                                                           extra_body={"request_id": "from-body"})
    assert raw.parse().id == raw.headers["x-request-id"] == "chatcmpl-from-header"
    samples = client.chat.completions.create(**ask, n=2, extra_body={"request_id": "many"})
    assert samples.id == "chatcmpl-many" and [c.index for c in samples.choices] == [0, 1]
    text = client.completions.create(prompt="Hi", max_tokens=2, extra_body={"request_id": "c1"}, **greedy())
    assert text.id == "cmpl-c1"
    assert client.chat.completions.create(**ask).id.startswith("chatcmpl-")

def test_stop_token_ids_and_include_stop_str_in_output(srv):
    """vLLM's fields: a stop token ends the output as EOS does (its id last in token_ids, its text left
    out), and `include_stop_str_in_output` keeps the stop token's text or the stop string."""
    client, tok = srv.client(), srv.engine.tokenizer
    prompt = "Count: 1, 2, 3, 4,"
    full = client.completions.create(prompt=prompt, max_tokens=8, extra_body={"return_token_ids": True}, **greedy())
    ids = full.choices[0].model_extra["token_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])

    def complete(**extra):
        out = client.completions.create(prompt=prompt, max_tokens=8, extra_body={"return_token_ids": True, **extra},
                                        **greedy()).choices[0]
        return out, out.model_extra["token_ids"]

    out, got = complete(stop_token_ids=[ids[k]])
    assert got == ids[:k + 1] and out.text == tok.decode(ids[:k])
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == ids[k]
    out, got = complete(stop_token_ids=[ids[k]], include_stop_str_in_output=True)
    assert got == ids[:k + 1] and out.text == tok.decode(ids[:k + 1])
    stop = tok.decode(ids[k:k + 1]).strip()
    out, _ = complete(stop=[stop], include_stop_str_in_output=True)
    assert out.text.endswith(stop) and out.text == full.choices[0].text[:full.choices[0].text.index(stop) + len(stop)]
    chat = client.chat.completions.create(messages=QUESTION, max_tokens=8, extra_body={"return_token_ids": True},
                                          **greedy())
    chat_ids = chat.choices[0].model_extra["token_ids"]
    stopped = client.chat.completions.create(messages=QUESTION, max_tokens=8, **greedy(),
                                             extra_body={"return_token_ids": True, "stop_token_ids": [chat_ids[1]]})
    assert stopped.choices[0].model_extra["token_ids"] == chat_ids[:chat_ids.index(chat_ids[1]) + 1]
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == chat_ids[1]
    assert chat.choices[0].model_extra["stop_reason"] is None  # EOS or the length limit: vLLM names none
    streamed = client.chat.completions.create(messages=QUESTION, max_tokens=8, stream=True, **greedy(),
                                              extra_body={"stop_token_ids": [chat_ids[1]]})
    last = [c for c in streamed if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == chat_ids[1]


# -- bad input, auth, limits, disconnects -----------------------------------------------------------

BAD_CHAT = [
    ("malformed json", b'{"model": "smol", "messages": [', 400),
    ("not an object", b"[1, 2]", 400),
    ("missing messages", {"model": MODEL}, 400),
    ("messages not a list", {"model": MODEL, "messages": "hi"}, 400),
    ("wrong temperature type", {"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400),
    ("negative max_tokens", {"model": MODEL, "messages": QUESTION, "max_tokens": -1}, 400),
    ("unknown field", {"model": MODEL, "messages": QUESTION, "frobnicate": 1}, 400),
    ("unknown model", {"model": "gpt-9", "messages": QUESTION}, 404),
    ("empty messages", {"model": MODEL, "messages": []}, 400),
    ("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("tool result for a call never made", {"model": MODEL, "messages": QUESTION + [
        {"role": "tool", "tool_call_id": "call_nope", "content": "1"}]}, 400),
    ("tool message without id", {"model": MODEL, "messages": QUESTION + [{"role": "tool", "content": "1"}]}, 400),
    ("call without result", {"model": MODEL, "messages": QUESTION + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400),
    ("image part", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
    ("required without tools", {"model": MODEL, "messages": QUESTION, "tool_choice": "required"}, 400),
    ("named unknown tool", {"model": MODEL, "messages": QUESTION, "tools": TOOLS,
                            "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
    ("empty stop", {"model": MODEL, "messages": QUESTION, "stop": [""]}, 400),
    ("n=2 with tools (a turn that may pause)", {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "n": 2}, 400),
    ("penalty out of range", {"model": MODEL, "messages": QUESTION, "presence_penalty": 2.5}, 400),
    ("bad session id", {"model": MODEL, "messages": QUESTION, "session_id": "a b"}, 400),
    ("unknown session", {"model": MODEL, "messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}],
                         "session_id": "ghost"}, 404),
    ("min_tokens over max", {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "min_tokens": 5}, 400),
    ("stop token id out of range", {"model": MODEL, "messages": QUESTION, "stop_token_ids": [10 ** 9]}, 400),
    ("lone surrogate", b'{"model": "smol", "messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("deep nesting", b'{"model": "smol", "messages": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400),
    ("odd tool schema", {"model": MODEL, "messages": QUESTION, "max_tokens": 1, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": 5}, "required": "x"}}}]}, 200),
    ("content parts", {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]}, 200),
]
BAD_COMPLETIONS = [
    ("empty prompt", {"model": MODEL, "prompt": []}, 400),
    ("empty text prompt", {"model": MODEL, "prompt": ""}, 400),
    ("token id out of range", {"model": MODEL, "prompt": [10 ** 9]}, 400),
    ("negative token id", {"model": MODEL, "prompt": [-1, 5]}, 400),
    ("prompt too long", {"model": MODEL, "prompt": [5] * 9000}, 400),
    ("logprobs too many", {"model": MODEL, "prompt": "hi", "logprobs": 10}, 400),
    ("suffix", {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400),
    ("prompt_logprobs streamed", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400),
    ("prompt_logprobs too many", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, 400),
    ("bad intercept kind", {"model": MODEL, "prompt": "hi", "intercept": {"kind": "oracle"}}, 400),
    ("mixed prompt list", {"model": MODEL, "prompt": ["a", 5]}, 400),
    ("lone surrogate", b'{"model": "smol", "prompt": "\\ud800"}', 400),
    ("empty prompt in a batch", {"model": MODEL, "prompt": [[1, 2], []]}, 400),
    ("negative stop token id", {"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, 400),
]


@pytest.mark.parametrize("path,cases", [("/chat/completions", BAD_CHAT), ("/completions", BAD_COMPLETIONS)])
def test_bad_input_is_4xx_in_openai_shape_and_leaks_nothing(srv, path, cases):
    failures = []
    with httpx.Client(timeout=60) as http:
        for name, body, status in cases:
            kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
                if isinstance(body, bytes) else {"json": body}
            r = http.post(srv.url + path, **kwargs)
            if status == 200:  # odd but valid input
                if r.status_code != 200:
                    failures.append((name, r.status_code, r.text[:200]))
                continue
            error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
            if r.status_code != status or not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
                failures.append((name, r.status_code, r.text[:200]))
        for method, route, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405)):
            r = http.request(method, srv.base + route)
            if r.status_code != status or "error" not in r.json():
                failures.append((route, r.status_code, r.text[:200]))
    assert not failures, failures
    srv.assert_no_leak()


def test_auth_body_limit_and_paused_limits(srv):
    """A second app on the same running engine, over ASGI (no lifespan: the engine stays the module's)."""
    app = build_app(srv.backend, ServerSettings(served_model_name=MODEL, api_key="sekret", max_body_bytes=4096,
                                                conversations=ConversationPolicy(max_paused=1)))

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            assert (await http.get("/v1/models")).status_code == 401
            r = await http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert (await http.get("/health")).status_code == 200  # health needs no key
            auth = {"Authorization": "Bearer sekret"}
            assert (await http.get("/v1/models", headers=auth)).status_code == 200
            big = {"model": MODEL, "prompt": "x" * 5000}
            assert (await http.post("/v1/completions", json=big, headers=auth)).status_code == 413
            # max_paused=1: of two paused generations the one keeping less KV goes (here the newer one,
            # with a shorter context), and says so in the metrics.
            ids = []
            for prompt in ("Count with me, slowly and carefully, from one to ten: one, two,", "Red, green,"):
                r = await http.post("/v1/completions", headers=auth, json=greedy(
                    prompt=prompt, max_tokens=2, intercept={"kind": "tool", "expected_s": 1.0}))
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
                ids.append(r.json()["id"] + "-0")
            store = app.state.conversations
            assert [e.request_id for e in store.paused()] == [ids[0]]
            metrics = (await http.get("/metrics")).text
            assert 'infercept_paused_evictions_total{cause="limits",model="smol"} 1.0' in metrics
            released = next(line for line in metrics.splitlines()
                            if line.startswith('infercept_paused_released_kv_tokens_total{cause="limits"'))
            assert float(released.split()[-1]) > 0
            state = await srv.async_engine.call(lambda: dict(srv.engine.scheduler.requests))
            for _ in range(100):  # the abort is posted to the engine thread
                if ids[0] not in state:
                    break
                await asyncio.sleep(0.02)
                state = await srv.async_engine.call(lambda: dict(srv.engine.scheduler.requests))
            assert list(state) == [ids[0]]
            store.release_all("shutdown", "the test is over")

    asyncio.run(run())
    srv.assert_no_leak()


def test_paused_generations_are_limited_by_memory_by_default(srv):
    """No count limit unless the operator sets one; the token limit is what the KV pools hold."""
    policy = build_app(srv.backend, ServerSettings(served_model_name=MODEL)).state.conversations.policy
    bm = srv.engine.block_manager
    assert policy.max_paused is None
    assert policy.max_paused_tokens == (bm.device.num_blocks + bm.host.num_blocks) * bm.block_size
    assert policy.max_named_sessions >= 4096  # named sessions are not capped by a paused count either
    capped = build_app(srv.backend, ServerSettings(served_model_name=MODEL, conversations=ConversationPolicy(
        max_paused=5, max_paused_tokens=1000))).state.conversations.policy
    assert (capped.max_paused, capped.max_paused_tokens) == (5, 1000)


def test_client_disconnect_aborts_and_frees_blocks(srv):
    body = greedy(messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=400,
                  ignore_eos=True, stream=True)
    with httpx.stream("POST", srv.url + "/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        received = 0
        for line in lines:
            received += line.startswith("data: ")
            if received >= 3:
                break  # leaving the block closes the connection mid-stream
    srv.assert_no_leak(timeout=10)
    # Non-streaming: the client gives up while the server generates.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/completions", json=greedy(prompt="Once upon a time", max_tokens=400, ignore_eos=True),
                   timeout=0.5)
    srv.assert_no_leak(timeout=10)


# -- pure pieces: the conversation store, the example prompt, the CLI -----------------------------

def store(released: list | None = None, clock: list | None = None, kept_tokens=lambda rid: 0,
          **policy) -> ConversationStore:
    """A store whose releases are recorded as (request id, cause), on a clock moved by hand."""
    released = [] if released is None else released
    clock = [0.0] if clock is None else clock
    return ConversationStore(ConversationPolicy(**policy), lambda rid, cause, reason: released.append((rid, cause)),
                             kept_tokens, clock=lambda: clock[0])


def test_store_matching_ttl_and_limits():
    clock, released = [0.0], []
    reg = store(released, clock, idle_ttl=10, max_paused=2, max_paused_tokens=100)
    user = Message("user", "hi")
    call = Call.make("call_1", "f", '{"a": 1}')
    turn = AssistantTurn(Message("assistant", "", None, (call,)), (7, 8, 2))
    reg.pause(Paused("r1", [1, 2, 3, 7, 8, 2], turn, (user,)))
    assert released == []
    result = Message("tool", "42", tool_call_id="call_1")
    same_args = Message("assistant", "", None, (Call.make("call_1", "f", '{ "a":1 }'),))
    assert reg.find_for_messages([user, same_args, result]).request_id == "r1"
    assert reg.find_for_messages([user, same_args]) is None  # no tool result
    assert reg.find_for_messages([Message("user", "hello"), same_args, result]) is None  # history changed
    other_args = Message("assistant", "", None, (Call.make("call_1", "f", '{"a": 2}'),))
    assert reg.find_for_messages([user, other_args, result]) is None
    assert reg.known_turn(same_args) is turn and reg.known_turn(other_args) is None
    assert reg.find_for_tokens([1, 2, 3, 7, 8, 2, 9]).request_id == "r1"
    assert reg.find_for_tokens([1, 2, 3, 7, 8, 2]) is None  # nothing to append
    clock[0] = 1
    reg.pause(Paused("r2", [5] * 50))
    r3 = Paused("r3", [6] * 10)
    reg.pause(r3)
    assert released == [("r1", "limits")]  # over max_paused: the oldest of equals goes
    reg.pause(Paused("r4", [6] * 45))
    assert released == [("r1", "limits"), ("r2", "limits")]  # over max_paused_tokens
    assert reg.take(r3) is r3 and reg.take(r3) is None
    clock[0] = 20
    reg.expire()
    assert released[2:] == [("r4", "ttl")] and reg.paused() == [] and reg.num_paused_tokens == 0


def test_store_releases_the_paused_generation_keeping_least_kv():
    kept, released = {"old-on-host": 60, "discarded": 0, "new-on-device": 40}, []
    reg = store(released, max_paused_tokens=140, kept_tokens=lambda rid: kept.get(rid, 0))
    reg.pause(Paused("old-on-host", [1] * 60))
    reg.pause(Paused("discarded", [2] * 50))
    reg.pause(Paused("new-on-device", [3] * 40))
    assert released == [("discarded", "limits")]  # 150 > 140 tokens: a discarded one
    kept["newest"] = 45
    reg.pause(Paused("newest", [4] * 45))
    assert released[1:] == [("new-on-device", "limits")]  # then the least KV kept
    assert [e.request_id for e in reg.paused()] == ["old-on-host", "newest"]
    unlimited_released = []
    unlimited = store(unlimited_released)
    for i in range(3000):
        unlimited.pause(Paused(f"r{i}", [i % 7, i]))
    assert unlimited_released == [] and len(unlimited.paused()) == 3000


def test_store_finds_the_longest_paused_sequence_a_prompt_extends():
    reg = store()
    system = list(range(100, 140))  # 40 shared tokens: two full blocks and a part
    handles = {rid: Paused(rid, ids) for rid, ids in (
        ("short", system[:5]), ("a", system + [1, 2, 3]), ("b", system + [1, 2, 3] + list(range(20))),
        ("other", system + [9]))}
    for handle in handles.values():
        reg.pause(handle)
    assert reg.find_for_tokens(system + [1, 2, 3] + list(range(20)) + [7]).request_id == "b"
    assert reg.find_for_tokens(system + [1, 2, 3] + list(range(19))).request_id == "a"
    assert reg.find_for_tokens(system + [1, 2, 3]).request_id == "short"  # "a" is not strictly extended
    assert reg.find_for_tokens(system[:5]) is None
    assert reg.find_for_tokens(system + [9, 9]).request_id == "other"
    reg.take(handles["b"])
    assert reg.find_for_tokens(system + [1, 2, 3] + list(range(20)) + [7]).request_id == "a"
    for rid in ("a", "short", "other"):
        reg.take(handles[rid])
    assert reg.find_for_tokens(system + [9, 9]) is None and not reg._by_blocks


def test_example_exchanges_follow_the_tool_schema():
    (tool,) = tool_specs([ToolParam.model_validate(TOOLS[0])])
    (q1, c1, q2, c2) = example_exchanges(tool)
    assert q1 == {"role": "user", "content": "What is the weather in Rome?"}
    assert c1["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert q2["content"] == "What is the weather in Berlin?"
    (enum_tool,) = tool_specs([ToolParam.model_validate({"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": ["C", "F"]}, "n": {"type": "integer"}}}}})])
    q, c, *_ = example_exchanges(enum_tool)
    assert q["content"] == "What is the convert for C?" and '"arguments": {"unit": "C"}' in c["content"]


def test_serve_cli_flags_and_environment(monkeypatch):
    from infercept.server import cli

    monkeypatch.setenv("INFERCEPT_SESSION_TTL", "30")  # the old names still work
    args = cli.build_parser().parse_args(["serve", "--port", "0", "--policy", "discard", "--api-key", "k",
                                          "--max-sessions", "3", "--served-model-name", "m"])
    settings = cli.server_settings(args)
    assert (settings.host, settings.port, settings.api_key, settings.conversations.idle_ttl,
            settings.conversations.max_paused, settings.served_model_name) == ("127.0.0.1", 0, "k", 30.0, 3, "m")
    assert cli.engine_kwargs(args)["policy"] == "discard"
    with pytest.raises(ValueError):
        ConversationPolicy(idle_ttl=0)
    monkeypatch.setenv("INFERCEPT_IDLE_TTL", "40")  # the new name wins over the old
    monkeypatch.setenv("INFERCEPT_MAX_NAMED_SESSIONS", "7")
    args = cli.build_parser().parse_args(["serve", "--session-ttl", "50", "--max-paused", "4", "--max-paused-tokens",
                                          "900", "--response-ttl", "60", "--max-stored-responses", "8"])
    assert cli.server_settings(args).conversations == ConversationPolicy(
        idle_ttl=50.0, max_paused=4, max_paused_tokens=900, max_named_sessions=7, response_ttl=60.0,
        max_stored_responses=8)
    args = cli.build_parser().parse_args(["serve", "--idle-ttl", "45", "--max-named-sessions", "9"])
    assert (cli.server_settings(args).conversations.idle_ttl, args.max_named_sessions) == (45.0, 9)
    assert cli.build_parser().parse_args(["serve"]).idle_ttl == 40.0
    assert not cli.server_settings(cli.build_parser().parse_args(["serve"])).conversations.resume_without_tools
    monkeypatch.setenv("INFERCEPT_RESUME_WITHOUT_TOOLS", "1")
    assert cli.server_settings(cli.build_parser().parse_args(["serve"])).conversations.resume_without_tools


def test_renderer_extends_paused_tokens_exactly(tokenizer):
    """A conversation's rendering starts with the paused context of the turn before it, token for token,
    even when the model tokenized its call differently from how the text would be tokenized, and across
    several tool steps."""
    from infercept.server.chat import ChatRenderer, normalize_messages
    from infercept.server.protocol import ChatCompletionRequest

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tokenizer, frozenset({eos}), ToolFormat("hermes"))
    assert renderer.turn_end == "<|im_end|>\n" and not renderer.native_tools
    tools = tool_specs([ToolParam.model_validate(t) for t in TOOLS])
    reg = store(max_paused=8, max_paused_tokens=10 ** 6)

    def messages(raw):
        return normalize_messages(ChatCompletionRequest(model=MODEL, messages=raw).messages)

    def generated(text: str, odd: bool) -> list[int]:
        # `odd`: one token per character, as a model may emit; never the tokenizer's own split.
        ids = [t for ch in text for t in tokenizer.encode(ch)] if odd else tokenizer.encode(text)
        return ids + [eos]

    conversation = list(QUESTION)
    context = renderer.render(messages(conversation), tools, reg.known_turn)
    for step, odd in enumerate((True, False)):
        call_id = f"call_{step}"
        turn_ids = generated('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', odd)
        assistant = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
        reg.remember_turn(AssistantTurn(messages(conversation + [assistant, {
            "role": "tool", "tool_call_id": call_id, "content": "x"}])[-2], tuple(turn_ids)))
        paused = context + turn_ids
        conversation += [assistant, {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
        context = renderer.render(messages(conversation), tools, reg.known_turn)
        assert context[:len(paused)] == paused
        appended = tokenizer.decode(context[len(paused):], skip_special_tokens=False)
        assert appended == f"\n<|im_start|>tool\n{RESULT}<|im_end|>\n<|im_start|>assistant\n"
    # Without the remembered turns the same conversation renders from its text alone.
    plain = renderer.render(messages(conversation), tools)
    assert plain != context and tokenizer.decode(plain) == tokenizer.decode(context)


def test_serve_flags_default_to_the_engine_config(monkeypatch):
    """`infercept serve` spells its engine defaults as literals, so `--help` needs no torch import; they
    must stay the engine config's (the benchmarks read the config for the server's defaults)."""
    from infercept.engine.config import CacheConfig, SchedulerConfig
    from infercept.server.cli import build_parser

    for name in ("MAX_NUM_BATCHED_TOKENS", "MAX_NUM_SEQS", "HOST_KV_GB", "PREFIX_CACHING"):
        monkeypatch.delenv(f"INFERCEPT_{name}", raising=False)
    args = build_parser().parse_args(["serve"])
    assert args.max_num_batched_tokens is None  # the engine's default_step_tokens: the config's on a CPU
    from infercept.engine.engine import default_step_tokens
    from infercept.engine.policy.profile import h100_llama3_8b

    assert default_step_tokens(torch.device("cpu"), h100_llama3_8b(), 64) == SchedulerConfig.max_num_batched_tokens
    assert default_step_tokens(torch.device("cuda"), h100_llama3_8b(), 64) == h100_llama3_8b().saturation_point
    # unset: each backend's own default, the engine config's on the native engine (vLLM's on --backend vllm)
    from infercept.engine.engine import Engine
    from infercept.server.cli import engine_kwargs

    assert args.max_num_seqs is None and "max_num_seqs" not in engine_kwargs(args)
    assert inspect.signature(Engine).parameters["max_num_seqs"].default == SchedulerConfig.max_num_seqs
    assert args.host_kv_gb == CacheConfig.host_kv_gb
    assert args.prefix_caching == CacheConfig.enable_prefix_caching
