"""POST /v1/messages (Anthropic's Messages API) against the live server, driven by the official
`anthropic` SDK: a tool loop resumes the paused generation (the result's turn reads the paused context
from the cache), the same conversation renders the same prompt and greedy answer through Chat
Completions, streams build the same message as non-streamed requests, stop sequences and token counts
are Anthropic's, and errors have Anthropic's shape."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import pytest
from live_server import MODEL
from pydantic import BaseModel, Field

TOOL = {"name": "get_weather", "description": "Get the current weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
OPENAI_TOOL = {"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                                "parameters": TOOL["input_schema"]}}
SYSTEM = "You are a helpful assistant."
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature": 21, "sky": "clear"}'
GREEDY = {"temperature": 0}  # as extra_body: this SDK's create() has no temperature argument


def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=60)


def call_turn(c: anthropic.Anthropic, **kw):
    first = c.messages.create(model=MODEL, max_tokens=40, system=SYSTEM, messages=QUESTION, tools=[TOOL],
                              tool_choice={"type": "any"}, extra_body=GREEDY, **kw)
    assert first.stop_reason == "tool_use" and first.stop_sequence is None, first
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    return first, use


def with_result(first, use) -> list[dict]:
    """The conversation an agent sends next: the answer as it came, then the tool's result."""
    return QUESTION + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                     "content": [{"type": "text", "text": RESULT}]}]}]


def test_a_tool_loop_resumes_the_paused_generation_and_matches_chat_completions(srv):
    c = client(srv)
    first, use = call_turn(c)
    assert first.id.startswith("msg_") and first.model == MODEL and first.role == "assistant"
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens > 100
    conversation = with_result(first, use)
    second = c.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=conversation, tools=[TOOL],
                               extra_body=GREEDY)
    u = second.usage
    # The paused context (the question, the call as generated) is read from the cache; the tool result
    # and the generation prompt are what is computed.
    assert u.cache_read_input_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1, u
    assert 0 < u.input_tokens < 40, u
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"

    # The same conversation through Chat Completions, on a fresh generation: the same prompt, the same text.
    messages = [{"role": "system", "content": SYSTEM}, *QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                {"role": "tool", "tool_call_id": use.id, "content": RESULT}]
    srv.abort_paused()
    chat = srv.client().chat.completions.create(model=MODEL, messages=messages, tools=[OPENAI_TOOL], max_tokens=12,
                                                temperature=0)
    assert chat.usage.prompt_tokens == u.input_tokens + u.cache_read_input_tokens
    assert chat.choices[0].message.content == second.content[0].text
    assert chat.usage.completion_tokens == u.output_tokens


def test_a_stream_builds_the_message_a_request_gets_whole(srv):
    c = client(srv)
    forced = dict(model=MODEL, max_tokens=40, system=SYSTEM, messages=QUESTION, tools=[TOOL],
                  tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    with httpx.stream("POST", srv.base + "/v1/messages", json={**forced, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names  # each event's name is its data's type
    # One tool_use block whose arguments stream as they are generated, in several pieces.
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 3, names
    assert data[1]["content_block"]["type"] == "tool_use" and data[1]["content_block"]["input"] == {}
    assert json.loads("".join(d["delta"]["partial_json"] for d in data[2:2 + deltas])) == {"city": "Paris"}
    assert data[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    srv.abort_paused()
    with c.messages.stream(**{k: v for k, v in forced.items() if k != "temperature"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    srv.abort_paused()
    whole = c.messages.create(model=MODEL, max_tokens=40, system=SYSTEM, messages=QUESTION, tools=[TOOL],
                              tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [(b.type, b.name, b.input) for b in whole.content]
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert streamed.usage.output_tokens == whole.usage.output_tokens

    # A text answer streams as text deltas that join into the text of the same request made whole.
    ask = dict(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Tell me about Paris."}],
               extra_body=GREEDY)
    with c.messages.stream(**ask) as stream:
        pieces = list(stream.text_stream)
        streamed = stream.get_final_message()
    whole = c.messages.create(**ask)
    assert len(pieces) > 3 and "".join(pieces) == streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason == "max_tokens"


def test_a_stop_sequence_ends_the_message_and_is_named(srv):
    c = client(srv)
    ask = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Tell me about Paris."}],
               extra_body=GREEDY)
    text = c.messages.create(**ask).content[0].text
    word = text.split()[3]
    stopped = c.messages.create(**ask, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text.startswith(stopped.content[0].text) and word not in stopped.content[0].text


def test_vllms_cache_salt_and_chat_template_kwargs(srv):
    """vLLM's extras, as on Chat Completions: `cache_salt` keeps the prompt's cached blocks apart (a new
    salt reads none, its repeat reads them), and `chat_template_kwargs` reaches the chat template (a name
    the server sets itself is refused; so count_tokens reads it too)."""
    c = client(srv)
    ask = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Tell me about Lyon, briefly."}])

    def cache_read(**extra) -> int:
        return c.messages.create(**ask, extra_body={**GREEDY, **extra}).usage.cache_read_input_tokens

    cache_read()
    assert cache_read() > 16
    assert cache_read(cache_salt="messages-salt") == 0 and cache_read(cache_salt="messages-salt") > 16
    for refused in (lambda: c.messages.create(**ask, extra_body={"chat_template_kwargs": {"tools": []}}),
                    lambda: c.messages.count_tokens(model=MODEL, messages=ask["messages"],
                                                    extra_body={"chat_template_kwargs": {"tools": []}})):
        with pytest.raises(anthropic.BadRequestError, match="chat_template_kwargs"):
            refused()


def test_count_tokens_counts_the_prompt_a_message_is_served_with(srv):
    c = client(srv)
    counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION, tools=[TOOL])
    srv.abort_paused()
    served = c.messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=QUESTION, tools=[TOOL])
    assert counted.input_tokens == served.usage.input_tokens + served.usage.cache_read_input_tokens > 100


def test_consecutive_messages_of_one_role_are_one_turn(srv):
    """As Anthropic combines them: two user messages in a row render as one user message of both texts
    (joined by a newline), two assistant messages as one of both texts as they are."""
    c = client(srv)

    def counted(messages) -> int:
        return c.messages.count_tokens(model=MODEL, messages=messages).input_tokens

    assert counted([{"role": "user", "content": "Hello."}, {"role": "user", "content": "Who are you?"}]) == \
        counted([{"role": "user", "content": "Hello.\nWho are you?"}])
    said = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "assistant", "content": [{"type": "text", "text": " there."}]}, {"role": "user", "content": "Bye"}]
    assert counted(said) == counted([said[0], {"role": "assistant", "content": "Hello there."}, said[3]])


def test_claude_codes_attribution_block_is_not_rendered(srv):
    """Claude Code's first system block carries a hash of the conversation's first message: rendered, no
    two conversations would share their system prompt's KV. It is left out; the rest is the prompt."""
    c = client(srv)
    plain = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION).input_tokens
    for digest in ("342", "34c"):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.{digest}; cc_entrypoint=cli;"},
                  {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        assert c.messages.count_tokens(model=MODEL, system=system, messages=QUESTION).input_tokens == plain


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    sunny: bool


def test_a_structured_answer_follows_output_config_format(srv):
    """The SDK's `messages.parse(output_format=Model)` sends `output_config.format` (a JSON schema): the
    answer is constrained to it, so the SDK parses it into the model."""
    c = client(srv)
    parsed = c.messages.parse(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Is it sunny in Rome?"}],
                              output_format=Forecast, extra_body=GREEDY)
    assert parsed.stop_reason == "end_turn", parsed
    assert isinstance(parsed.parsed_output, Forecast), parsed.content
    bad = {"model": MODEL, "max_tokens": 5, "messages": QUESTION,
           "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}
    r = httpx.post(srv.base + "/v1/messages", json=bad, timeout=30)
    assert r.status_code == 400 and "output_config.format" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body, status, kind, says", [
    ({"model": "claude-x", "max_tokens": 5, "messages": QUESTION}, 404, "not_found_error", "does not exist"),
    ({"model": MODEL, "messages": QUESTION}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": QUESTION, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     400, "invalid_request_error", "'image' blocks"),
    ({"model": MODEL, "max_tokens": 5, "messages": QUESTION,
      "tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]},
     400, "invalid_request_error", "hosted tools"),
    ({"model": MODEL, "max_tokens": 5, "messages": QUESTION + [
        {"role": "assistant", "content": "Let me see."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
     400, "invalid_request_error", "toolu_1"),
    ({"model": MODEL, "max_tokens": 5, "messages": QUESTION, "tool_choice": {"type": "tool"}}, 400,
     "invalid_request_error", "tool_choice.name"),
    ({"model": MODEL, "max_tokens": 5, "messages": QUESTION + [{"role": "assistant", "content": "It is "}]}, 400,
     "invalid_request_error", "trailing whitespace"),
])
def test_errors_have_anthropics_shape(srv, body, status, kind, says):
    r = httpx.post(srv.base + "/v1/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"], error


def test_the_sdk_lists_and_retrieves_the_served_model(srv):
    c = client(srv)
    (listed,) = c.models.list().data
    assert listed.id == MODEL and listed.type == "model" and listed.display_name == MODEL
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(anthropic.NotFoundError):
        c.models.retrieve("claude-x")


def test_the_sdk_raises_its_own_errors(srv):
    c = client(srv)
    with pytest.raises(anthropic.NotFoundError) as raised:
        c.messages.create(model="claude-x", max_tokens=5, messages=QUESTION)
    assert raised.value.body["error"]["type"] == "not_found_error"
    # OpenAI's routes keep OpenAI's shape.
    r = httpx.post(srv.url + "/chat/completions", json={"model": "claude-x", "messages": QUESTION}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_anthropic_tool_loop_example_runs(srv):
    example = Path(__file__).resolve().parents[1] / "examples" / "anthropic_tool_loop.py"
    out = subprocess.run([sys.executable, str(example), "--base-url", srv.base, "--max-steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first.startswith("step 1:") and "calls get_weather" in first
    assert second.startswith("step 2:") and int(second.split("(")[1].split("%")[0]) >= 90, out.stdout
    srv.abort_paused()  # the example may stop at a paused step
    srv.assert_no_leak()
