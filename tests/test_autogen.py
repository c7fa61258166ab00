"""AutoGen (`autogen-agentchat` with `autogen-ext`'s OpenAI client), unmodified, against the live server with
the embedded model: an `AssistantAgent` with one tool on `OpenAIChatCompletionClient` (Chat Completions).

Where the agent goes on after the tool (`max_tool_iterations` 2) it sends the conversation back with the
call as `tool_calls` and the result as a `tool` message, and the same tools: that step resumes the paused
generation. Its `reflect_on_tool_use` step instead asks for no tools (`tool_choice` "none", which its
client then leaves out with the tools), so its prompt, rendered without the tool definitions, does not
extend the paused generation: it is served fresh, its context computed again but for the few tokens the
two prompts share; with the server's `--resume-without-tools` it is served with the paused prompt's tools
(none callable) and resumes.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import openai
import pytest

pytest.importorskip("autogen_agentchat")
from autogen_agentchat.agents import AssistantAgent  # noqa: E402
from autogen_core.models import ModelInfo  # noqa: E402
from autogen_ext.models.openai import OpenAIChatCompletionClient  # noqa: E402
from live_server import resumes  # noqa: E402

MIN_CACHED_SHARE = 0.9  # of the resumed step's prompt, as the other framework tests require
MODEL_INFO = ModelInfo(vision=False, function_calling=True, json_output=True, family="unknown", structured_output=True)


def run_agent(base_url: str, **agent_options) -> tuple[list[dict], list[dict], list[str]]:
    """The agent's run on the weather question: the request bodies, the answers, the tool's cities."""
    bodies, answers, cities = [], [], []

    async def on_request(request):
        bodies.append(json.loads(request.content))

    async def on_response(response):
        await response.aread()
        answers.append(response.json())

    async def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return '{"temperature": 21, "sky": "clear"}'

    async def run():
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
        client = OpenAIChatCompletionClient(model="smol", base_url=base_url, api_key="unused", temperature=0,
                                            max_tokens=40, model_info=MODEL_INFO, http_client=http, max_retries=0)
        agent = AssistantAgent("assistant", model_client=client, tools=[get_weather], **agent_options)
        await agent.run(task="What is the weather in Paris?")
        await client.close()

    asyncio.run(run())
    return bodies, answers, cities


def cached_share(answer: dict) -> tuple[int, int]:
    usage = answer["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def test_the_agents_tool_loop_resumes_the_paused_generation(agent_server_url):
    before = resumes(agent_server_url)
    bodies, answers, cities = run_agent(agent_server_url, max_tool_iterations=2)
    assert resumes(agent_server_url) == before + len(bodies) - 1  # every step after the first
    call = answers[0]["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and cities[0] == "Paris"
    second = bodies[1]
    assert [m["role"] for m in second["messages"][-2:]] == ["assistant", "tool"]
    assert second["messages"][-2]["tool_calls"][0]["id"] == call["id"] and second["tools"] == bodies[0]["tools"]
    cached, prompt = cached_share(answers[1])
    print(f"resumed step: {cached}/{prompt} prompt tokens cached")
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)


def test_a_reflection_step_without_tools_is_served_fresh(agent_server_url):
    before = resumes(agent_server_url)
    bodies, answers, cities = run_agent(agent_server_url, reflect_on_tool_use=True)
    assert resumes(agent_server_url) == before
    assert cities[0] == "Paris" and len(bodies) == 2
    reflection = bodies[1]
    assert "tools" not in reflection and reflection.get("tool_choice") in (None, "none")
    assert answers[1]["choices"][0]["message"]["content"]
    cached, prompt = cached_share(answers[1])
    print(f"reflection step: {cached}/{prompt} prompt tokens cached")
    assert cached < 0.5 * prompt, (cached, prompt)


def test_a_reflection_step_resumes_with_resume_without_tools(agent_server, monkeypatch):
    url, app = agent_server
    store = app.state.conversations
    monkeypatch.setattr(store, "policy", replace(store.policy, resume_without_tools=True))
    before = resumes(url)
    bodies, answers, cities = run_agent(url, reflect_on_tool_use=True)
    assert resumes(url) == before + 1
    assert cities[0] == "Paris" and len(bodies) == 2 and "tools" not in bodies[1]
    assert answers[1]["choices"][0]["message"]["content"] and not answers[1]["choices"][0]["message"].get("tool_calls")
    cached, prompt = cached_share(answers[1])
    print(f"reflection step with --resume-without-tools: {cached}/{prompt} prompt tokens cached")
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)
