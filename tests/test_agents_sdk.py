"""The OpenAI Agents SDK (`agents`), unmodified, against the live server with the embedded model, on each
backend (native, and vLLM where its environment exists): a function-tool agent run by `Runner.run` on the
Responses model and on the Chat Completions model, and an agent with a pydantic `output_type`.

The 135M model loops on its tool when it may choose, so each run is made deterministic with the SDK's
own knobs: `tool_choice="required"` forces the call on the first step, `reset_tool_choice=False` keeps
the SDK from resetting it to auto, and an `AgentHooks.on_tool_end` hook sets `tool_choice="none"` once
the tool has run, so the second (resumed) step answers. `max_turns=2` bounds the run: a third model call
raises `MaxTurnsExceeded`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json

import openai
import pytest
from pydantic import BaseModel

pytest.importorskip("agents")
from agents import (Agent, AgentHooks, ModelSettings, OpenAIChatCompletionsModel,  # noqa: E402
                    OpenAIResponsesModel, RunConfig, Runner, function_tool)
from live_server import resumes  # noqa: E402
from test_mcp_tools import http_mcp  # noqa: E402,F401 (a fixture: the calc MCP server over HTTP)

MODELS = {"responses": OpenAIResponsesModel, "chat_completions": OpenAIChatCompletionsModel}
QUESTION = "What is the weather in Paris?"
MIN_CACHED_SHARE = 0.9  # of the resumed step's prompt, as the other framework tests require


class Weather(BaseModel):
    city: str
    temperature_c: int


class AnswerAfterTheTool(AgentHooks):
    """Forbids further tool calls once the tool has run, so the next step answers."""

    async def on_tool_end(self, context, agent, tool, result) -> None:
        agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")


class Recorder:
    """The SDK's HTTP traffic (request bodies and response statuses) and the tool's calls."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.statuses: list[int] = []
        self.resumes = 0  # paused generations the run's requests resumed
        self.calls: list[str] = []

    def client(self, backend_url: str) -> openai.AsyncOpenAI:
        async def on_request(request):
            if request.content:  # (a session's GETs have no body)
                self.bodies.append(json.loads(request.content))

        async def on_response(response):
            self.statuses.append(response.status_code)

        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
        return openai.AsyncOpenAI(base_url=backend_url, api_key="unused", max_retries=0, timeout=120, http_client=http)

    def weather_tool(self):
        @function_tool
        def get_weather(city: str) -> str:
            """Get the current weather in a city."""
            self.calls.append(city)
            return f"Sunny, 24 C in {city}."

        return get_weather


def run_agent(backend_url: str, api: str, output_type=None):
    """One `Runner.run` of a fresh weather agent on `api`'s model: (result, recorder)."""
    recorder = Recorder()

    async def run():
        agent = Agent(name="weather", instructions="You answer weather questions.", tools=[recorder.weather_tool()],
                      model=MODELS[api]("smol", recorder.client(backend_url)), output_type=output_type,
                      hooks=AnswerAfterTheTool(), reset_tool_choice=False,
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
        return await Runner.run(agent, QUESTION, max_turns=2, run_config=RunConfig(tracing_disabled=True))

    before = resumes(backend_url)
    result = asyncio.run(run())
    recorder.resumes = resumes(backend_url) - before
    return result, recorder


def assert_tool_then_cached_answer(result, recorder: Recorder) -> None:
    """Two model calls, both HTTP 200: the first called the tool (which ran once), the second (tool results
    appended to the same conversation) answered with most of its prompt reported cached."""
    assert recorder.statuses == [200, 200], recorder.statuses
    assert recorder.calls == ["Paris"]
    assert [body["tool_choice"] for body in recorder.bodies] == ["required", "none"]
    first, resumed = result.raw_responses
    assert [item.type for item in first.output] == ["function_call"]
    assert [item.type for item in resumed.output] == ["message"]
    cached, prompt = resumed.usage.input_tokens_details.cached_tokens, resumed.usage.input_tokens
    print(f"resumed step: {cached}/{prompt} prompt tokens cached")
    assert recorder.resumes == 1
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)


@pytest.mark.parametrize("api", sorted(MODELS))
def test_a_function_tool_agent_resumes_with_its_prompt_cached(backend_url, api):
    """A plain-text agent: the tool runs, and the step after it reuses the paused prompt."""
    result, recorder = run_agent(backend_url, api)
    assert_tool_then_cached_answer(result, recorder)
    assert isinstance(result.final_output, str) and result.final_output


@pytest.mark.parametrize("api", sorted(MODELS))
def test_an_output_type_agent_gets_a_validated_object(backend_url, api):
    """`output_type` goes out as `text.format` (Responses) or `response_format` (Chat Completions), a
    json_schema either way; the answer after the tool must parse into the pydantic model."""
    result, recorder = run_agent(backend_url, api, output_type=Weather)
    assert_tool_then_cached_answer(result, recorder)
    schema_of_answer = recorder.bodies[1]["text"]["format"] if api == "responses" else \
        recorder.bodies[1]["response_format"]
    assert schema_of_answer["type"] == "json_schema"
    assert isinstance(result.final_output, Weather) and result.final_output.city == "Paris"


def run_in_conversation(url: str, questions: list[str], **run_options) -> tuple[list, Recorder]:
    """`Runner.run` of the weather agent (Responses model) once per question, with `run_options` (a
    server-side conversation, or a session): the results and the recorder."""
    recorder = Recorder()
    client = recorder.client(url)
    options = {k: v(client) if callable(v) else v for k, v in run_options.items()}

    async def run():
        results = []
        for question in questions:
            agent = Agent(name="weather", instructions="You answer weather questions.",
                          tools=[recorder.weather_tool()], model=OpenAIResponsesModel("smol", client),
                          hooks=AnswerAfterTheTool(), reset_tool_choice=False,
                          model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
            results.append(await Runner.run(agent, question, max_turns=2, run_config=RunConfig(tracing_disabled=True),
                                            **options))
        return results

    before = resumes(url, "explicit") + resumes(url)
    results = asyncio.run(run())
    recorder.resumes = resumes(url, "explicit") + resumes(url) - before
    return results, recorder


def test_a_run_in_a_server_side_conversation_resumes_and_keeps_its_items(backend_url):
    """`Runner.run(conversation_id=...)`: each request sends only its new items with `conversation`; the
    step after the tool resumes the generation the conversation holds, and the conversation keeps both
    runs' items, the second run's prompt continuing the first's."""
    conversation = openai.OpenAI(base_url=backend_url, api_key="unused").conversations.create()
    results, recorder = run_in_conversation(backend_url, [QUESTION, "And in Rome?"],
                                            conversation_id=conversation.id)
    assert [body["conversation"] for body in recorder.bodies] == [conversation.id] * 4
    assert [item["type"] for item in recorder.bodies[1]["input"]] == ["function_call_output"]
    assert recorder.calls == ["Paris", "Rome"] and recorder.resumes == 2
    for result in results:
        assert_tool_then_cached_answer_in(result)
    first, second = results
    assert second.raw_responses[0].usage.input_tokens > first.raw_responses[1].usage.input_tokens
    items = list(openai.OpenAI(base_url=backend_url, api_key="unused").conversations.items.list(
        conversation.id, order="asc"))
    assert [item.type for item in items] == ["message", "function_call", "function_call_output", "message"] * 2


def test_a_conversations_session_stores_the_runs_items(agent_server_url):
    """`OpenAIConversationsSession`, the SDK's memory kept in a conversation (/v1/conversations): the
    second run reads the first's items back (parsed by the SDK), sends them whole, and its tool step
    resumes too."""
    from agents.memory import OpenAIConversationsSession

    results, recorder = run_in_conversation(agent_server_url, [QUESTION, "And in Rome?"],
                                            session=lambda client: OpenAIConversationsSession(openai_client=client))
    assert recorder.calls == ["Paris", "Rome"] and recorder.resumes == 2
    responses = [body for body in recorder.bodies if "input" in body]
    assert len(responses) == 4 and all("conversation" not in body for body in responses)
    history = [item.get("type", "message") for item in responses[2]["input"]]
    assert history == ["message", "function_call", "function_call_output", "message", "message"]
    for result in results:
        assert_tool_then_cached_answer_in(result)


def assert_tool_then_cached_answer_in(result) -> None:
    first, resumed = result.raw_responses
    assert [item.type for item in first.output] == ["function_call"]
    assert [item.type for item in resumed.output] == ["message"]
    cached, prompt = resumed.usage.input_tokens_details.cached_tokens, resumed.usage.input_tokens
    print(f"resumed step: {cached}/{prompt} prompt tokens cached")
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)


def test_a_hosted_mcp_tool_in_a_conversation_is_approved_and_resumes(agent_server_url, http_mcp):
    """A `HostedMCPTool` (the server runs the MCP server's tools) that asks for approval, in a server-side
    conversation: the first response ends with the approval request and the generation stays paused, held
    by the conversation; the SDK's `on_approval_request` approves, its next request brings only the
    `mcp_approval_response`, and the server runs the call and resumes the held generation."""
    from agents import HostedMCPTool
    from agents.model_settings import MCPToolChoice

    recorder, asked = Recorder(), []
    client = recorder.client(agent_server_url)
    conversation = openai.OpenAI(base_url=agent_server_url, api_key="unused").conversations.create()

    def approve(request):
        asked.append(request.data.name)
        return {"approve": True}

    tool = HostedMCPTool(tool_config={"type": "mcp", "server_label": "calc", "server_url": http_mcp,
                                      "require_approval": "always"}, on_approval_request=approve)

    async def run():
        agent = Agent(name="calc", instructions="You multiply with the multiply tool.", tools=[tool],
                      model=OpenAIResponsesModel("smol", client),
                      model_settings=ModelSettings(tool_choice=MCPToolChoice(server_label="calc", name="multiply"),
                                                   temperature=0, max_tokens=128, extra_args={"max_tool_calls": 1}))
        return await Runner.run(agent, "What is 6 times 7? Use the multiply tool.", max_turns=3, conversation_id=conversation.id,
                                run_config=RunConfig(tracing_disabled=True))

    before = resumes(agent_server_url, "explicit")
    result = asyncio.run(run())
    assert asked == ["multiply"] and recorder.statuses == [200, 200], (asked, recorder.statuses)
    assert resumes(agent_server_url, "explicit") == before + 1
    assert [item["type"] for item in recorder.bodies[1]["input"]] == ["mcp_approval_response"]
    assert all(body["conversation"] == conversation.id for body in recorder.bodies)
    first, approved = result.raw_responses
    assert [item.type for item in first.output] == ["mcp_list_tools", "mcp_approval_request"]
    assert [item.type for item in approved.output] == ["mcp_call", "message"] and approved.output[0].output == "42"
    cached, prompt = approved.usage.input_tokens_details.cached_tokens, approved.usage.input_tokens
    print(f"approved step: {cached}/{prompt} prompt tokens cached")
    assert cached >= MIN_CACHED_SHARE * prompt, (cached, prompt)
    items = openai.OpenAI(base_url=agent_server_url, api_key="unused").conversations.items.list(
        conversation.id, order="asc")
    assert [item.type for item in items] == ["message", "mcp_list_tools", "mcp_approval_request",
                                             "mcp_approval_response", "mcp_call", "message"]
