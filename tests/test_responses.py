"""POST/GET/DELETE /v1/responses against the live server, driven by the official `openai` SDK: a chained
step resumes the paused generation (cached input ≥ 90%), streams follow the official event order, stored
responses are bounded and expire, errors have OpenAI's shape, and the Responses example runs."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from infercept.server.app import build_app
from infercept.server.chat import Message
from infercept.server.conversations import ConversationStore, Kind
from infercept.server.settings import ConversationPolicy, ServerSettings
from live_server import MODEL

TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
QUESTION = "What is the weather in Paris?"
RESULT = '{"temperature": 21, "sky": "clear"}'
GREEDY = dict(model=MODEL, temperature=0)
ROOT = Path(__file__).resolve().parents[1]


def call_step(client: openai.OpenAI, **kw):
    first = client.responses.create(input=QUESTION, tools=TOOLS, max_output_tokens=40, **GREEDY, **kw)
    assert first.status == "completed", first
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    return first, call


def assert_resumed(usage) -> None:
    assert usage.input_tokens_details.cached_tokens >= 0.9 * usage.input_tokens, usage


def test_chain_by_previous_response_id_resumes(srv):
    client = srv.client()
    first, call = call_step(client)
    assert first.id.startswith("resp_")
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    state = srv.assert_no_leak()
    assert list(state["requests"].values()) == ["intercepted"]  # paused, not finished

    second = client.responses.create(previous_response_id=first.id, tools=TOOLS, max_output_tokens=10, **GREEDY,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert second.previous_response_id == first.id and second.output_text
    assert second.status in ("completed", "incomplete")
    assert_resumed(second.usage)
    # The whole paused context was reused but its last token (sampled, never fed back).
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1

    # A third step chains onto the second: its conversation carries both earlier turns (tools, as in
    # OpenAI's API, are not carried over: they are sent again).
    third = client.responses.create(previous_response_id=second.id, input="Thanks!", tools=TOOLS,
                                    max_output_tokens=4, **GREEDY)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    srv.assert_no_leak()


def test_input_items_list_the_chain_items_paged(srv):
    """GET /v1/responses/{id}/input_items: the chain's items (the earlier inputs and outputs), then the
    request's own, each with an id, in the SDK's types; newest first unless asked, cursor-paged."""
    client = srv.client()
    first, call = call_step(client, instructions="Answer briefly.")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    second = client.responses.create(previous_response_id=first.id, input=[output], tools=TOOLS,
                                     max_output_tokens=4, **GREEDY)
    items = list(client.responses.input_items.list(second.id, order="asc", limit=1))  # (pages of 1, followed)
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
    assert items[0].role == "user" and items[0].content[0].text == QUESTION  # (instructions are no item)
    assert items[1].id == call.id and items[1].arguments == call.arguments
    assert items[2].call_id == call.call_id and items[2].output == RESULT and items[2].id.startswith("fco_")
    assert [item.id for item in client.responses.input_items.list(first.id)] == [items[0].id]
    newest = client.responses.input_items.list(second.id, limit=2)
    assert [item.id for item in newest.data] == [items[2].id, items[1].id] and newest.has_more
    after = client.responses.input_items.list(second.id, limit=2, after=items[1].id)
    assert [item.id for item in after.data] == [items[0].id] and not after.has_more

    with pytest.raises(openai.BadRequestError, match="after"):
        client.responses.input_items.list(second.id, after="msg_nope")
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.responses.input_items.list(second.id, limit=101)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    unstored = client.responses.create(input="Hi.", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)
    srv.assert_no_leak()


def test_item_references_name_stored_items_and_resume(srv):
    """`item_reference` input items (what the AI SDK's OpenAI provider sends for earlier output it got with
    `store`) are replaced by the stored items they name, so a client resending its history by reference
    resumes the paused generation as one resending the items themselves does."""
    client = srv.client()
    first, call = call_step(client)
    items = [{"role": "user", "content": QUESTION}, {"type": "item_reference", "id": call.id},
             {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    second = client.responses.create(input=items, tools=TOOLS, max_output_tokens=6, **GREEDY)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1
    listed = list(client.responses.input_items.list(second.id, order="asc"))
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    assert listed[1].id == call.id and listed[1].call_id == call.call_id and listed[1].arguments == call.arguments

    answer = second.output[-1]  # (an assistant message, referenced by id without its type, as OpenAI allows)
    third = client.responses.create(input=[*items, {"id": answer.id}, {"role": "user", "content": "Thanks!"}],
                                    tools=TOOLS, max_output_tokens=2, **GREEDY)
    assert [item.type for item in client.responses.input_items.list(third.id, order="asc")][3] == "message"
    assert third.usage.input_tokens > second.usage.input_tokens

    with pytest.raises(openai.BadRequestError) as unknown:
        client.responses.create(input=[{"type": "item_reference", "id": "msg_nope"}], **GREEDY)
    assert unknown.value.body["param"] == "input[0]"
    with pytest.raises(openai.BadRequestError, match="Duplicate item"):  # (the chain continued has it already)
        client.responses.create(previous_response_id=first.id, tools=TOOLS, **GREEDY, input=[
            {"type": "item_reference", "id": call.id},
            {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    srv.assert_no_leak()


def test_stateless_items_resume_and_store_false(srv):
    client = srv.client()
    first, call = call_step(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # The client resends everything itself: the function_call item as returned, then its output.
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
    second = client.responses.create(input=items, tools=TOOLS, max_output_tokens=6, store=False, **GREEDY)
    assert_resumed(second.usage)
    srv.assert_no_leak()


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_streamed_events_follow_the_official_order(srv):
    client = srv.client()
    events = events_of(client.responses.create(input="Say hello.", max_output_tokens=6, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"])
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text and final.usage.output_tokens <= 6
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert client.responses.retrieve(final.id).output_text == text

    # A function call: its item, argument deltas, arguments done, item done, then completed.
    events = events_of(client.responses.create(input=QUESTION, tools=TOOLS, max_output_tokens=40, stream=True,
                                               **GREEDY))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.function_call_arguments.delta"] * deltas
                     + ["response.function_call_arguments.done", "response.output_item.done", "response.completed"])
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = events[-1].response.output
    assert json.loads(arguments) == {"city": "Paris"} == json.loads(call.arguments)
    assert events[2].item.id == events[-2].item.id == call.id and events[2].item.status == "in_progress"

    # The streamed response chains like any other; the resumed step streams too.
    async def resume():
        stream = await srv.async_client().responses.create(
            previous_response_id=events[-1].response.id, tools=TOOLS, max_output_tokens=6, stream=True, **GREEDY,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
        return [e async for e in stream]

    last = asyncio.run(resume())[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert_resumed(last.response.usage)
    srv.assert_no_leak()


def test_delete_releases_the_paused_generation(srv):
    client = srv.client()
    first, _ = call_step(client)
    assert len(srv.app.state.conversations.paused()) == 1
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    assert len(srv.app.state.conversations.paused()) == 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    srv.assert_no_leak()
    assert srv.engine_state()["requests"] == {}


BAD = [
    ("unknown field", {"model": MODEL, "input": "hi", "frobnicate": 1}, 400),
    ("unsupported item type", {"model": MODEL, "input": [{"type": "reasoning", "summary": []}]}, 400),
    ("image part", {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400),
    ("non-function tool", {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}, 400),
    ("empty input", {"model": MODEL, "input": []}, 400),
    ("output for a call never made", {"model": MODEL, "input": [
        {"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, 400),
    ("unknown model", {"model": "gpt-9", "input": "hi"}, 404),
    ("unknown previous response", {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"}, 404),
    ("stop token id out of range", {"model": MODEL, "input": "hi", "stop_token_ids": [10 ** 9]}, 400),
    ("empty cache salt", {"model": MODEL, "input": "hi", "cache_salt": ""}, 400),
    ("top_k below -1", {"model": MODEL, "input": "hi", "top_k": -2}, 400),
]


def test_bad_input_is_4xx_in_openai_shape(srv):
    failures = []
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for name, body, status in BAD:
            r = http.post("/responses", json=body)
            error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
            if r.status_code != status or not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
                failures.append((name, r.status_code, r.text[:200]))
        for method in ("GET", "DELETE"):
            r = http.request(method, "/responses/resp_nope")
            if r.status_code != 404 or r.json()["error"]["code"] != "response_not_found":
                failures.append((method, r.status_code, r.text[:200]))
    assert not failures, failures
    # A chained request that leaves the previous response's calls unanswered is refused.
    client = srv.client()
    first, _ = call_step(client)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(previous_response_id=first.id, input="and tomorrow?", **GREEDY)
    srv.assert_no_leak()


def test_vllms_sampling_fields_mean_what_they_mean_on_chat_completions(srv):
    """vLLM's Responses extras, as on Chat Completions: `stop` (and `include_stop_str_in_output`) ends the
    text where the same request's greedy text has the stop string, `top_k` 1 samples greedily, a `seed`
    draws the same text twice, `cache_salt` keeps the prompt's cached blocks apart, and
    `chat_template_kwargs` reaches the chat template (a name the server sets itself is refused)."""
    client = srv.client()
    ask = dict(input="Name four colours of the rainbow, separated by commas.", max_output_tokens=16)
    full = client.responses.create(**ask, **GREEDY)
    text = full.output_text
    stop = text.split(",")[1] + ","
    cut = text.index(stop)
    assert client.responses.create(**ask, **GREEDY, extra_body={"stop": [stop]}).output_text == text[:cut]
    kept = client.responses.create(**ask, **GREEDY, extra_body={"stop": [stop], "include_stop_str_in_output": True})
    assert kept.output_text == text[:cut + len(stop)]
    assert client.responses.create(**ask, model=MODEL, temperature=1, extra_body={"top_k": 1}).output_text == text
    seeded = [client.responses.create(**ask, model=MODEL, temperature=1, extra_body={"seed": 7}).output_text
              for _ in range(2)]
    assert seeded[0] == seeded[1]

    def cached(**extra) -> int:
        return client.responses.create(**ask, **GREEDY, extra_body=extra).usage.input_tokens_details.cached_tokens

    assert cached() > 16
    assert cached(cache_salt="responses-salt") == 0 and cached(cache_salt="responses-salt") > 16
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**ask, **GREEDY, extra_body={"chat_template_kwargs": {"tools": []}})
    assert refused.value.body["param"] == "chat_template_kwargs"
    srv.assert_no_leak()


def test_output_text_logprobs_are_chat_completions_logprobs(srv):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the output text carries each of its
    tokens' logprob and most likely alternatives, those Chat Completions gives the same conversation; a
    stream's deltas carry their own tokens', its done event and the response all of them."""
    client = srv.client()
    ask = dict(input="Name three colours.", max_output_tokens=6, **GREEDY)
    wanted = dict(top_logprobs=2, include=["message.output_text.logprobs"])
    whole = client.responses.create(**ask, **wanted)
    (item,) = whole.output
    (text,) = item.content
    assert whole.status == "incomplete"  # (the length limit: no EOS among its tokens)
    assert "".join(lp.token for lp in text.logprobs) == text.text
    assert all(len(lp.top_logprobs) == 2 and lp.bytes == list(lp.token.encode()) for lp in text.logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask["input"]}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    expected = chat.choices[0].logprobs.content
    assert [lp.token for lp in text.logprobs] == [lp.token for lp in expected]
    assert [lp.logprob for lp in text.logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    assert [[a.token for a in lp.top_logprobs] for lp in text.logprobs] == \
        [[a.token for a in lp.top_logprobs] for lp in expected]

    events = list(client.responses.create(**ask, **wanted, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response.output[0].content[0]
    assert [lp.token for d in deltas for lp in d.logprobs] == [lp.token for lp in done.logprobs] == \
        [lp.token for lp in final.logprobs] == [lp.token for lp in text.logprobs]
    assert all(len(lp.top_logprobs) == 2 for lp in done.logprobs)
    assert client.responses.create(**ask).output[0].content[0].logprobs == []  # not included: none


def test_stored_responses_are_bounded_and_expire(srv):
    """A second app on the running engine, over ASGI: at most 2 stored responses, each for 60 s of its
    store's clock (moved by hand)."""
    app = build_app(srv.backend, ServerSettings(served_model_name=MODEL, conversations=ConversationPolicy(
        max_stored_responses=2, response_ttl=60)))
    clock = [0.0]
    app.state.conversations.clock = lambda: clock[0]

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app/v1") as http:
            ids = []
            for word in ("one", "two", "three"):
                r = await http.post("/responses", json={"input": word, "max_output_tokens": 1, **GREEDY})
                assert r.status_code == 200
                ids.append(r.json()["id"])
                clock[0] += 1
            codes = [(await http.get(f"/responses/{i}")).status_code for i in ids]
            assert codes == [404, 200, 200]  # the oldest went first
            clock[0] = 61.5  # "two" was stored at 1, "three" at 2
            assert [(await http.get(f"/responses/{i}")).status_code for i in ids] == [404, 404, 200]

    asyncio.run(run())
    srv.assert_no_leak()


def test_response_store_ttl_and_limit_on_a_clock():
    clock = [0.0]
    store = ConversationStore(ConversationPolicy(response_ttl=10, max_stored_responses=2), lambda *_: None,
                              clock=lambda: clock[0])
    for i in range(3):
        clock[0] = i
        store.store_response(f"r{i}", {"id": f"r{i}", "output": []}, (Message("user", str(i)),), request_id=f"req{i}")
    assert store.response("r0") is None and store.response("r1").body["id"] == "r1" and len(store._responses) == 2
    clock[0] = 11.5  # r1 (created at 1) is past the TTL, r2 (at 2) is not
    assert store.response("r1") is None and store.response("r2") is not None
    store.close(store.response("r2"))
    assert store.response("r2") is None and len(store._responses) == 0


def test_item_references_find_the_newest_record_keeping_the_item_of_its_owner():
    """The store's item index (what an `item_reference` names), kept in step with what the records keep:
    a response's output and input items, a conversation's edited items, and none after a record goes."""
    clock = [0.0]
    store = ConversationStore(ConversationPolicy(response_ttl=10, max_stored_responses=2), lambda *_: None,
                              clock=lambda: clock[0])
    said = {"id": "msg_q", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    answer = {"id": "msg_a", "type": "message", "role": "assistant", "content": []}
    conversation = (Message("user", "hi"), Message("assistant", "hello"))
    store.store_response("r0", {"id": "r0", "output": [answer]}, conversation, "req0", owner="alice", items=[said])
    assert store.item("msg_a", "alice") is answer and store.item("msg_q", "alice") is said
    assert store.item("msg_a", "bob") is None and store.holds(Kind.ITEM, "msg_a")  # (any tenant's counts there)
    edited = {**said, "content": [{"type": "input_text", "text": "hi again"}]}
    clock[0] = 1
    conv = store.open_conversation("conv_1", {"id": "conv_1"}, owner="alice")
    store.keep_items(conv, [edited], conversation[:1])
    assert store.item("msg_q", "alice") is edited  # the newest record keeping it
    store.keep_items(conv, [], ())  # its item deleted: the response's is found again
    assert store.item("msg_q", "alice") is said and conv.items == [] and conv.messages == ()
    store.keep_items(conv, [edited], conversation[:1])
    store.close(conv)
    assert store.item("msg_q", "alice") is said
    clock[0] = 10.5  # r0 (stored at 0) is past the TTL: nothing keeps its items
    assert store.item("msg_a", "alice") is None and not store.holds(Kind.ITEM, "msg_q") and not store._item_holders
    store.store_response("r1", {"id": "r1", "output": [answer]}, conversation, "req1", owner="alice")
    store.store_response("r2", {"id": "r2", "output": []}, conversation, "req2", owner="alice")
    store.store_response("r3", {"id": "r3", "output": []}, conversation, "req3", owner="alice")
    assert store.item("msg_a", "alice") is None  # r1 went over the stored-response limit


def test_responses_chain_example_runs(srv):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "responses_chain.py"), "--base-url", srv.base,
                          "--max-steps", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step 1:") and "calls get_weather" in lines[0]
    assert lines[1].startswith("step 2:") and int(lines[1].split("(")[1].split("%")[0]) >= 90, out.stdout
    srv.abort_paused()  # the example may stop at a paused step
    srv.assert_no_leak()
