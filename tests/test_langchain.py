"""ChatInferCept against the live server with the embedded model: langchain-tests' standard suites,
a create_agent ReAct loop whose resumed steps reuse their prompt, the LangGraph thread as session, and
the examples (short outputs) so they cannot rot."""
from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import httpx
import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from langgraph.checkpoint.memory import InMemorySaver
from pydantic import BaseModel, Field

from infercept.integrations.langchain import ChatInferCept
from infercept.integrations.langchain.chat_models import session_id_for_thread
from infercept.integrations.openai.clients import DEFAULT_MODEL, client
from live_server import resumes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL_MODEL = "the 135M model cannot do this reliably"


@pytest.fixture(scope="module")
def base_url(agent_server_url):
    return agent_server_url


class TestChatInferCeptUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatInferCept

    @property
    def chat_model_params(self):
        return {"model": "smol", "base_url": "http://127.0.0.1:9/v1"}

    @property
    def init_from_env_params(self):
        return ({"INFERCEPT_BASE_URL": "http://127.0.0.1:9/v1", "INFERCEPT_API_KEY": "k", "INFERCEPT_MODEL": "m"}, {},
                {"openai_api_base": "http://127.0.0.1:9/v1", "openai_api_key": "k", "model_name": "m"})


# The standard suite's async tests carry no asyncio mark: LangChain's packages run pytest-asyncio in auto
# mode, this project in strict mode. They are marked here, in place (an override would count as a changed
# standard test), to run on one event loop: langchain-openai caches its async HTTP client across model
# instances, bound to the loop that first used it.
ON_SHARED_LOOP = pytest.mark.asyncio(loop_scope="session")
for _name, _test in inspect.getmembers(ChatModelIntegrationTests, inspect.iscoroutinefunction):
    if _name.startswith("test_"):
        ON_SHARED_LOOP(_test)

# What the model writes for "Tell me a joke about cats." under the suite's Joke schema (no length limits):
# '{"setup": "A cat is a cat, right? A cat is a cat, a cat is a cat, ...' until max_tokens. The grammar
# keeps it valid JSON, but a string that never ends cannot be closed (test_structured_output_stays_valid
# below shows the same API with a bounded schema).
ENDLESS_JOKE = "the 135M model repeats itself inside the joke's setup string until max_tokens"


class TestChatInferCeptIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _server(self, base_url, monkeypatch):
        monkeypatch.setenv("INFERCEPT_BASE_URL", base_url)

    @property
    def chat_model_class(self):
        return ChatInferCept

    @property
    def chat_model_params(self):
        # Room for a tool call or a small JSON object (a get_weather call is about 30 tokens).
        return {"model": "smol", "temperature": 0, "max_tokens": 48, "max_retries": 0, "timeout": 120}

    @property
    def supports_json_mode(self):
        return True

    @property
    def model_override_value(self):
        # The server answers to its served name ("smol") and to its model folder's name.
        return DEFAULT_MODEL

    @pytest.mark.xfail(reason=ENDLESS_JOKE, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model, schema_type):
        super().test_structured_output(model, schema_type)

    @ON_SHARED_LOOP
    @pytest.mark.xfail(reason=ENDLESS_JOKE, strict=False)
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model, schema_type):
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=ENDLESS_JOKE, strict=False)
    def test_structured_output_pydantic_2_v1(self, model):
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason=ENDLESS_JOKE, strict=False)
    def test_structured_output_optional_param(self, model):
        super().test_structured_output_optional_param(model)

    @pytest.mark.xfail(reason="json_mode guarantees a JSON object, not its keys: asked for setup and punchline, the "
                              "135M model writes only the setup", strict=False)
    def test_json_mode(self, model):
        super().test_json_mode(model)

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = self.chat_model_class(**self.chat_model_params)
        prompt = "Hello"
        model.invoke(prompt)
        if stream:
            full = None
            for chunk in model.stream(prompt):
                full = chunk if full is None else full + chunk
            return full
        return model.invoke(prompt)  # the same prompt again: its blocks are reused


def weather_station():
    """get_weather that answers each city once; asked again, it says it already did and nudges the
    model to answer (the 135M model otherwise keeps repeating the call). Returns (tool, cities asked)."""
    asked: list[str] = []

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        repeated = city in asked
        asked.append(city)
        if repeated:
            return f"You already have it: sunny, 24 C in {city}. Now answer the user's question without calling a tool."
        return f"Sunny, 24 C in {city}."

    return get_weather, asked


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    from infercept.tools.calculator import evaluate, format_number

    return format_number(evaluate(expression))


def test_react_agent_resumes_every_step(base_url):
    get_weather, asked = weather_station()
    model = ChatInferCept(base_url=base_url, model="smol", temperature=0, max_tokens=48, max_retries=0)
    agent = create_agent(model, tools=[get_weather, calculator], checkpointer=InMemorySaver())
    before = resumes(base_url, "explicit")  # (the thread is a named session: its steps resume it by name)
    result = agent.invoke({"messages": [{"role": "user", "content": "What is the weather in Paris?"}]},
                          {"configurable": {"thread_id": "react test 1"}, "recursion_limit": 12})
    steps = [m for m in result["messages"] if isinstance(m, AIMessage)]
    reuse = [m.usage_metadata["input_token_details"]["cache_read"] / m.usage_metadata["input_tokens"] for m in steps]
    print("reuse per step:", [f"{r:.1%}" for r in reuse])
    assert len(steps) >= 3 and asked[:2] == ["Paris", "Paris"]
    assert all(m.tool_calls for m in steps[:-1]) and not steps[-1].tool_calls
    assert all(r >= 0.9 for r in reuse[1:]), reuse
    assert resumes(base_url, "explicit") == before + len(steps) - 1
    assert "24" in steps[-1].text or "sunny" in steps[-1].text.lower()  # the answer comes from the tool
    assert sum(isinstance(m, ToolMessage) for m in result["messages"]) == len(steps) - 1


def test_thread_id_becomes_the_session_id():
    assert session_id_for_thread("t-1") == "t-1"
    hashed = session_id_for_thread("user 42 / chat 7")
    assert hashed.startswith("thread-") and hashed == session_id_for_thread("user 42 / chat 7")
    model = ChatInferCept(model="smol")
    from langchain_core.runnables.config import var_child_runnable_config

    token = var_child_runnable_config.set({"configurable": {"thread_id": "t-1"}})
    try:
        assert model._get_request_payload("Hi")["extra_body"] == {"session_id": "t-1"}
    finally:
        var_child_runnable_config.reset(token)
    assert "extra_body" not in model._get_request_payload("Hi")
    assert "extra_body" not in ChatInferCept(model="smol", use_thread_sessions=False)._get_request_payload("Hi")


def test_the_responses_api_gets_no_session_id():
    """The Responses API has no session_id (it would be a 400): a chain there continues by
    previous_response_id, and the thread's hint is left out."""
    from langchain_core.runnables.config import var_child_runnable_config

    model = ChatInferCept(model="smol", use_responses_api=True)
    token = var_child_runnable_config.set({"configurable": {"thread_id": "t-1"}})
    try:
        payload = model._get_request_payload("Hi")
    finally:
        var_child_runnable_config.reset(token)
    assert "input" in payload and "extra_body" not in payload


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_langchain_react_agent(base_url, capsys):
    steps = load_example("langchain_react_agent").main(["--base-url", base_url, "--model", "smol", "--max-tokens", "48"])
    out = capsys.readouterr().out
    assert "step 1:" in out and "answer:" in out and not steps[-1].tool_calls


def test_example_openai_tool_loop(base_url, capsys):
    answer = load_example("openai_tool_loop").main(["--base-url", base_url, "--model", "smol", "--max-tokens", "48"])
    out = capsys.readouterr().out
    assert "step 2:" in out and "reused" in out and answer


# A forced call takes about 20 tokens; the answer after it stops at the same bound.
MCP_EXAMPLE_ARGS = ["--model", "smol", "--max-tokens", "32"]


def assert_one_mcp_step(items: list[dict], input_tokens: int, cached_tokens: int, first: bool) -> None:
    """One step of the MCP examples (its output items as dicts): the tools listed on the first step, one
    multiply call that the MCP server answered with the product of the model's own arguments, and the
    resumed turn after it reusing the paused context: about half of the step's input (its two turns'
    prompts add up), whatever a prefix cache adds."""
    kinds = [i["type"] for i in items if i["type"].startswith("mcp_")]
    assert kinds[-1] == "mcp_call" and kinds.count("mcp_call") == 1 and (kinds[0] == "mcp_list_tools" or not first), \
        kinds
    (call,) = [i for i in items if i["type"] == "mcp_call"]
    args = json.loads(call["arguments"])
    assert call["name"] == "multiply" and call["server_label"] == "calc" and call.get("error") is None, call
    assert call["output"] == str(args["a"] * args["b"]), call
    assert cached_tokens >= 0.4 * input_tokens, (cached_tokens, input_tokens)


def test_example_mcp_agent(base_url, capsys):
    steps = load_example("mcp_agent").main(["--base-url", base_url, *MCP_EXAMPLE_ARGS])
    out = capsys.readouterr().out
    assert len(steps) == 3 and "step 3:" in out and "mcp_call calc/multiply(" in out and "reused" in out
    for i, r in enumerate(steps):
        usage = r.usage
        assert_one_mcp_step([o.model_dump() for o in r.output], usage.input_tokens,
                            usage.input_tokens_details.cached_tokens, first=i == 0)
        assert r.output[-1].type == "message" and r.previous_response_id == (steps[i - 1].id if i else None)


def test_example_langchain_mcp_agent(base_url, capsys):
    steps = load_example("langchain_mcp_agent").main(["--base-url", base_url, *MCP_EXAMPLE_ARGS])
    out = capsys.readouterr().out
    assert len(steps) == 3 and "step 3:" in out and "mcp_call calc/multiply(" in out and "reused" in out
    server = client(base_url=base_url)
    for i, message in enumerate(steps):
        usage = message.usage_metadata
        assert_one_mcp_step(message.content, usage["input_tokens"], usage["input_token_details"]["cache_read"],
                            first=i == 0)
        assert not message.tool_calls and message.text  # the server ran the call: nothing for the agent to run
        stored = server.responses.retrieve(message.response_metadata["id"])  # chained by previous_response_id
        assert stored.previous_response_id == (steps[i - 1].response_metadata["id"] if i else None)


class City(BaseModel):
    """A city and how many people live there."""

    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=10 ** 8)


def test_structured_output_stays_valid(base_url):
    """with_structured_output by the server's json_schema response_format: what comes back, invoked or
    streamed, is an instance of the schema (a schema whose strings are bounded, so the 135M model's
    output always ends; see ENDLESS_JOKE)."""
    model = ChatInferCept(base_url=base_url, model="smol", temperature=0, max_tokens=48, max_retries=0)
    structured = model.with_structured_output(City, include_raw=True)
    out = structured.invoke("Give me a city and its population.")
    assert isinstance(out["parsed"], City) and out["parsing_error"] is None
    assert out["raw"].response_metadata["finish_reason"] == "stop"
    chunks = list(model.with_structured_output(City).stream("Give me a city and its population."))
    assert chunks and chunks[-1] == out["parsed"]


def paused_generations(base_url: str) -> int:
    """Paused generations as the server's /metrics reports them (the engine's own count, every KV state)."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=30).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("infercept_paused_requests{"))


def test_function_calling_structured_output_is_an_answer_not_a_pause(base_url):
    """with_structured_output(method="function_calling") sends the schema as the only tool with a tool_choice
    naming it: the call comes back and parses into the schema, and the server ends the generation instead
    of pausing it (no tool result will ever come for that call)."""
    model = ChatOpenAI(base_url=base_url, api_key="unused", model="smol", temperature=0, max_tokens=64, max_retries=0)
    structured = model.with_structured_output(City, method="function_calling", include_raw=True)
    before = paused_generations(base_url)
    out = structured.invoke("Give me a city and its population.")
    assert isinstance(out["parsed"], City) and out["parsing_error"] is None
    assert out["raw"].response_metadata["finish_reason"] == "tool_calls"
    assert paused_generations(base_url) == before
