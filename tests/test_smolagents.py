"""smolagents (Hugging Face's agent framework), unmodified, against the live server with the embedded model:
a `ToolCallingAgent` on `OpenAIServerModel` (Chat Completions) with one tool.

smolagents asks every step for a call (`tool_choice: "required"`, its own `final_answer` among the tools),
which the server enforces with its grammar, so the first step calls the weather tool whatever the 135M
model would rather write. It sends the call and its result back as text (an assistant message
"Calling tools: ..." and a user message "Observation: ..."), not as `tool_calls` and a `tool` message:
the next step's prompt does not extend the paused generation, which is not resumed, and that step reuses
its context from the prefix cache instead (the paused generation's blocks are in it).
"""
from __future__ import annotations

import json

import openai
import pytest

pytest.importorskip("smolagents")
from live_server import resumes  # noqa: E402
from smolagents import OpenAIServerModel, ToolCallingAgent, tool  # noqa: E402

MIN_CACHED_SHARE = 0.9  # of the second step's prompt, as the other framework tests require


def test_a_tool_calling_agent_calls_its_tool_and_the_next_step_reads_the_context_from_the_cache(agent_server_url):
    bodies, answers, cities = [], [], []

    def on_request(request):
        bodies.append(json.loads(request.content))

    def on_response(response):
        response.read()
        answers.append(response.json())

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city's name.
        """
        cities.append(city)
        return '{"temperature": 21, "sky": "clear"}'

    http = openai.DefaultHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
    model = OpenAIServerModel(model_id="smol", api_base=agent_server_url, api_key="unused", temperature=0,
                              max_tokens=40, client_kwargs={"http_client": http, "max_retries": 0, "timeout": 120})
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=2, verbosity_level=0)
    before = resumes(agent_server_url)
    agent.run("What is the weather in Paris?")
    assert resumes(agent_server_url) == before  # (a call replayed as text continues no paused generation)

    first, second = bodies[0], bodies[1]
    assert first["tool_choice"] == "required"
    assert {t["function"]["name"] for t in first["tools"]} == {"get_weather", "final_answer"}
    call = answers[0]["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert cities[0] == "Paris"  # its tool ran (the second step may call it again)
    # The call comes back as text: no tool_calls, no tool message; the context is read from the cache.
    assert not any(m.get("tool_calls") or m["role"] == "tool" for m in second["messages"])
    assert any("Observation" in json.dumps(m["content"]) for m in second["messages"])
    usage = answers[1]["usage"]
    cached, prompt = usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]
    print(f"second step: {cached}/{prompt} prompt tokens cached")
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)
