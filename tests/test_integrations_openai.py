"""The OpenAI-SDK shim against the live server: clients from the environment, and a Session that
carries an explicit server session across a tool loop (only tool results sent after a call)."""
from __future__ import annotations

import json

import openai

from infercept.integrations.openai import Session, async_client, client
from live_server import resumes

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_clients_default_to_the_environment(monkeypatch):
    monkeypatch.setenv("INFERCEPT_BASE_URL", "http://example.invalid:9/v1")
    monkeypatch.setenv("INFERCEPT_API_KEY", "secret")
    sync, aio = client(), async_client(max_retries=0)
    assert isinstance(sync, openai.OpenAI) and isinstance(aio, openai.AsyncOpenAI)
    assert str(sync.base_url) == str(aio.base_url) == "http://example.invalid:9/v1/"
    assert sync.api_key == "secret" and aio.max_retries == 0
    assert str(client(base_url="http://h:1/v1").base_url) == "http://h:1/v1/"


def test_session_tool_loop_sends_only_tool_results_and_reuses_the_paused_generation(agent_server_url):
    sent = []
    http = openai.DefaultHttpxClient(event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]})
    session = Session(client(base_url=agent_server_url, http_client=http, max_retries=0), model="smol",
                      tools=WEATHER, temperature=0, max_tokens=48)
    calls = []

    def get_weather(city: str) -> str:
        calls.append(city)
        return f"It is sunny in {city}.\n\nNow answer the user's question without calling a tool."

    before = resumes(agent_server_url, "explicit")
    answer = session.run("What is the weather in Paris?", {"get_weather": get_weather})
    assert resumes(agent_server_url, "explicit") == before + 1
    assert calls == ["Paris"] and "sunny" in answer.lower()
    assert [s.finish_reason for s in session.steps] == ["tool_calls", "stop"]
    assert all(body["session_id"] == session.id for body in sent)
    assert [m["role"] for m in sent[1]["messages"]] == ["tool"]  # the server holds the rest
    assert [m["role"] for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.steps[1].reused_fraction >= 0.8
    print(f"session reuse: {session.steps[1].cached_tokens}/{session.steps[1].prompt_tokens}")


def test_session_reports_bad_tool_calls_to_the_model():
    from infercept.integrations.openai.session import _call

    class Function:
        def __init__(self, name, arguments):
            self.name, self.arguments = name, arguments

    functions = {"add": lambda a, b: {"sum": a + b}}
    assert _call(functions, Function("add", '{"a": 1, "b": 2}')) == '{"sum": 3}'
    assert _call(functions, Function("mul", "{}")).startswith("Error: unknown tool 'mul'; available: add")
    assert _call(functions, Function("add", '{"a": 1}')).startswith("Error:")
    assert _call(functions, Function("add", "not json")).startswith("Error:")
