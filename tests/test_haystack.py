"""Haystack, unmodified, against the live server with the embedded model, on both backends: an `Agent`
with one tool on `OpenAIChatGenerator` (Chat Completions). Haystack sends the call back as `tool_calls` and
its result as a `tool` message with the same tools, so the agent's next step resumes the paused
generation, its context read from the paused KV (the usage Haystack puts in each reply's `meta` says so)."""
from __future__ import annotations

import pytest

pytest.importorskip("haystack")
from haystack.components.agents import Agent  # noqa: E402
from haystack.components.generators.chat import OpenAIChatGenerator  # noqa: E402
from haystack.dataclasses import ChatMessage  # noqa: E402
from haystack.tools import Tool  # noqa: E402
from haystack.utils import Secret  # noqa: E402
from live_server import resumes  # noqa: E402

MIN_CACHED_SHARE = 0.9  # of the resumed step's prompt, as the other framework tests require
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_the_agents_next_step_resumes_the_paused_generation(backend_url):
    cities = []

    def get_weather(city: str) -> str:
        cities.append(city)
        return '{"temperature": 21, "sky": "clear"}'

    generator = OpenAIChatGenerator(api_key=Secret.from_token("unused"), model="smol", api_base_url=backend_url,
                                    generation_kwargs={"temperature": 0, "max_tokens": 40}, max_retries=0)
    tool = Tool(name="get_weather", description="Get the current weather in a city", parameters=WEATHER,
                function=get_weather)
    agent = Agent(chat_generator=generator, tools=[tool], max_agent_steps=2)
    before = resumes(backend_url)
    messages = agent.run(messages=[ChatMessage.from_user("What is the weather in Paris?")])["messages"]
    assert resumes(backend_url) == before + 1

    call, result = messages[1], messages[2]
    assert call.tool_calls[0].tool_name == "get_weather" and call.tool_calls[0].arguments == {"city": "Paris"}
    assert cities[0] == "Paris" and result.tool_call_results[0].origin.id == call.tool_calls[0].id
    usage = messages[3].meta["usage"]
    cached, prompt = usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]
    print(f"resumed step: {cached}/{prompt} prompt tokens cached")
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)
