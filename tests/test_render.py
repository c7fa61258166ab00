"""vLLM's render and tokenizer routes on the live server: the prompt token ids a request would be served
with, and token ids' text.

A router that routes by token prefix (vllm-router's cache_aware policy, docs/replicas.md) asks each
replica for them and sends a request where the longest prefix of its ids went before; a resume reaches
the replica holding its pause only if the ids it renders to extend those of the turn that paused.
`/tokenize` gives clients the same ids (a conversation's, with its paused turns as generated), and
`/detokenize` their text."""
from __future__ import annotations

import json

import httpx
import pytest

from live_server import MODEL
from test_server import CALL_TOKENS, QUESTION, RESULT, TOOLS, greedy, tool_turn


def render(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/{path}/render", json=body, timeout=60)


def test_chat_render_is_the_prompt_the_request_is_served_with(srv, tokenizer):
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS}
    rendered = render(srv, "chat/completions", body)
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["token_ids"]
    assert rendered.json()["request_id"]
    first = tool_turn(srv.client())
    assert first.usage.prompt_tokens == len(ids)
    assert "What is the weather in Paris?" in tokenizer.decode(ids)
    # The resume (the conversation sent again with the tool result) renders to ids that extend these.
    (call,) = first.choices[0].message.tool_calls
    resumed = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    resumed_ids = render(srv, "chat/completions", {**body, "messages": resumed}).json()["token_ids"]
    assert resumed_ids[:len(ids)] == ids and len(resumed_ids) > len(ids)
    second = srv.client().chat.completions.create(messages=resumed, tools=TOOLS, max_tokens=4, **greedy())
    assert second.usage.prompt_tokens == len(resumed_ids)


def test_a_session_continuation_renders_its_whole_conversation(srv):
    first = tool_turn(srv.client(), extra_body={"session_id": "render-1"})
    (call,) = first.choices[0].message.tool_calls
    tool_message = [{"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    body = {"model": MODEL, "messages": tool_message, "tools": TOOLS, "session_id": "render-1"}
    ids = render(srv, "chat/completions", body).json()["token_ids"]
    assert len(ids) > first.usage.prompt_tokens  # the stored conversation, then the result
    # Rendering opened nothing: the session is still paused at its call and takes its result.
    second = srv.client().chat.completions.create(messages=tool_message, tools=TOOLS, max_tokens=4,
                                                  extra_body={"session_id": "render-1"}, **greedy())
    assert second.usage.prompt_tokens == len(ids)
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * second.usage.prompt_tokens


def test_a_session_this_replica_does_not_hold_renders_to_ids_that_match_nothing(srv):
    """The other replicas' answer for a session continuation. Not a 404: vllm-router drops the prefix match
    of a request when any replica's render fails (or has no ids) and balances it by load, so the request
    would reach the replica that holds the session only by chance."""
    first = tool_turn(srv.client(), extra_body={"session_id": "render-2"})
    (call,) = first.choices[0].message.tool_calls
    tool_message = [{"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    body = {"model": MODEL, "messages": tool_message, "tools": TOOLS, "session_id": "render-2"}
    home = render(srv, "chat/completions", body).json()["token_ids"]
    unknown = {**body, "session_id": "render-unknown"}
    answers = [render(srv, "chat/completions", unknown) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    ids, again = (a.json()["token_ids"] for a in answers)
    assert ids and ids[:2] != home[:2]  # nothing like a rendered conversation
    assert again[:2] != ids[:2]  # fresh each time: an earlier such answer the router remembers matches neither
    # The request itself is refused, as the render of any other error is.
    chat = httpx.post(f"{srv.url}/chat/completions", json={**unknown, "max_tokens": 4}, timeout=60)
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "session_not_found"
    assert render(srv, "chat/completions", {**unknown, "model": "other"}).status_code == 404


def test_completions_render_each_prompt(srv, tokenizer):
    rendered = render(srv, "completions", {"model": MODEL, "prompt": ["Hello there", "Bye"]})
    assert rendered.status_code == 200
    assert [r["token_ids"] for r in rendered.json()] == [tokenizer.encode("Hello there"), tokenizer.encode("Bye")]


def test_render_refuses_what_the_request_would_be_refused_for(srv):
    assert render(srv, "chat/completions", {"model": "other", "messages": QUESTION}).status_code == 404
    assert render(srv, "chat/completions", {"model": MODEL, "messages": []}).status_code == 400
    assert render(srv, "completions", {"model": MODEL, "prompt": []}).status_code == 400


def tokenize(srv, body: dict, path: str = "tokenize") -> httpx.Response:
    return httpx.post(f"{srv.base}/{path}", json=body, timeout=60)


# Two arguments, both required: a forced call writes both, and a client may send them back in another order.
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}]


def test_tokenize_a_conversation_gives_the_ids_it_is_served_with_its_paused_turn_as_generated(srv, tokenizer):
    """The ids of the first turn's prompt are its served prompt's; those of the conversation sent back with
    the tool result hold the paused call as the very tokens generated (here the client reorders the
    arguments: their text rendered again would be other tokens), and are what the resume is served with."""
    body = {"messages": QUESTION, "tools": WEATHER}  # no model: the served one, as vLLM allows
    tokens = tokenize(srv, body)
    assert tokens.status_code == 200, tokens.text
    first = srv.client().chat.completions.create(messages=QUESTION, tools=WEATHER, tool_choice="required",
                                                 max_tokens=CALL_TOKENS, extra_body={"return_token_ids": True},
                                                 **greedy())
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0].message
    prompt_ids, call_ids = first.prompt_token_ids, first.choices[0].token_ids
    got = tokens.json()
    assert got == {"count": len(got["tokens"]), "max_model_len": srv.backend.info.max_model_len,
                   "tokens": prompt_ids[:len(got["tokens"])], "token_strs": None}
    # The forced call's prompt goes on with the call's opening (the tokenized request forces none).
    assert tokenizer.decode(prompt_ids[got["count"]:]).startswith("<tool_call>")
    (call,) = first.choices[0].message.tool_calls
    message = first.choices[0].message.model_dump(exclude_none=True)
    reordered = dict(reversed(json.loads(call.function.arguments).items()))
    message["tool_calls"][0]["function"]["arguments"] = json.dumps(reordered)
    resumed = QUESTION + [message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    ids = tokenize(srv, {**body, "model": MODEL, "messages": resumed}).json()["tokens"]
    assert ids[:len(prompt_ids) + len(call_ids)] == prompt_ids + call_ids
    assert ids == render(srv, "chat/completions", {"model": MODEL, **body, "messages": resumed}).json()["token_ids"]
    # Without the generation prompt: the conversation alone, up to the tool result.
    history = tokenize(srv, {**body, "messages": resumed, "add_generation_prompt": False}).json()["tokens"]
    assert ids[:len(history)] == history and tokenizer.decode(ids[len(history):]).strip() == "<|im_start|>assistant"
    second = srv.client().chat.completions.create(messages=resumed, tools=WEATHER, max_tokens=4, **greedy(),
                                                  extra_body={"return_token_ids": True})
    assert second.prompt_token_ids == ids
    assert second.usage.prompt_tokens_details.cached_tokens >= len(prompt_ids) + len(call_ids) - 1


def test_tokenize_a_prompt_and_detokenize_ids(srv, tokenizer):
    text = "Hello there, how are you?"
    got = tokenize(srv, {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    # As /v1/completions encodes it: the served prompt's ids.
    rendered = render(srv, "completions", {"model": MODEL, "prompt": text}).json()
    assert rendered[0]["token_ids"] == got["tokens"]
    back = tokenize(srv, {"tokens": got["tokens"]}, "detokenize")
    assert back.status_code == 200 and back.json() == {"prompt": text}
    # A prompt longer than the context is counted, not refused: the count is what the client asks for.
    long = tokenize(srv, {"prompt": "word " * (srv.backend.info.max_model_len + 10)}).json()
    assert long["count"] > long["max_model_len"] == srv.backend.info.max_model_len


@pytest.mark.parametrize("body, param", [
    ({"model": "other", "prompt": "Hi"}, "model"),
    ({"prompt": "Hi", "messages": QUESTION}, None),
    ({}, None),
    ({"prompt": "Hi", "tools": TOOLS}, None),
    ({"messages": QUESTION, "continue_final_message": True}, None),  # with add_generation_prompt (vLLM's 400)
    ({"messages": QUESTION, "continue_final_message": True, "add_generation_prompt": False}, "messages"),
    ({"messages": QUESTION, "add_special_tokens": True}, "add_special_tokens"),
    ({"messages": QUESTION, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": []}, "messages"),
    ({"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": QUESTION, "temperature": 0}, "temperature"),
])
def test_tokenize_refuses_bad_bodies_with_the_field_named(srv, body, param):
    answer = tokenize(srv, body)
    assert answer.status_code == (404 if param == "model" else 400), answer.text
    assert answer.json()["error"]["param"] == param, answer.json()


@pytest.mark.parametrize("body", [{"tokens": [10**6]}, {"tokens": [-1]}, {"tokens": [1], "model": "other"}, {}])
def test_detokenize_refuses_ids_outside_the_vocabulary(srv, body):
    answer = tokenize(srv, body, "detokenize")
    assert answer.status_code == (404 if "model" in body else 400), answer.text
