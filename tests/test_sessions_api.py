"""Native sessions (/v1/sessions) against the live server with httpx: the tool loop pauses and resumes
(cached prompt ≥ 90%), state and KV location are reported, 404/409 follow docs/operators.md, streams carry
delta / tool_call / paused / done events, deleting a generating session aborts it, server tools run
inside the server, and the walk-through example runs."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from infercept.server.app import build_app
from infercept.server.conversations import ConversationStore, Kind, Paused, State
from infercept.server.protocol import APIError
from infercept.server.settings import ConversationPolicy, ServerSettings
from live_server import MODEL

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]
QUESTION = "What is the weather in Paris?"
RESULT = '{"temperature": 21, "sky": "clear"}'
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client


def sse(response: httpx.Response) -> list[tuple[str, dict]]:
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[len("data: "):])))
    return events


def create(http: httpx.Client, **body) -> str:
    r = http.post("/sessions", json={"tools": TOOLS, "temperature": 0, "max_tokens": 40, **body})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "idle" and r.json()["tools"] == [t["function"]["name"] for t in body.get("tools", TOOLS) or ()]
    return r.json()["id"]


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error


def test_tool_loop_pauses_resumes_and_reports_kv(srv, http):
    sid = create(http, system="You are a concise assistant.")
    first = http.post(f"/sessions/{sid}/messages", json={"content": QUESTION}).json()
    assert first["state"] == "paused" and first["finish_reason"] == "tool_calls"
    (call,) = first["pending_calls"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"} and not call["server"]

    state = http.get(f"/sessions/{sid}").json()
    assert state["state"] == "paused" and [c["id"] for c in state["pending_calls"]] == [call["id"]]
    assert [m["role"] for m in state["messages"]] == ["user", "assistant"]
    kv = state["kv"]  # preserve policy: the paused context stays on the device
    assert kv["device"] >= first["usage"]["total_tokens"] - 1 and kv["host"] == 0

    assert_error(http.post(f"/sessions/{sid}/messages", json={"content": "hi"}), 409, "session_paused")
    assert_error(http.post(f"/sessions/{sid}/messages", json={}), 400, None)
    second = http.post(f"/sessions/{sid}/messages", json={
        "tool_results": [{"tool_call_id": call["id"], "content": RESULT}], "max_tokens": 8}).json()
    usage = second["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"], usage
    assert usage["prompt_tokens_details"]["cached_tokens"] == first["usage"]["total_tokens"] - 1
    assert second["state"] == "idle" and second["message"]["content"]
    state = http.get(f"/sessions/{sid}").json()
    assert state["state"] == "idle" and [m["role"] for m in state["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert state["kv"] == {"device": 0, "host": 0, "discarded": 0}
    assert_error(http.post(f"/sessions/{sid}/messages", json={
        "tool_results": [{"tool_call_id": call["id"], "content": RESULT}]}), 409, "session_not_paused")

    assert http.delete(f"/sessions/{sid}").json() == {"id": sid, "object": "session.deleted", "deleted": True}
    for method, path, body in (("GET", f"/sessions/{sid}", None), ("DELETE", f"/sessions/{sid}", None),
                               ("POST", f"/sessions/{sid}/messages", {"content": "hi"})):
        assert_error(http.request(method, path, json=body), 404, "session_not_found")
    srv.assert_no_leak()


def test_deleting_a_paused_session_frees_its_generation(srv, http):
    sid = create(http)
    assert http.post(f"/sessions/{sid}/messages", json={"content": QUESTION}).json()["state"] == "paused"
    assert len(srv.app.state.conversations.paused()) == 1
    http.delete(f"/sessions/{sid}")
    assert len(srv.app.state.conversations.paused()) == 0
    srv.assert_no_leak()
    assert srv.engine_state()["requests"] == {}


def test_stream_events(srv, http):
    sid = create(http)
    with http.stream("POST", f"/sessions/{sid}/messages", json={"content": QUESTION, "stream": True}) as r:
        assert r.status_code == 200
        events = sse(r)
    kinds = [k for k, _ in events]
    assert kinds == ["tool_call", "paused", "done"], events
    (call,) = events[1][1]["pending_calls"]
    assert events[0][1] == call and events[2][1]["state"] == "paused"
    with http.stream("POST", f"/sessions/{sid}/messages", json={
            "tool_results": [{"tool_call_id": call["id"], "content": RESULT}], "max_tokens": 8, "stream": True}) as r:
        events = sse(r)
    kinds = [k for k, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) == {"delta"}, events
    done = events[-1][1]
    assert "".join(d["content"] for _, d in events[:-1]) == done["message"]["content"]
    usage = done["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
    http.delete(f"/sessions/{sid}")
    srv.assert_no_leak()


def test_deleting_a_generating_session_aborts_it(srv, http):
    sid = create(http, tools=None)
    body = {"content": "Tell me a long story about a dragon.", "max_tokens": 400, "stream": True}
    with http.stream("POST", f"/sessions/{sid}/messages", json=body) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("event: delta"):
                break
        assert_error(http.post(f"/sessions/{sid}/messages", json={"content": "hi"}), 409, "session_busy")
        deleter = threading.Thread(target=lambda: httpx.delete(f"{srv.url}/sessions/{sid}", timeout=60))
        deleter.start()
        rest = list(lines)
        deleter.join()
    assert "event: error" in rest and "event: done" not in rest
    assert any("session_deleted" in line for line in rest)
    srv.assert_no_leak(timeout=10)
    assert srv.engine_state()["requests"] == {}


class FakeWeather:
    """A server tool with the infercept.tools interface, recording its calls."""

    name = WEATHER["name"]
    description = WEATHER["description"]
    parameters = WEATHER["parameters"]

    def __init__(self):
        self.calls = []

    async def run(self, arguments: dict) -> str:
        self.calls.append(arguments)
        return RESULT


def test_server_tools_run_inside_the_server(srv):
    """A second app on the running engine (over ASGI) whose tool lookup knows the fake tool."""
    tool = FakeWeather()
    app = build_app(srv.backend, ServerSettings(served_model_name=MODEL),
                    tool_lookup=lambda name: {tool.name: tool}[name])

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app/v1",
                                     timeout=120) as http:
            r = await http.post("/sessions", json={"server_tools": ["nope"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "server_tools"
            r = await http.post("/sessions", json={"server_tools": ["get_weather"], "temperature": 0, "max_tokens": 40})
            sid = r.json()["id"]
            assert r.json()["server_tools"] == ["get_weather"] and r.json()["tools"] == []
            turn = (await http.post(f"/sessions/{sid}/messages", json={"content": QUESTION})).json()
            state = (await http.get(f"/sessions/{sid}")).json()
            await http.delete(f"/sessions/{sid}")
            return turn, state

    turn, state = asyncio.run(run())
    assert tool.calls == [{"city": "Paris"}]
    first, second = turn["steps"][:2]
    assert first["finish_reason"] == "tool_calls"
    # The call never left the server: the paused generation was resumed with the tool's result.
    assert second["cached_tokens"] >= 0.9 * second["prompt_tokens"], turn["steps"]
    assert [m["role"] for m in state["messages"]][:3] == ["user", "assistant", "tool"]
    assert state["messages"][2]["content"] == RESULT
    assert len(app.state.conversations.paused()) == 0  # nothing of the second app is left paused
    srv.assert_no_leak()


def token_ids(srv, text: str) -> list[int]:
    return srv.app.state.completions.tokenizer.encode(text, add_special_tokens=False)


def test_token_level_session_pauses_where_the_client_says(srv, http):
    """`token_ids` + `intercept`: the turn's length stop pauses the generation; the next `token_ids`
    resume it with only those tokens to compute, token for token what a from-scratch completion of the
    whole context generates."""
    sid = http.post("/sessions", json={"temperature": 0}).json()["id"]
    prompt = token_ids(srv, "The three largest cities of France are Paris, Lyon and")
    turn = {"max_tokens": 6, "ignore_eos": True}
    first = http.post(f"/sessions/{sid}/messages", json={"token_ids": prompt, "intercept": {"kind": "tool"},
                                                         **turn}).json()
    assert first["state"] == "paused" and first["finish_reason"] == "length" and len(first["token_ids"]) == 6
    state = http.get(f"/sessions/{sid}").json()
    assert state["context_tokens"] == len(prompt) + 6 and state["pending_calls"] == []
    assert state["kv"]["device"] >= len(prompt) + 5  # preserve: the paused context stays on the device

    returned = token_ids(srv, " Observation: Marseille is second.")
    second = http.post(f"/sessions/{sid}/messages", json={"token_ids": returned, **turn}).json()
    context = prompt + first["token_ids"] + returned
    assert second["state"] == "idle" and second["usage"]["prompt_tokens"] == len(context)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + 5  # all but the last token
    scratch = http.post("/completions", json={"model": MODEL, "prompt": context, "temperature": 0, "return_token_ids": True,
                                              **turn}).json()["choices"][0]
    assert second["token_ids"] == scratch["token_ids"]
    assert http.get(f"/sessions/{sid}").json()["context_tokens"] == len(context) + 6
    http.delete(f"/sessions/{sid}")
    srv.assert_no_leak()


def test_token_level_session_kinds_errors_and_stream(srv, http):
    chat_sid = create(http)
    prompt = token_ids(srv, "Count with me: one, two, three,")
    assert_error(http.post(f"/sessions/{chat_sid}/messages", json={"token_ids": prompt}), 400, None)
    sid = http.post("/sessions", json={"temperature": 0, "max_tokens": 3}).json()["id"]
    for body in ({"token_ids": prompt, "content": "hi"}, {"token_ids": [10 ** 9]}, {"token_ids": []},
                 {"content": "hi", "ignore_eos": True}):
        assert_error(http.post(f"/sessions/{sid}/messages", json=body), 400, None)
    assert http.get(f"/sessions/{sid}").json()["state"] == "idle"

    with http.stream("POST", f"/sessions/{sid}/messages", json={"token_ids": prompt, "ignore_eos": True,
                                                                "intercept": {"kind": "human"}, "stream": True}) as r:
        events = sse(r)
    kinds = [k for k, _ in events]
    assert kinds[-2:] == ["paused", "done"] and set(kinds[:-2]) == {"delta"}, events
    done = events[-1][1]
    assert [t for k, d in events if k == "delta" for t in d["token_ids"]] == done["token_ids"] and len(done["token_ids"]) == 3
    assert "".join(d["text"] for k, d in events if k == "delta") == done["text"]
    assert_error(http.post(f"/sessions/{sid}/messages", json={"content": "hi"}), 400, None)  # token-level for life

    # A paused generation that is gone (here: aborted as the TTL would) is served fresh from the session's context.
    srv.abort_paused()
    third = http.post(f"/sessions/{sid}/messages", json={"token_ids": token_ids(srv, " four,"), "ignore_eos": True}).json()
    assert third["state"] == "idle" and len(third["token_ids"]) == 3
    assert third["usage"]["prompt_tokens"] == len(prompt) + 3 + len(token_ids(srv, " four,"))
    for sid_ in (sid, chat_sid):
        http.delete(f"/sessions/{sid_}")
    srv.assert_no_leak()


def test_session_stop_and_seed_match_a_completion(srv, http):
    """`stop` and `seed` (session defaults or per message) mean what they mean in a completion: a
    token-level turn ends (here: pauses, with `intercept`) at the stop string with the same text, and a
    seeded sampled turn draws the same tokens as a completion with that seed."""
    prompt = token_ids(srv, "Count with me: one, two, three,")
    scratch = http.post("/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 8,
                                              "ignore_eos": True}).json()["choices"][0]["text"]
    stop = scratch.split(",")[1] + ","  # e.g. " five,": two words in, so the turn stops early
    want = http.post("/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 8,
                                           "stop": [stop]}).json()["choices"][0]
    assert want["finish_reason"] == "stop", (scratch, stop)
    sid = http.post("/sessions", json={"temperature": 0, "max_tokens": 8, "stop": stop}).json()["id"]
    turn = http.post(f"/sessions/{sid}/messages", json={"token_ids": prompt, "intercept": {"kind": "tool"}}).json()
    assert turn["state"] == "paused" and turn["finish_reason"] == "stop" and turn["text"] == want["text"]
    assert http.get(f"/sessions/{sid}").json()["defaults"]["stop"] == stop

    seeded = {"temperature": 1.0, "max_tokens": 6, "seed": 1234, "ignore_eos": True}
    sampled = http.post("/completions", json={"model": MODEL, "prompt": prompt, "return_token_ids": True,
                                              **seeded}).json()["choices"][0]["token_ids"]
    sid2 = http.post("/sessions", json={}).json()["id"]
    assert http.post(f"/sessions/{sid2}/messages", json={"token_ids": prompt, **seeded}).json()["token_ids"] == sampled
    assert_error(http.post("/sessions", json={"stop": [""]}), 400, None)
    chat = http.post("/sessions", json={"temperature": 0, "max_tokens": 30}).json()["id"]
    assert_error(http.post(f"/sessions/{chat}/messages", json={"content": "hi", "stop": ["a"] * 17}), 400, None)
    for sid_ in (sid, sid2, chat):
        http.delete(f"/sessions/{sid_}")
    srv.assert_no_leak()


def test_session_takes_vllms_sampling_fields(srv, http):
    """vLLM's sampling fields (as session defaults or per message) mean what they mean in a completion:
    `stop_token_ids` ends the turn at that token (its text kept with `include_stop_str_in_output`),
    `top_k` 1 samples greedily, and `cache_salt` keeps the prompt's cached blocks apart."""
    tok = srv.app.state.completions.tokenizer
    prompt = token_ids(srv, "Count with me, slowly and in words, from one up to twenty: one, two, three,")
    assert len(prompt) > 16  # a whole block, which the prefix cache keeps
    ids = http.post("/completions", json={"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 8,
                                          "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]["token_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    sid = http.post("/sessions", json={"temperature": 0, "max_tokens": 8, "stop_token_ids": [ids[k]],
                                       "include_stop_str_in_output": True, "cache_salt": "session-salt"}).json()["id"]
    turn = http.post(f"/sessions/{sid}/messages", json={"token_ids": prompt}).json()
    assert turn["token_ids"] == ids[:k + 1] and turn["text"] == tok.decode(ids[:k + 1]), (turn, ids, k)
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the completion's blocks: unsalted
    again = http.post("/sessions", json={"temperature": 1, "top_k": 1, "max_tokens": 8, "cache_salt": "session-salt",
                                         "stop_token_ids": [ids[k]]}).json()["id"]
    turn = http.post(f"/sessions/{again}/messages", json={"token_ids": prompt}).json()
    assert turn["token_ids"] == ids[:k + 1] and turn["text"] == tok.decode(ids[:k])
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert_error(http.post(f"/sessions/{again}/messages", json={"token_ids": [1], "stop_token_ids": [-1]}), 400, None)
    assert_error(http.post("/sessions", json={"cache_salt": ""}), 400, None)


def test_session_store_limit_and_ttl_on_a_clock():
    clock, released = [0.0], []
    store = ConversationStore(ConversationPolicy(idle_ttl=10, max_named_sessions=2),
                              lambda rid, cause, reason: released.append((rid, cause)), clock=lambda: clock[0])

    def session(i: int, state: State = State.IDLE):
        record = store.open_named(Kind.SESSION, f"s{i}")
        record.state = state
        return record

    s0, s1 = session(0, State.GENERATING), session(1, State.PAUSED)
    store.pause(Paused("r1", [1, 2, 3]), s1)
    clock[0] = 1
    s2 = session(2)  # the least recently used is closed, never a generating one; its paused generation goes
    assert s1.state is State.CLOSED and released == [("r1", "limits")] and store.paused() == []
    s3 = session(3, State.GENERATING)
    assert s2.state is State.CLOSED and released == [("r1", "limits")]
    with pytest.raises(APIError) as refused:  # every session is generating
        session(4)
    assert refused.value.status == 429
    clock[0] = 20
    store.expire()  # generating sessions do not expire
    assert s0.state is State.GENERATING and s3.state is State.GENERATING
    s3.state = State.PAUSED
    store.expire()
    assert s3.state is State.CLOSED and store.named(Kind.SESSION, "s3") is None and store.named(Kind.SESSION, "s0") is s0


def test_session_walkthrough_example_runs(srv):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "session_walkthrough.py"), "--base-url", srv.base,
                          "--max-rounds", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "question:" in text and "paused at ['get_weather']" in text and "tokens on the device" in text
    reused = [line for line in text.splitlines() if line.startswith("tool results:")]
    assert reused and int(reused[0].split("(")[1].split("%")[0]) >= 90, text
    assert "deleted sess_" in text
    srv.assert_no_leak()


def test_chat_completions_with_server_tools(srv):
    """The same server tool through /v1/chat/completions (`server_tools` in the body), sync and streamed."""
    tool = FakeWeather()
    app = build_app(srv.backend, ServerSettings(served_model_name=MODEL),
                    tool_lookup=lambda name: {tool.name: tool}[name])
    body = {"model": MODEL, "temperature": 0, "max_tokens": 40, "server_tools": ["get_weather"],
            "messages": [{"role": "user", "content": QUESTION}]}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app/v1",
                                     timeout=120) as http:
            r = await http.post("/chat/completions", json={**body, "tool_choice": "required"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
            full = (await http.post("/chat/completions", json=body)).json()
            streamed = (await http.post("/chat/completions", json={**body, "stream": True, "request_id": "loop-1",
                                                                   "stream_options": {"include_usage": True}})).text
            return full, streamed

    full, streamed = asyncio.run(run())
    assert tool.calls == [{"city": "Paris"}] * 2
    choice = full["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] in ("stop", "length")
    assert not choice["message"].get("tool_calls") and "session_id" not in full
    usage = full["usage"]  # two turns added up; the second reused the first's whole context
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.45 * usage["prompt_tokens"], usage
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert streamed.rstrip().endswith("data: [DONE]")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert {c["id"] for c in chunks} == {"chatcmpl-loop-1"}  # (vLLM's request_id names the response)
    streamed_usage = chunks[-1]["usage"]  # the same tokens (the prefix cache may find more of the first turn)
    assert (streamed_usage["prompt_tokens"], streamed_usage["completion_tokens"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"])
    assert len(app.state.conversations.paused()) == 0
    srv.assert_no_leak()


def test_the_servers_own_tools_can_be_enabled(srv, http):
    r = http.post("/sessions", json={"server_tools": ["calculator"]})
    assert r.status_code == 200 and r.json()["server_tools"] == ["calculator"]
    http.delete(f"/sessions/{r.json()['id']}")
    assert_error(http.post("/sessions", json={"server_tools": ["no_such_tool"]}), 400, None)
    r = http.post("/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                             "server_tools": ["no_such_tool"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "server_tools"
