"""The Responses API's MCP tools on the real model, driven by the official `openai` SDK: the server lists an
MCP server's tools, runs the model's call while the generation waits paused in the engine and resumes
that same generation with the result, all in one `responses.create`; approvals keep the generation
paused across requests; failures are `mcp_call.error` items or 4xx, never 5xx.

MCP servers are real (tests/mcp_calc_server.py, the official SDK's MCPServer): "calc" configured by the
operator (stdio), and the same server over streamable HTTP named per request by `server_url`. A second
app runs on the shared engine (the `server` fixture's: the model loads once) with those MCP settings;
its backend is spied on to see each generate and resume. The tiny model does not call tools on its own
reliably: tool_choice forces the call (the grammar writes it), and `max_tool_calls=1` makes the turn
after it answer in text.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from live_server import MODEL, serve_in_thread
from test_mcp_tools import CALC_SERVER, _free_port, http_mcp  # noqa: F401 (http_mcp: a fixture, the calc server over HTTP)

from infercept.server.app import build_app
from infercept.server.mcp_config import McpServerConfig
from infercept.server.settings import McpSettings, ServerSettings

TIMEOUT_S = 5.0  # --mcp-timeout of the app under test: the stdio server takes seconds to start on a busy machine
QUESTION = "What is 6 times 7? Use the multiply tool."
GREEDY = dict(model=MODEL, temperature=0, max_output_tokens=32)  # a forced call takes ~20 tokens


class SpiedBackend:
    """The shared engine's backend, its lifespan calls ignored (the shared server owns the engine), every
    generate and resume recorded with the context it paused at and the tokens each resumed turn reused."""

    def __init__(self, backend):
        self._backend = backend
        self.calls: list[tuple] = []  # ("generate", id, paused context) / ("resume", id, cached tokens)

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    async def generate(self, prompt, params, request_id, intercept=None):
        async for out in self._backend.generate(prompt, params, request_id, intercept):
            if out.turn_done:  # (its consumer stops reading at the turn's end)
                self.calls.append(("generate", request_id, len(prompt) + len(out.token_ids) if out.paused else None))
            yield out

    async def resume(self, request_id, appended, params=None, intercept=None):
        first = True
        async for out in self._backend.resume(request_id, appended, params, intercept):
            if first:
                self.calls.append(("resume", request_id, out.num_cached_tokens))
                first = False
            yield out


@pytest.fixture(scope="module")
def mcp_app(server, http_mcp):
    backend = SpiedBackend(server.backend)
    settings = ServerSettings(served_model_name=MODEL, mcp=McpSettings(
        servers=(McpServerConfig("calc", command=sys.executable, args=(CALC_SERVER, "stdio")),
                 McpServerConfig("down", url=f"http://127.0.0.1:{_free_port()}/mcp")),
        call_timeout_s=TIMEOUT_S, allow_urls=("http://127.0.0.1:*/mcp",)))
    app = build_app(backend, settings)
    uv, thread, base = serve_in_thread(app)
    yield SimpleNamespace(app=app, backend=backend, base=base, url=base + "/v1")
    uv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def mcp(srv, mcp_app):
    """The MCP app with a fresh spy; afterwards its paused generations are released and nothing leaks."""
    mcp_app.backend.calls.clear()
    mcp_app.client = openai.OpenAI(base_url=mcp_app.url, api_key="unused", max_retries=0, timeout=120)
    yield mcp_app
    mcp_app.app.state.conversations.release_all("ttl", "the test is over")
    srv.assert_no_leak()


def calc_tool(**kw) -> dict:
    return {"type": "mcp", "server_label": "calc", "require_approval": "never", **kw}


def force(tool: str, label: str = "calc") -> dict:
    return {"type": "mcp", "server_label": label, "name": tool}


def assert_resumed_once(calls: list[tuple]) -> int:
    """One generation paused once and resumed once, reusing its whole paused context but the last token
    (sampled, never fed back): no prompt token of the paused context was computed again."""
    (kind, paused_id, context), (kind2, resumed_id, cached) = calls
    assert (kind, kind2) == ("generate", "resume") and paused_id == resumed_id, calls
    assert context is not None and cached == context - 1, calls
    return cached


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_an_mcp_call_runs_while_the_generation_waits_paused(mcp, http_mcp, transport):
    tool = calc_tool() if transport == "stdio" else {
        "type": "mcp", "server_label": "web", "server_url": http_mcp, "require_approval": "never",
        "allowed_tools": ["multiply", "fail"], "headers": {"X-Test": "1"}}
    r = mcp.client.responses.create(input=QUESTION, tools=[tool], tool_choice=force("multiply", tool["server_label"]),
                                    max_tool_calls=1, **GREEDY)
    assert [o.type for o in r.output] == ["mcp_list_tools", "mcp_call", "message"], r.output
    listing, call, answer = r.output
    names = {t.name for t in listing.tools}
    assert names == ({"multiply", "fail"} if transport == "http" else {"multiply", "fail", "hang", "stall", "picture"})
    assert listing.server_label == call.server_label == tool["server_label"] and listing.error is None
    assert call.name == "multiply" and json.loads(call.arguments) == {"a": 6, "b": 7}
    assert call.output == "42" and call.error is None and call.id.startswith("mcp_")
    assert answer.content[0].text and r.status in ("completed", "incomplete")
    cached = assert_resumed_once(mcp.backend.calls)
    assert r.usage.input_tokens_details.cached_tokens >= cached
    stored = mcp.client.responses.retrieve(r.id)
    assert [o.type for o in stored.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert "headers" not in stored.tools[0].model_dump(exclude_none=True)  # credentials are not echoed

    # The chain goes on: the next request does not list the tools again.
    mcp.backend.calls.clear()
    assert len(mcp.app.state.responses.mcp.pool._held) == (transport == "http")  # the request's server is kept
    r2 = mcp.client.responses.create(previous_response_id=r.id, input="Thanks.", tools=[tool], tool_choice="none",
                                     **GREEDY)
    assert [o.type for o in r2.output] == ["message"]
    # Nor the one after: the listing two responses back is still in the context.
    r3 = mcp.client.responses.create(previous_response_id=r2.id, input="Again: 6 times 7?", tools=[tool],
                                     tool_choice=force("multiply", tool["server_label"]), max_tool_calls=1, **GREEDY)
    assert [o.type for o in r3.output] == ["mcp_call", "message"], r3.output


def test_the_answer_after_an_mcp_call_carries_its_tokens_logprobs(mcp):
    """`include: ["message.output_text.logprobs"]` with MCP tools: the message after the call (the resumed
    turn's text) carries each of its tokens' logprob and alternatives, greedy ones the likeliest; a
    stream's deltas carry their own, its done event and the response all of them."""
    ask = dict(input=QUESTION, tools=[calc_tool()], tool_choice=force("multiply"), max_tool_calls=1,
               top_logprobs=2, include=["message.output_text.logprobs"], **GREEDY)
    whole = mcp.client.responses.create(**ask)
    assert [o.type for o in whole.output] == ["mcp_list_tools", "mcp_call", "message"]
    (text,) = whole.output[2].content
    assert text.logprobs and "".join(lp.token for lp in text.logprobs) == text.text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token
               and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob) for lp in text.logprobs)
    mcp.app.state.conversations.release_all("ttl", "next")
    events = list(mcp.client.responses.create(**ask, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response.output[2].content[0]
    assert [lp.token for d in deltas for lp in d.logprobs] == [lp.token for lp in done.logprobs] == \
        [lp.token for lp in final.logprobs] == [lp.token for lp in text.logprobs]


def test_chat_with_server_tools_carries_the_answers_logprobs(mcp):
    """Chat Completions' `server_tools` on the real model: the answer's tokens' logprobs (the last
    turn's), and in a stream each content delta's own; prompt_logprobs are a 400 there."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24,
               logprobs=True, top_logprobs=1, extra_body={"server_tools": ["mcp:calc/multiply"]})
    whole = mcp.client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert content and all(lp.top_logprobs[0].token == lp.token for lp in content)
    mcp.app.state.conversations.release_all("ttl", "next")
    chunks = list(mcp.client.chat.completions.create(**ask, stream=True))
    streamed = [lp.token for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed and "".join(streamed) == text
    with pytest.raises(openai.BadRequestError) as refused:
        mcp.client.chat.completions.create(**{**ask, "extra_body": {**ask["extra_body"], "prompt_logprobs": 1}})
    assert refused.value.body["param"] == "prompt_logprobs"


def test_a_stream_shows_the_listing_the_call_and_the_answer_as_they_happen(mcp):
    events = list(mcp.client.responses.create(input=QUESTION, tools=[calc_tool()], tool_choice=force("multiply"),
                                              max_tool_calls=1, stream=True, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == (
        ["response.created", "response.in_progress",
         "response.output_item.added", "response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
         "response.output_item.done",
         "response.output_item.added", "response.mcp_call_arguments.delta", "response.mcp_call_arguments.done",
         "response.mcp_call.in_progress", "response.mcp_call.completed", "response.output_item.done",
         "response.output_item.added", "response.content_part.added"] + ["response.output_text.delta"] * deltas
        + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
           events[-1].type]), kinds
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [o.type for o in final.output] == ["mcp_list_tools", "mcp_call", "message"]
    assert events[6].item.status == "in_progress" and events[11].item.output == "42" == final.output[1].output
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and final.output[2].id == events[12].item.id
    assert mcp.client.responses.retrieve(final.id).output_text == text
    assert_resumed_once(mcp.backend.calls)

    # An approval request streams as a whole item, and its approval streams the call and the answer.
    tool = calc_tool(require_approval="always")
    events = list(mcp.client.responses.create(input=QUESTION, tools=[tool], tool_choice=force("multiply"),
                                              stream=True, **GREEDY))
    request = events[-1].response.output[-1]
    assert request.type == "mcp_approval_request" and events[-3].item.id == request.id
    events = list(mcp.client.responses.create(previous_response_id=events[-1].response.id, tools=[tool], stream=True,
                                              max_tool_calls=1, **GREEDY, input=[{
                                                  "type": "mcp_approval_response", "approval_request_id": request.id,
                                                  "approve": True}]))
    kinds = [e.type for e in events]
    assert kinds[2:6] == ["response.output_item.added", "response.mcp_call_arguments.done",
                          "response.mcp_call.completed", "response.output_item.done"], kinds
    assert [o.type for o in events[-1].response.output] == ["mcp_call", "message"]


def test_an_mcp_response_runs_in_the_background(mcp):
    """Background, the listing, the call (run while the generation waits paused) and the answer are the
    response's as they are a synchronous one's; its events stream again afterwards."""
    queued = mcp.client.responses.create(input=QUESTION, tools=[calc_tool()], tool_choice=force("multiply"),
                                         max_tool_calls=1, background=True, **GREEDY)
    assert queued.status in ("queued", "in_progress") and "headers" not in queued.tools[0].model_dump(exclude_none=True)
    deadline = time.monotonic() + 120
    while (r := mcp.client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert [o.type for o in r.output] == ["mcp_list_tools", "mcp_call", "message"] and r.output[1].output == "42"
    assert_resumed_once(mcp.backend.calls)
    events = list(mcp.client.responses.retrieve(r.id, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and "response.mcp_call.completed" in kinds, kinds
    assert events[-1].response.output_text == r.output_text


def test_approval_runs_the_call_and_resumes_the_same_generation(mcp):
    tool = calc_tool(require_approval="always")
    first = mcp.client.responses.create(input=QUESTION, tools=[tool], tool_choice=force("multiply"), **GREEDY)
    assert [o.type for o in first.output] == ["mcp_list_tools", "mcp_approval_request"], first.output
    request = first.output[1]
    assert request.name == "multiply" and request.server_label == "calc" and request.id.startswith("mcpr_")
    assert json.loads(request.arguments) == {"a": 6, "b": 7}
    (paused,) = mcp.app.state.conversations.paused()  # the generation waits in the engine for the approval

    second = mcp.client.responses.create(previous_response_id=first.id, tools=[tool], max_tool_calls=1, **GREEDY,
                                         input=[{"type": "mcp_approval_response", "approval_request_id": request.id,
                                                 "approve": True}])
    assert [o.type for o in second.output] == ["mcp_call", "message"], second.output
    call = second.output[0]
    assert call.output == "42" and call.approval_request_id == request.id and call.name == "multiply"
    assert assert_resumed_once(mcp.backend.calls) == len(paused.token_ids) - 1
    assert mcp.backend.calls[0][1] == paused.request_id
    # Its input items: the question, the first response's listing and approval request, the approval.
    items = list(mcp.client.responses.input_items.list(second.id, order="asc"))
    assert [i.type for i in items] == ["message", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response"]
    assert items[2].id == request.id and items[3].approval_request_id == request.id and items[3].approve
    assert items[1].tools[0].name == "multiply"

    # An approval answered once is not waiting any more.
    with pytest.raises(openai.BadRequestError, match="approval_request_id"):
        mcp.client.responses.create(previous_response_id=first.id, tools=[tool], **GREEDY, input=[
            {"type": "mcp_approval_response", "approval_request_id": "mcpr_nope", "approve": True}])


def test_mcp_tools_in_a_conversation_keep_their_items_and_resume(mcp):
    """In a conversation (/v1/conversations) the MCP exchange is the conversation's: its items are kept, a
    call asking for approval leaves the generation paused, held by the conversation, and the response that
    brings the approval resumes it. The kept items make the messages the turns had (those the stored
    responses keep), so the conversation goes on from them."""
    client, store = mcp.client, mcp.app.state.conversations
    conv = client.conversations.create()
    ran = client.responses.create(conversation=conv.id, input=QUESTION, tools=[calc_tool()], max_tool_calls=1,
                                  tool_choice=force("multiply"), **GREEDY)
    assert [o.type for o in ran.output] == ["mcp_list_tools", "mcp_call", "message"], ran.output
    assert ran.conversation.id == conv.id and ran.output[1].output == "42"
    record = store.conversation(conv.id)
    assert record.messages == store.response(ran.id).messages  # (a tool message with the call's result)
    assert [i.type for i in client.conversations.items.list(conv.id, order="asc")] == [
        "message", "mcp_list_tools", "mcp_call", "message"]

    tool = calc_tool(require_approval="always")
    mcp.backend.calls.clear()
    first = client.responses.create(conversation=conv.id, input="And 6 times 8?", tools=[tool],
                                    tool_choice=force("multiply"), **GREEDY)
    assert [o.type for o in first.output] == ["mcp_approval_request"], first.output  # (listed already)
    request = first.output[0]
    assert record.paused is not None and record.messages == store.response(first.id).messages
    second = client.responses.create(conversation=conv.id, tools=[tool], max_tool_calls=1, **GREEDY,
                                     input=[{"type": "mcp_approval_response", "approval_request_id": request.id,
                                             "approve": True}])
    assert [o.type for o in second.output] == ["mcp_call", "message"], second.output
    assert second.output[0].approval_request_id == request.id
    assert_resumed_once(mcp.backend.calls)  # the approval's response resumed the generation the conversation held
    assert record.messages == store.response(second.id).messages
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [i.type for i in items[4:]] == ["message", "mcp_approval_request", "mcp_approval_response", "mcp_call",
                                           "message"]
    assert [i.id for i in client.responses.input_items.list(second.id, order="asc")] == [i.id for i in items[:7]]
    # A response without the MCP tools goes on from the kept items (the calls and results among them).
    plain = dict(input="Thanks!", max_output_tokens=4, model=MODEL, temperature=0)
    third, alone = client.responses.create(conversation=conv.id, **plain), client.responses.create(**plain)
    assert third.usage.input_tokens > alone.usage.input_tokens + 100, (third.usage, alone.usage)
    assert [i.id for i in client.responses.input_items.list(third.id, order="asc")][:-1] == [i.id for i in items]


def test_a_stateless_client_sends_the_items_back_and_still_resumes(mcp):
    """store=false: the client keeps the history, sending the output items back with its approval; the
    approval request's id names the paused call, so the same paused generation resumes."""
    tool = calc_tool(require_approval="always")
    first = mcp.client.responses.create(input=QUESTION, tools=[tool], tool_choice=force("multiply"), store=False,
                                        **GREEDY)
    request = first.output[-1]
    assert request.type == "mcp_approval_request"
    with pytest.raises(openai.NotFoundError):
        mcp.client.responses.retrieve(first.id)
    items = [{"role": "user", "content": QUESTION}, *(o.model_dump(exclude_none=True) for o in first.output),
             {"type": "mcp_approval_response", "approval_request_id": request.id, "approve": True}]
    second = mcp.client.responses.create(input=items, tools=[tool], max_tool_calls=1, store=False, **GREEDY)
    assert [o.type for o in second.output] == ["mcp_call", "message"], second.output  # listed already: not again
    assert second.output[0].output == "42"
    assert_resumed_once(mcp.backend.calls)


def test_arguments_the_tool_refuses_are_an_error_item(mcp):
    """A client sending an approval request back may change its arguments: the server runs what is
    approved, and the tool's refusal of invalid arguments is the call's error (no resume: the call is not
    the one the model made, so the conversation is computed afresh)."""
    items = [{"role": "user", "content": QUESTION},
             {"type": "mcp_approval_request", "id": "mcpr_0123456789abcdef01234567", "server_label": "calc",
              "name": "multiply", "arguments": '{"a": 6}'},
             {"type": "mcp_approval_response", "approval_request_id": "mcpr_0123456789abcdef01234567", "approve": True}]
    r = mcp.client.responses.create(input=items, tools=[calc_tool()], max_tool_calls=1, store=False, **GREEDY)
    assert [o.type for o in r.output] == ["mcp_list_tools", "mcp_call", "message"], r.output
    call = r.output[1]
    error = call.error.model_dump() if hasattr(call.error, "model_dump") else call.error
    assert call.status == "failed" and error["type"] == "mcp_tool_execution_error", error
    assert error["content"][0]["text"].startswith("Error executing tool multiply")
    assert [kind for kind, *_ in mcp.backend.calls] == ["generate"]


def test_a_refused_approval_resumes_with_the_refusal_and_ends_cleanly(mcp):
    tool = calc_tool(require_approval={"always": {"tool_names": ["multiply"]}})
    first = mcp.client.responses.create(input=QUESTION, tools=[tool], tool_choice=force("multiply"), **GREEDY)
    request = first.output[-1]
    assert request.type == "mcp_approval_request"
    second = mcp.client.responses.create(previous_response_id=first.id, tools=[tool], tool_choice="none", **GREEDY,
                                         input=[{"type": "mcp_approval_response", "approval_request_id": request.id,
                                                 "approve": False, "reason": "not today"}])
    assert [o.type for o in second.output] == ["message"] and second.output[0].content[0].text
    assert second.status in ("completed", "incomplete")
    assert_resumed_once(mcp.backend.calls)
    assert not mcp.app.state.conversations.paused()  # it answered: nothing waits


@pytest.mark.parametrize("tool, error", [
    ("fail", {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": "Error executing tool fail"}]}),
    ("stall", {"type": "mcp_protocol_error", "code": -32001,
               "message": f"MCP tool calc/stall gave no result within {TIMEOUT_S:g} s"}),
])
def test_a_failed_call_is_an_error_item_the_model_reads(mcp, tool, error):
    r = mcp.client.responses.create(input="Go.", tools=[calc_tool()], tool_choice=force(tool), max_tool_calls=1,
                                    **GREEDY)
    assert [o.type for o in r.output] == ["mcp_list_tools", "mcp_call", "message"], r.output
    call = r.output[1]
    assert call.output is None and call.status == "failed"
    got = call.error.model_dump() if hasattr(call.error, "model_dump") else call.error
    assert got == error, got
    assert_resumed_once(mcp.backend.calls)


def test_bad_mcp_tools_are_4xx_never_5xx(mcp):
    down = f"http://127.0.0.1:{_free_port()}/mcp"
    with pytest.raises(openai.APIStatusError) as refused:  # allowed, but nothing answers there
        mcp.client.responses.create(input=QUESTION, tools=[{"type": "mcp", "server_label": "gone", "server_url": down}],
                                    **GREEDY)
    assert refused.value.status_code == 424 and "Error retrieving tool list from MCP server: 'gone'" in \
        refused.value.message and "ConnectError" in refused.value.message
    with pytest.raises(openai.APIStatusError) as refused:  # configured, but not connected
        mcp.client.responses.create(input=QUESTION, tools=[{"type": "mcp", "server_label": "down"}], **GREEDY)
    assert refused.value.status_code == 424 and "MCP server: 'down'" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        mcp.client.responses.create(input=QUESTION, tools=[{"type": "mcp", "server_label": "x",
                                                            "server_url": "http://mcp.example.invalid/mcp"}], **GREEDY)
    assert refused.value.body["code"] == "mcp_server_url_not_allowed"
    assert refused.value.body["param"] == "tools[0].server_url"

    bad = [  # (tools, what the message says)
        ([{"type": "mcp"}], "server_label"),
        ([{"type": "mcp", "server_label": "a__b"}], "server_label must be"),
        ([calc_tool(require_approval="sometimes")], "require_approval"),
        ([calc_tool(allowed_tools=5)], "allowed_tools"),
        ([calc_tool(frobnicate=1)], "frobnicate"),
        ([{"type": "mcp", "server_label": "nope"}], "not an MCP server of this server"),
        ([calc_tool(headers={"A": "b"})], "headers and authorization go with a server_url"),
        ([calc_tool(connector_id="connector_gmail")], "connector_id"),
        ([calc_tool(), calc_tool()], "two mcp tools"),
        ([{"type": "mcp", "server_label": "u", "server_url": "http://user@127.0.0.1:1/mcp"}], "user info"),
        ([{"type": "mcp", "server_label": "u", "server_url": "file:///etc/passwd"}], "http://"),
    ]
    failures = []
    with httpx.Client(base_url=mcp.url, timeout=60) as http:
        for tools, says in bad:
            r = http.post("/responses", json={"model": MODEL, "input": "hi", "tools": tools})
            if r.status_code != 400 or says not in r.json()["error"]["message"]:
                failures.append((tools, r.status_code, r.text[:300]))
        for body, says in [({"tools": [calc_tool()], "tool_choice": force("nope")}, "calc/nope"),
                           ({"input": [{"type": "mcp_approval_response", "approval_request_id": "mcpr_x",
                                        "approve": True}], "tools": [calc_tool()]}, "approval_request_id")]:
            r = http.post("/responses", json={"model": MODEL, "input": "hi", **body})
            if r.status_code != 400 or says not in r.json()["error"]["message"]:
                failures.append((body, r.status_code, r.text[:300]))
        assert http.get(mcp.base + "/health").status_code == 200
    assert not failures, failures
    assert mcp.backend.calls == []  # refused before any generation


def test_request_servers_are_kept_per_url_and_headers_for_a_ttl(http_mcp):
    from infercept.server.responses_mcp import McpServerPool, McpUnavailable

    async def run():
        pool = McpServerPool(McpSettings(call_timeout_s=5, tools_ttl_s=1.0, allow_urls=("http://127.0.0.1:*/mcp",)))
        try:
            first = await pool.connection(http_mcp, {})
            assert first.client is not None and "multiply" in first.tools
            assert await pool.connection(http_mcp, {}) is first  # listed once, kept
            other = await pool.connection(http_mcp, {"Authorization": "Bearer b"})
            assert other is not first  # other credentials, another connection
            await asyncio.sleep(1.2)
            again = await pool.connection(http_mcp, {})
            assert again is not first and first.client is None and other.client is None  # unused past the TTL
            with pytest.raises(McpUnavailable, match="ConnectError"):
                await pool.connection(f"http://127.0.0.1:{_free_port()}/mcp", {})
            assert len(pool._held) == 1  # a server that failed is not kept (nor tried again in the background)
        finally:
            await pool.stop()
        assert again.client is None

    asyncio.run(run())


def test_the_allow_url_flag(monkeypatch):
    from infercept.server import cli

    out = subprocess.run([sys.executable, "-m", "infercept.server.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=120, env={**__import__("os").environ, "PYTHONPATH": ":".join(sys.path)})
    assert "--mcp-allow-url PATTERN" in out.stdout, out.stdout + out.stderr
    args = cli.build_parser().parse_args(["serve", "--mcp-allow-url", "https://a/*", "--mcp-allow-url", "http://b/mcp"])
    assert cli.server_settings(args).mcp.allow_urls == ("https://a/*", "http://b/mcp")
    monkeypatch.setenv("INFERCEPT_MCP_ALLOW_URL", "https://c/* https://d/*")
    allowed = cli.server_settings(cli.build_parser().parse_args(["serve"])).mcp.allow_urls
    assert allowed == ("https://c/*", "https://d/*")
