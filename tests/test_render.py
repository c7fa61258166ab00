"""vLLM's render routes on the live server: the prompt token ids a request would be served with.

A router that routes by token prefix (vllm-router's cache_aware policy, docs/replicas.md) asks each
replica for them and sends a request where the longest prefix of its ids went before; a resume reaches
the replica holding its pause only if the ids it renders to extend those of the turn that paused."""
from __future__ import annotations

import httpx

from live_server import MODEL
from test_server import QUESTION, RESULT, TOOLS, greedy, tool_turn


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
