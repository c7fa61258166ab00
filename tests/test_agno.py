"""Agno, unmodified, against the live server with the embedded model, on both backends: an `Agent` with one
tool on Agno's own `VLLM` model class (Chat Completions, what an Agno user points at a vLLM server). Agno
sends the call back as `tool_calls` and its result as a `tool` message with the same tools, so the agent's
next step resumes the paused generation, its context read from the paused KV (the metrics Agno keeps on
each assistant message say so)."""
from __future__ import annotations

import pytest

pytest.importorskip("agno")
from agno.agent import Agent  # noqa: E402
from agno.models.vllm import VLLM  # noqa: E402
from live_server import resumes  # noqa: E402

MIN_CACHED_SHARE = 0.9  # of the resumed step's prompt, as the other framework tests require


def test_the_agents_next_step_resumes_the_paused_generation(backend_url):
    cities = []

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return '{"temperature": 21, "sky": "clear"}'

    # (greedy, without the presence penalty Agno's VLLM class sets by default: a call's JSON repeats tokens)
    model = VLLM(id="smol", base_url=backend_url, api_key="unused", temperature=0, presence_penalty=0,
                 max_tokens=40, max_retries=0)
    agent = Agent(model=model, tools=[get_weather], tool_call_limit=1, telemetry=False)
    before = resumes(backend_url)
    run = agent.run("What is the weather in Paris?")
    assert resumes(backend_url) == before + 1

    steps = [m for m in run.messages if m.role == "assistant"]
    call = steps[0].tool_calls[0]
    assert call["function"]["name"] == "get_weather" and cities == ["Paris"], (call, cities)
    result = next(m for m in run.messages if m.role == "tool")
    assert result.tool_call_id == call["id"]
    metrics = steps[1].metrics
    cached, prompt = metrics.cache_read_tokens, metrics.input_tokens
    print(f"resumed step: {cached}/{prompt} prompt tokens cached")
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)
