"""Pydantic AI, unmodified, against the live server with the embedded model, on each backend (native, and
vLLM where its environment exists): an agent with one tool on `OpenAIChatModel` (Chat Completions) and on
`OpenAIResponsesModel` (Responses), each over the server's base URL, answering in text, in its default
structured output (an output tool) and in native structured output (a json_schema `response_format` /
`text.format`).

The 135M model loops on its tool when it may choose, so each run is made deterministic with Pydantic AI's
own per-step settings: a capability's `get_model_settings` callable forces the tool on step 1 and, on
step 2, forbids tools (text, native output) or forces the output tool. `UsageLimits(request_limit=2)`
bounds the run: a third request raises `UsageLimitExceeded`.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import openai
import pytest
from pydantic import BaseModel

pytest.importorskip("pydantic_ai")
from pydantic_ai import Agent, NativeOutput  # noqa: E402
from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.messages import ModelResponse  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from pydantic_ai.usage import UsageLimits  # noqa: E402
from live_server import resumes  # noqa: E402

MODELS = {"chat_completions": OpenAIChatModel, "responses": OpenAIResponsesModel}
QUESTION = "What is the weather in Paris?"
MIN_CACHED_SHARE = 0.9  # of the resumed step's prompt, as the other framework tests require
OUTPUT_TOOL = "final_result"  # Pydantic AI's default name for the structured-output tool


class Weather(BaseModel):
    city: str
    temperature_c: int


@dataclass
class ToolThen(AbstractCapability):
    """`tool_choice` per step: the weather tool on step 1, then `after` (the step that reads its result)."""

    after: str | list[str]

    def get_model_settings(self):
        return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step == 1 else self.after}


class Recorder:
    """Pydantic AI's HTTP traffic (request bodies and response statuses) and the tool's calls."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.statuses: list[int] = []
        self.resumes = 0  # paused generations the run's requests resumed
        self.calls: list[str] = []

    def model(self, backend_url: str, api: str):
        async def on_request(request):
            self.bodies.append(json.loads(request.content))

        async def on_response(response):
            self.statuses.append(response.status_code)

        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
        client = openai.AsyncOpenAI(base_url=backend_url, api_key="unused", max_retries=0, timeout=120, http_client=http)
        return MODELS[api]("smol", provider=OpenAIProvider(openai_client=client))


def forced(api: str, name: str) -> dict:
    """The request's `tool_choice` that forces the function tool `name`."""
    return {"type": "function", "function": {"name": name}} if api == "chat_completions" else \
        {"type": "function", "name": name}


def output_schema(api: str, body: dict) -> dict:
    """Where the request carries a structured-output format."""
    return body["response_format"] if api == "chat_completions" else body["text"]["format"]


def run_agent(backend_url: str, api: str, output_type, after):
    """One `Agent.run` of a fresh weather agent: (result, recorder)."""
    recorder = Recorder()

    async def run():
        agent = Agent(recorder.model(backend_url, api), instructions="You answer weather questions.",
                      output_type=output_type, model_settings={"temperature": 0, "max_tokens": 48},
                      capabilities=[ToolThen(after)])

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Get the current weather in a city."""
            recorder.calls.append(city)
            return f"Sunny, 24 C in {city}."

        return await agent.run(QUESTION, usage_limits=UsageLimits(request_limit=2))

    before = resumes(backend_url)
    result = asyncio.run(run())
    recorder.resumes = resumes(backend_url) - before
    return result, recorder


def assert_tool_then_cached_answer(result, recorder: Recorder, api: str) -> None:
    """Two requests, both HTTP 200: the first called the tool (which ran once), the second (the tool result
    appended to the same conversation) answered with most of its prompt reported cached."""
    assert recorder.statuses == [200, 200], recorder.statuses
    assert recorder.calls == ["Paris"]
    # (with no output tool, forcing the only function tool goes out as "required")
    assert recorder.bodies[0]["tool_choice"] in ("required", forced(api, "get_weather"))
    first, resumed = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert [p.tool_name for p in first.tool_calls] == ["get_weather"]
    cached, prompt = resumed.usage.cache_read_tokens, resumed.usage.input_tokens
    print(f"resumed step: {cached}/{prompt} prompt tokens cached")
    assert recorder.resumes == 1
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)


@pytest.mark.parametrize("api", sorted(MODELS))
def test_a_tool_agent_resumes_with_its_prompt_cached(backend_url, api):
    """Text output: the tool runs, and the step after it (tools forbidden) reuses the paused prompt."""
    result, recorder = run_agent(backend_url, api, str, after="none")
    assert_tool_then_cached_answer(result, recorder, api)
    assert recorder.bodies[1]["tool_choice"] == "none"
    assert isinstance(result.output, str) and result.output


@pytest.mark.parametrize("api", sorted(MODELS))
def test_the_default_structured_output_comes_through_the_output_tool(backend_url, api):
    """Pydantic AI's default structured output: the model calls the `final_result` tool (forced on step 2),
    whose arguments must validate as the pydantic model."""
    result, recorder = run_agent(backend_url, api, Weather, after=[OUTPUT_TOOL])
    assert_tool_then_cached_answer(result, recorder, api)
    assert recorder.bodies[1]["tool_choice"] == forced(api, OUTPUT_TOOL)
    assert isinstance(result.output, Weather) and result.output.city == "Paris"


@pytest.mark.parametrize("api", sorted(MODELS))
def test_native_structured_output_comes_as_a_json_schema_format(backend_url, api):
    """`NativeOutput`: the schema goes out as a json_schema format (`response_format` or `text.format`) and
    the step-2 text must validate as the pydantic model."""
    result, recorder = run_agent(backend_url, api, NativeOutput(Weather), after="none")
    assert_tool_then_cached_answer(result, recorder, api)
    assert output_schema(api, recorder.bodies[1])["type"] == "json_schema"
    assert isinstance(result.output, Weather) and result.output.city == "Paris"
