"""OpenAI's Conversations API (/v1/conversations and its items) against the live server, driven by the
official `openai` SDK: items are kept, listed and paged in the SDK's types; a response in a conversation
continues its items and adds its own; one that ends in a function call leaves its generation paused,
held by the conversation, and the response that brings the call's output resumes it (as its input, or
added to the conversation first); errors have OpenAI's shape."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from live_server import resumes
from test_responses import GREEDY, QUESTION, RESULT, ROOT, TOOLS  # (the same weather step)


def held_by(srv, conversation_id: str) -> list[str]:
    """The request ids of the paused generations the conversation holds."""
    store = srv.app.state.conversations
    record = store.conversation(conversation_id)
    return [record.paused.request_id] if record is not None and record.paused is not None else []


def output_of(call) -> dict:
    return {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}


def test_items_are_kept_listed_paged_and_deleted(srv):
    client = srv.client()
    conv = client.conversations.create(metadata={"topic": "weather"}, items=[
        {"type": "message", "role": "user", "content": "Hello!"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]}])
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "weather"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    added = client.conversations.items.create(conv.id, items=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": RESULT}])
    assert [item.type for item in added.data] == ["message", "function_call", "function_call_output"]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id and not added.has_more

    everything = list(client.conversations.items.list(conv.id, order="asc", limit=2))  # (pages of 2, followed)
    assert [item.type for item in everything] == ["message"] * 3 + ["function_call", "function_call_output"]
    assert [item.content[0].text for item in everything[:3]] == ["Hello!", "Hi.", QUESTION]
    assert [item.content[0].type for item in everything[:3]] == ["input_text", "output_text", "input_text"]
    assert everything[3].call_id == everything[4].call_id == "call_1"
    assert len({item.id for item in everything}) == 5
    newest = client.conversations.items.list(conv.id, limit=2)
    assert [item.id for item in newest.data] == [everything[4].id, everything[3].id] and newest.has_more

    assert client.conversations.items.retrieve(everything[1].id, conversation_id=conv.id).content[0].text == "Hi."
    assert client.conversations.items.delete(everything[1].id, conversation_id=conv.id).id == conv.id
    assert [item.id for item in client.conversations.items.list(conv.id, order="asc")] == \
        [everything[k].id for k in (0, 2, 3, 4)]
    assert client.conversations.update(conv.id, metadata={"topic": "rain"}).metadata == {"topic": "rain"}
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_a_response_in_a_conversation_resumes_its_paused_generation(srv):
    client = srv.client()
    conv = client.conversations.create()
    first = client.responses.create(conversation=conv.id, input=QUESTION, tools=TOOLS, max_output_tokens=40, **GREEDY)
    assert first.conversation.id == conv.id
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert held_by(srv, conv.id)  # the conversation holds the paused generation
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [item.type for item in items] == ["message", "function_call"] and items[1].id == call.id

    before = resumes(srv.url, "explicit")
    second = client.responses.create(conversation=conv.id, input=[output_of(call)], tools=TOOLS,
                                     max_output_tokens=8, **GREEDY)
    assert resumes(srv.url, "explicit") == before + 1
    # The whole paused context was reused but its last token (sampled, never fed back).
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [item.type for item in items] == ["message", "function_call", "function_call_output", "message"]
    assert items[3].content[0].text == second.output_text and second.output_text

    # The next turn carries the whole conversation (tools, as in OpenAI's API, are sent again).
    third = client.responses.create(conversation=conv.id, input="Thanks!", tools=TOOLS, max_output_tokens=4,
                                    **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert len(client.conversations.items.list(conv.id).data) == 6
    srv.assert_no_leak()


def test_the_calls_output_added_to_the_conversation_resumes_too(srv):
    client = srv.client()
    conv = client.conversations.create(items=[{"role": "user", "content": QUESTION}])
    first = client.responses.create(conversation={"id": conv.id}, tools=TOOLS, max_output_tokens=40, **GREEDY)
    (call,) = first.output
    client.conversations.items.create(conv.id, items=[output_of(call)])
    before = resumes(srv.url, "explicit")
    second = client.responses.create(conversation=conv.id, input=[], tools=TOOLS, max_output_tokens=6, **GREEDY)
    assert resumes(srv.url, "explicit") == before + 1
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1
    srv.assert_no_leak()


def test_editing_the_history_releases_the_paused_generation(srv):
    client = srv.client()
    conv = client.conversations.create()
    first = client.responses.create(conversation=conv.id, input=QUESTION, tools=TOOLS, max_output_tokens=40, **GREEDY)
    assert held_by(srv, conv.id)
    client.conversations.items.delete(first.output[0].id, conversation_id=conv.id)
    assert not held_by(srv, conv.id) and srv.assert_no_leak()["requests"] == {}

    client.responses.create(conversation=conv.id, input=QUESTION, tools=TOOLS, max_output_tokens=40, **GREEDY)
    assert held_by(srv, conv.id)
    client.conversations.delete(conv.id)  # deleting the conversation lets its paused generation go too
    assert srv.assert_no_leak()["requests"] == {}


def test_one_response_at_a_time_in_a_conversation(srv):
    client = srv.client()
    conv = client.conversations.create()
    with client.responses.create(conversation=conv.id, input="Say hello.", max_output_tokens=6, stream=True,
                                 **GREEDY) as stream:
        with pytest.raises(openai.ConflictError) as busy:
            client.responses.create(conversation=conv.id, input="Hi", max_output_tokens=2, **GREEDY)
        assert busy.value.body["code"] == "conversation_locked"
        with pytest.raises(openai.ConflictError):
            client.conversations.items.create(conv.id, items=[{"role": "user", "content": "Hi"}])
        final = [event for event in stream][-1].response
    assert final.conversation.id == conv.id
    assert [item.type for item in client.conversations.items.list(conv.id, order="asc")] == ["message", "message"]


def test_bad_requests_are_4xx_in_openai_shape(srv):
    client = srv.client()
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(conversation="conv_nope", input="Hi", **GREEDY)
    assert unknown.value.body["code"] == "conversation_not_found"
    conv = client.conversations.create()
    first = client.responses.create(input="Hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError) as both:
        client.responses.create(conversation=conv.id, previous_response_id=first.id, input="Hi", **GREEDY)
    assert both.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as kept:  # (the responses that make them add MCP items)
        client.conversations.items.create(conv.id, items=[{"type": "mcp_list_tools", "server_label": "x"}])
    assert kept.value.body["param"] == "items[0]"
    with pytest.raises(openai.BadRequestError) as not_an_item:
        client.conversations.items.create(conv.id, items=[{"type": "function_call", "name": "f"}])
    assert not_an_item.value.body["param"] == "items[0]"
    with pytest.raises(openai.BadRequestError):
        client.conversations.create(items=[{"role": "user", "content": "Hi"}] * 21)
    with pytest.raises(openai.BadRequestError) as limit:
        client.conversations.items.list(conv.id, limit=101)
    assert limit.value.body["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve("msg_nope", conversation_id=conv.id)
    assert list(client.conversations.items.list(conv.id)) == []  # nothing was added by the failed requests


def test_conversations_are_kept_response_ttl_after_their_last_use_and_bounded():
    from infercept.server.conversations import ConversationStore, State
    from infercept.server.protocol import APIError
    from infercept.server.settings import ConversationPolicy

    clock = [0.0]
    store = ConversationStore(ConversationPolicy(response_ttl=10, max_conversations=2), lambda *_: None,
                              clock=lambda: clock[0])
    first, second = (store.open_conversation(f"conv_{i}", {"id": f"conv_{i}"}) for i in (1, 2))
    clock[0] = 5.0
    assert store.conversation("conv_1") is first  # used: the least recently used is now conv_2
    store.open_conversation("conv_3", {})
    assert store.conversation("conv_2") is None and second.state is State.CLOSED
    clock[0] = 8.0
    assert store.conversation("conv_1") is first
    clock[0] = 15.5  # conv_3 created at 5 and unused since, conv_1 last used at 8
    assert store.conversation("conv_3") is None and store.conversation("conv_1") is first
    assert store.conversation("conv_1", owner="another tenant") is None  # (another tenant's is none of its business)
    first.state = State.GENERATING  # a conversation with a response in progress is neither reaped nor evicted
    clock[0] = 30.0
    store.expire()
    assert store._conversations == {"conv_1": first}
    store.open_conversation("conv_4", {}).state = State.GENERATING
    with pytest.raises(APIError) as full:  # (every one generating)
        store.open_conversation("conv_5", {})
    assert full.value.status == 429


def test_the_responses_example_runs_in_a_conversation(srv):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "responses_chain.py"), "--base-url", srv.base,
                          "--max-steps", "2", "--conversation"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step 1:") and "calls get_weather" in lines[0]
    assert lines[1].startswith("step 2:") and int(lines[1].split("(")[1].split("%")[0]) >= 90, out.stdout
    assert lines[2].endswith(": message, function_call, function_call_output, message"), out.stdout
    srv.abort_paused()
    srv.assert_no_leak()
