"""LiteLLM (the client under CrewAI, Aider, OpenHands and smolagents' LiteLLMModel), unmodified, against the
live server with the embedded model on each backend, through both of the providers its users name a vLLM
server by (`hosted_vllm/`, `openai/` with an `api_base`), non-streamed and streamed (the message rebuilt by
`litellm.stream_chunk_builder`): a tool call, then the conversation sent back with the message as LiteLLM
returns it and the tool's result, which resumes the paused generation."""
from __future__ import annotations

import json
import os

import pytest
from live_server import resumes

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its import would fetch a price list from GitHub
litellm = pytest.importorskip("litellm")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# What LiteLLM's own code warns of under this pydantic (its provider models as it loads them, its stream
# chunks' copies): nothing of this test's.
pytestmark = [pytest.mark.filterwarnings("ignore:Item.* on TypedDict class:UserWarning"),
              pytest.mark.filterwarnings("ignore:Accessing the 'model_.*fields' attribute on the instance:DeprecationWarning")]


def complete(backend_url: str, provider: str, stream: bool, messages: list[dict], **kw):
    args = dict(model=f"{provider}/smol", api_base=backend_url, api_key="unused", messages=messages, tools=TOOLS,
                temperature=0, max_tokens=40, **kw)
    if not stream:
        return litellm.completion(**args)
    chunks = list(litellm.completion(**args, stream=True, stream_options={"include_usage": True}))
    return litellm.stream_chunk_builder(chunks, messages=messages)


@pytest.mark.parametrize("provider, stream", [("hosted_vllm", False), ("openai", True)])
def test_a_litellm_tool_loop_resumes_the_paused_generation(backend_url, provider, stream):
    base = backend_url.removesuffix("/v1")
    before = resumes(base)
    first = complete(backend_url, provider, stream, QUESTION, tool_choice="required")
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    conversation = QUESTION + [message.model_dump(), {"role": "tool", "tool_call_id": call.id,
                                                      "content": '{"temperature": 21, "sky": "clear"}'}]
    answer = complete(backend_url, provider, stream, conversation, tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert resumes(base) == before + 1
    # The whole paused context but its last token (sampled, never fed back) read from the cache.
    assert answer.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1, answer.usage
