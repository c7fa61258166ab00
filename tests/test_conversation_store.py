"""The engine's paused set and the conversation store never drift apart.

A real server (uvicorn, its lifespan: the store's reaper and the release at shutdown) over a scripted
engine that records which requests it holds paused. Conversations of every kind are put in every state
-- idle, generating, paused, closed by TTL expiry, by the limits, by a client delete, by a session
delete, by a response chain moving on, by shutdown -- and after each step the request ids the engine
holds paused are exactly those of the store's paused handles. The store's clock is moved by hand.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from live_server import serve_in_thread
from scripted_backend import WEATHER, ScriptedBackend

from infercept.server.app import build_app
from infercept.server.conversations import ConversationStore, Kind, State
from infercept.server.settings import ConversationPolicy, ServerSettings

QUESTION = {"role": "user", "content": "What is the weather in Rome?"}
RESULT = "sunny, 24 C"
RESPONSE_TOOLS = [{"type": "function", **WEATHER["function"]}]


class EngineFake(ScriptedBackend):
    """The scripted engine (a question about the weather pauses at a call; a resume answers), plus: a
    prompt asking for something "slow" generates until its stream is closed, and any other token-level
    interception (`intercept` on a token prompt) pauses after two words."""

    def __init__(self, model_dir: str):
        super().__init__(model_dir)
        self.generating: set[str] = set()

    async def generate(self, prompt, params, request_id, intercept=None):
        slow = "slow" in self.tokenizer.decode(prompt).rsplit("<|im_start|>user", 1)[-1]
        if not slow and intercept is not None and intercept.pause_on_stop:
            out = self._out(request_id, prompt, " four, five", paused=True)
            self.paused[request_id] = len(prompt) + len(out.token_ids)
            yield out
            return
        if not slow:
            async for out in super().generate(prompt, params, request_id, intercept):
                yield out
            return
        self.generating.add(request_id)
        try:
            text = ""
            while True:
                text += " la"
                yield self._out(request_id, prompt, text)
                await asyncio.sleep(0.02)
        finally:
            self.generating.discard(request_id)


@pytest.fixture
def fake_server(default_model_dir):
    fake = EngineFake(default_model_dir)
    policy = ConversationPolicy(idle_ttl=1.0, response_ttl=2.0, max_paused=3, max_named_sessions=4)
    app = build_app(fake, ServerSettings(served_model_name="fake", conversations=policy))
    clock = [0.0]
    app.state.conversations.clock = lambda: clock[0]
    server, thread, base = serve_in_thread(app)
    try:
        yield fake, app, base, clock, server, thread
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def wait_until_line(lines, text: str) -> None:
    for line in lines:
        if text in line:
            return
    raise AssertionError(f"the stream ended before {text!r}")


def test_the_engines_paused_set_is_the_stores_in_every_state(fake_server):
    fake, app, base, clock, server, thread = fake_server
    store = app.state.conversations
    http = httpx.Client(base_url=base + "/v1", timeout=30)

    def record(kind: Kind, id: str):
        """A record as the store has it (read without touching its LRU order from this thread)."""
        return store._responses.get(id) if kind is Kind.RESPONSE else store._named.get((None, kind, id))

    def in_step(num_paused: int) -> None:
        held = [h.request_id for h in store.paused()]
        assert sorted(held) == sorted(fake.paused) and len(held) == num_paused, (held, fake.paused)

    def chat(messages: list, **extra) -> dict:
        r = http.post("/chat/completions", json={"model": "fake", "messages": messages, "tools": [WEATHER], **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def answered(first: dict) -> list:
        message = first["choices"][0]["message"]
        return [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": RESULT}]

    def resumed(usage: dict) -> bool:
        return usage["prompt_tokens_details"]["cached_tokens"] > 0

    def causes() -> dict[str, float]:
        return {c: app.state.metrics.evictions.labels("fake", c)._value.get()
                for c in ("limits", "ttl", "shutdown", "client")}

    # Idle: a native session nothing was posted to.
    a = http.post("/sessions", json={"tools": [WEATHER]}).json()["id"]
    assert http.get(f"/sessions/{a}").json()["state"] == "idle"
    in_step(0)

    # Paused, implicit: a chat turn ends in a call; the request with its result resumes it.
    first = chat([QUESTION])
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    in_step(1)
    assert resumed(chat([QUESTION, *answered(first)])["usage"])
    in_step(0)

    # Paused, native chat session: the session holds the generation; its tool results resume it.
    paused = http.post(f"/sessions/{a}/messages", json={"content": QUESTION["content"]}).json()
    assert paused["state"] == "paused" and record(Kind.SESSION, a).paused is not None
    in_step(1)
    assert http.get(f"/sessions/{a}").json()["kv"]["device"] > 0
    results = [{"tool_call_id": paused["pending_calls"][0]["id"], "content": RESULT}]
    done = http.post(f"/sessions/{a}/messages", json={"tool_results": results}).json()
    assert done["state"] == "idle" and resumed(done["usage"])
    in_step(0)

    # Paused, explicit chat session: only the tool result is sent, under the session id.
    first = chat([QUESTION], session_id="s1")
    assert record(Kind.CHAT, "s1").paused is not None
    in_step(1)
    second = chat(answered(first)[1:], session_id="s1")
    assert resumed(second["usage"]) and record(Kind.CHAT, "s1").state is State.IDLE
    in_step(0)

    # Paused, token-level: /v1/completions and a token-level native session.
    c = http.post("/completions", json={"model": "fake", "prompt": "Count: one, two, three,", "intercept": {"kind": "tool"},
                                        "return_token_ids": True}).json()["choices"][0]
    in_step(1)
    extended = c["prompt_token_ids"] + c["token_ids"] + c["token_ids"][:1]
    assert resumed(http.post("/completions", json={"model": "fake", "prompt": extended}).json()["usage"])
    in_step(0)
    t = http.post("/sessions", json={}).json()["id"]
    turn = http.post(f"/sessions/{t}/messages", json={"token_ids": c["prompt_token_ids"],
                                                           "intercept": {"kind": "tool"}}).json()
    assert turn["state"] == "paused"
    in_step(1)
    assert resumed(http.post(f"/sessions/{t}/messages", json={"token_ids": c["token_ids"]}).json()["usage"])
    in_step(0)

    # Cut off between the pause and the store: of a batch, one prompt pauses at once and the other
    # generates on; the client leaves before the answer, so the pause is never kept (and is aborted).
    with pytest.raises(httpx.ReadTimeout):
        http.post("/completions", timeout=0.5, json={"model": "fake", "prompt": ["Count: one, two,", "a slow count"],
                                                     "intercept": {"kind": "tool"}})
    wait_for(lambda: not fake.generating and not fake.paused)
    in_step(0)

    # Responses: a stored response holds its generation; the chained request resumes it (the first
    # response keeps its body, no longer the generation); deleting a paused response releases it.
    r1 = http.post("/responses", json={"model": "fake", "input": QUESTION["content"], "tools": RESPONSE_TOOLS}).json()
    assert record(Kind.RESPONSE, r1["id"]).paused is not None
    in_step(1)
    r2 = http.post("/responses", json={"model": "fake", "previous_response_id": r1["id"], "tools": RESPONSE_TOOLS,
                                       "input": [{"type": "function_call_output", "call_id": r1["output"][0]["call_id"],
                                                  "output": RESULT}]}).json()
    assert resumed({"prompt_tokens_details": r2["usage"]["input_tokens_details"]})
    assert record(Kind.RESPONSE, r1["id"]).paused is None and http.get(f"/responses/{r1['id']}").status_code == 200
    in_step(0)
    r3 = http.post("/responses", json={"model": "fake", "input": QUESTION["content"], "tools": RESPONSE_TOOLS}).json()
    in_step(1)
    assert http.delete(f"/responses/{r3['id']}").status_code == 200
    in_step(0)
    assert causes()["client"] == 1

    # Limits: max_paused=3, so a fourth pause releases the one keeping the least KV (the shortest).
    for city in ("Rome", "Paris", "Oslo", "Lisbon, the capital of Portugal"):
        chat([{"role": "user", "content": f"What is the weather in {city}?"}])
    in_step(3)
    assert causes()["limits"] == 1

    # Generating: a native session and a chat session stream; neither is paused meanwhile.
    b = http.post("/sessions", json={}).json()["id"]
    with http.stream("POST", f"/sessions/{b}/messages", json={"content": "Tell me a slow story", "stream": True}) as s:
        lines = s.iter_lines()  # one iterator: dropping one closes the stream
        wait_until_line(lines, "event: delta")
        assert http.get(f"/sessions/{b}").json()["state"] == "generating"
        with http.stream("POST", "/chat/completions", json={"model": "fake", "stream": True, "session_id": "s2",
                                                            "messages": [{"role": "user", "content": "slow, please"}]}) as s2:
            lines2 = s2.iter_lines()
            wait_until_line(lines2, '"content": " la')
            assert record(Kind.CHAT, "s2").state is State.GENERATING and len(fake.generating) == 2
            in_step(3)
        deleter = threading.Thread(target=lambda: http.delete(f"/sessions/{b}"))  # session delete while generating
        deleter.start()
        rest = list(lines)
        deleter.join()
    assert any("session_deleted" in line for line in rest)
    wait_for(lambda: not fake.generating and record(Kind.CHAT, "s2").state is State.IDLE)
    in_step(3)

    # TTL: past idle_ttl every paused generation is released and every session unused that long closed.
    clock[0] += 1.5
    wait_for(lambda: not fake.paused)
    in_step(0)
    assert causes()["ttl"] == 3 and record(Kind.SESSION, a) is None and record(Kind.CHAT, "s1") is None
    assert http.get(f"/sessions/{a}").status_code == 404 and http.get(f"/responses/{r1['id']}").status_code == 200
    clock[0] += 1.0  # the responses' own clock: 2 s after their creation
    assert http.get(f"/responses/{r1['id']}").status_code == 404

    # Session delete: a paused native session deleted releases its generation.
    sessions = [http.post("/sessions", json={"tools": [WEATHER]}).json()["id"] for _ in range(4)]
    for sid in sessions[:2]:
        http.post(f"/sessions/{sid}/messages", json={"content": QUESTION["content"]})
    in_step(2)
    assert http.delete(f"/sessions/{sessions[0]}").status_code == 200
    in_step(1)
    assert causes()["client"] == 2

    # Named-session limit (4): a fifth session closes the least recently used, releasing its generation.
    for sid in sessions[2:]:
        http.get(f"/sessions/{sid}")  # used after sessions[1]: it is the least recently used
    http.post("/sessions", json={})
    http.post("/sessions", json={})
    in_step(0)
    assert http.get(f"/sessions/{sessions[1]}").status_code == 404 and causes()["limits"] == 2

    # Shutdown: what is still paused is released.
    chat([QUESTION])
    http.post(f"/sessions/{sessions[2]}/messages", json={"content": QUESTION["content"]})
    http.post("/responses", json={"model": "fake", "input": QUESTION["content"], "tools": RESPONSE_TOOLS})
    in_step(3)
    http.close()
    server.should_exit = True
    thread.join(timeout=10)
    in_step(0)
    assert causes()["shutdown"] == 3 and not fake.running


def test_the_idle_ttl_counts_from_the_end_of_a_request_not_its_start(fake_server):
    """A chat session whose turn generated for longer than the TTL is not closed the moment it ends."""
    fake, app, base, clock, server, thread = fake_server
    store = app.state.conversations

    def record():
        return store._named.get((None, Kind.CHAT, "long"))

    body = {"model": "fake", "messages": [{"role": "user", "content": "a slow count"}], "stream": True,
            "session_id": "long"}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        wait_until_line(lines, " la")
        clock[0] += 1.5  # the turn runs past idle_ttl (1.0): a generating record is never reaped
        time.sleep(0.5)  # two reaper ticks
        assert record() is not None and record().state is State.GENERATING
    wait_for(lambda: not fake.generating and record().state is State.IDLE)
    time.sleep(0.5)  # the reaper ran since: the TTL starts from the end of the request
    assert record() is not None
    clock[0] += 1.5
    wait_for(lambda: record() is None)


def test_a_session_whose_post_is_in_flight_is_not_reaped_though_its_turn_ended():
    """A native session leaves GENERATING when its turn ends, but its idle TTL starts again only in the
    post's cleanup, after an await: a turn longer than the TTL left a window in which the reaper closed
    the session before its answer reached the client (whose next read got 404; seen in the soak)."""
    store = ConversationStore(ConversationPolicy(idle_ttl=1.0), release=lambda *a: None, clock=lambda: now)
    now = 0.0
    session = store.open_named(Kind.SESSION, "s1")
    session.task = object()  # the post in flight
    session.state = State.IDLE  # its turn ended
    now = 5.0
    store.expire()
    assert store.named(Kind.SESSION, "s1") is session  # kept: the post's cleanup has not run yet
    session.task = None  # the cleanup (it touched the session: `named` above did the same)
    store.expire()
    assert store.named(Kind.SESSION, "s1") is session
    now = 7.0
    store.expire()
    assert store.named(Kind.SESSION, "s1") is None  # unused past the TTL, no post: gone


def test_a_turn_repeated_alike_by_turns_of_other_tokens_renders_by_the_template():
    """Call ids need not be unique (a Kimi-K2 model numbers its own per conversation): two turns with the
    same message but other tokens (one model's thinking, say) leave which one a conversation holds unknown,
    so neither's tokens are rendered for it; a turn alone, or repeated with its own tokens, is."""
    from infercept.server.chat import AssistantTurn, Call, Message

    store = ConversationStore(ConversationPolicy(max_remembered_turns=3), release=lambda *a: None)
    message = Message("assistant", "", None, (Call.make("functions.get_weather:0", "get_weather", '{"city": "Rome"}'),))
    first = AssistantTurn(message, (1, 2, 3))
    store.remember_turn(first)
    store.remember_turn(first)  # the same turn again: no ambiguity
    assert store.known_turn(message) is first
    store.remember_turn(AssistantTurn(message, (1, 9, 3)))
    assert store.known_turn(message) is None
    other = Message("assistant", "", None, (Call.make("functions.get_weather:0", "get_weather", '{"city": "Oslo"}'),))
    oslo = AssistantTurn(other, (4, 5))
    store.remember_turn(oslo)  # same id, other arguments: its own message
    assert store.known_turn(other) is oslo
    for i in range(3):  # the oldest call ids go first once more turns than the policy keeps are remembered
        store.remember_turn(AssistantTurn(Message("assistant", "", None, (Call.make(f"c{i}", "f", "{}"),)), (i,)))
    assert store.known_turn(other) is None and store.known_turn(message) is None


def test_a_generated_turn_is_known_to_its_own_tenant_only():
    """Another tenant repeating a turn (its call ids included) gets the template's rendering, never the
    tokens that tenant's model generated (a thinking model's thinking, which its client may not show)."""
    from infercept.server.chat import AssistantTurn, Call, Message
    from infercept.server.conversations import Paused

    store = ConversationStore(ConversationPolicy(), release=lambda *a: None)
    message = Message("assistant", "", None, (Call.make("call_1", "get_weather", '{"city": "Rome"}'),))
    turn = AssistantTurn(message, (1, 2, 3))
    store.pause(Paused("r1", [9, 1, 2, 3], turn, (Message("user", "weather?"),)), owner="alice")
    assert store.known_turn(message, "alice") is turn
    assert store.known_turn(message, "bob") is None and store.known_turn(message) is None


def test_what_the_store_holds_is_each_named_record_of_any_tenant_until_it_closes():
    """`holds` (what another replica asks before it forwards a request) answers for every tenant's record
    of a kind and id, and stops when the last of them closes; a record of the other kind is not it."""
    store = ConversationStore(ConversationPolicy(max_named_sessions=3), release=lambda *a: None)
    alice, bob = store.open_named(Kind.CHAT, "c1", "alice"), store.open_named(Kind.CHAT, "c1", "bob")
    assert store.holds(Kind.CHAT, "c1") and not store.holds(Kind.SESSION, "c1") and not store.holds(Kind.CHAT, "c2")
    store.close(alice)
    assert store.holds(Kind.CHAT, "c1")
    store.close(bob)
    assert not store.holds(Kind.CHAT, "c1")
    for name in ("s1", "s2", "s3", "s4"):  # past the limit the least recently used closes
        store.open_named(Kind.SESSION, name)
    assert not store.holds(Kind.SESSION, "s1") and all(store.holds(Kind.SESSION, n) for n in ("s2", "s3", "s4"))
