"""An answer that continues the conversation's final assistant message (a "prefill"), on the live server:
Chat Completions' `continue_final_message` (vLLM's field, with `add_generation_prompt` false) and the
Messages API's trailing assistant message (Anthropic's). The prompt ends inside that message, as
transformers' `continue_final_message` renders it, the answer is the continuation only, and it is token
for token what the same prompt gives as a plain completion."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from live_server import MODEL
from test_render import tokenize
from test_server import QUESTION as WEATHER, RESULT, TOOLS, greedy

QUESTION = {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
OPENED = {"role": "assistant", "content": "The capital of France is"}
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
LOOKING = {"role": "assistant", "content": "Let me check."}  # SmolLM2 continues it with a get_weather call
TOOL = {"name": "get_weather", "description": TOOLS[0]["function"]["description"],
        "input_schema": TOOLS[0]["function"]["parameters"]}


def continued_prompt(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True, return_dict=False)


def test_chat_continues_the_final_assistant_message(srv, tokenizer):
    client = srv.client()
    answer = client.chat.completions.create(messages=[QUESTION, OPENED], max_tokens=8, **greedy(),
                                            extra_body={**CONTINUE, "return_token_ids": True})
    prompt_ids, output_ids = answer.model_extra["prompt_token_ids"], answer.choices[0].model_extra["token_ids"]
    assert prompt_ids == continued_prompt(tokenizer, [QUESTION, OPENED])
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\nThe capital of France is")
    text = answer.choices[0].message.content
    assert text == tokenizer.decode(output_ids, skip_special_tokens=True) and "Paris" in text
    assert not text.startswith("The capital")  # the continuation only, as vLLM returns it
    plain = client.completions.create(prompt=prompt_ids, max_tokens=len(output_ids), **greedy(),
                                      extra_body={"return_token_ids": True})
    assert plain.choices[0].model_extra["token_ids"] == output_ids
    # /tokenize renders it alike; the same conversation without it would open a new turn instead.
    tokens = tokenize(srv, {"messages": [QUESTION, OPENED], **CONTINUE}).json()["tokens"]
    assert tokens == prompt_ids
    opened_anew = tokenize(srv, {"messages": [QUESTION, OPENED]}).json()["tokens"]
    assert tokenizer.decode(opened_anew).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_chat_without_the_generation_prompt_serves_the_conversation_as_history(srv, tokenizer):
    answer = srv.client().chat.completions.create(messages=[QUESTION], max_tokens=3, **greedy(),
                                                  extra_body={"add_generation_prompt": False, "return_token_ids": True})
    assert answer.model_extra["prompt_token_ids"] == tokenizer.apply_chat_template([QUESTION], tokenize=True,
                                                                                   return_dict=False)


def test_a_stream_continues_alike(srv):
    client = srv.client()
    full = client.chat.completions.create(messages=[QUESTION, OPENED], max_tokens=8, **greedy(), extra_body=CONTINUE)
    chunks = client.chat.completions.create(messages=[QUESTION, OPENED], max_tokens=8, stream=True, **greedy(),
                                            extra_body=CONTINUE)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content


@pytest.mark.parametrize("messages, extra, param", [
    ([QUESTION, OPENED], {"continue_final_message": True}, None),  # with the generation prompt too (vLLM's 400)
    ([QUESTION], CONTINUE, "messages"),  # no assistant message to continue
    ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}], CONTINUE, "messages"),
    ([QUESTION, OPENED], {**CONTINUE, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}]}, "tool_choice"),
    ([QUESTION, OPENED], {**CONTINUE, "session_id": "s-prefill"}, "session_id"),
])
def test_what_cannot_be_continued_is_a_400(srv, messages, extra, param):
    r = httpx.post(f"{srv.url}/chat/completions", json={**greedy(), "messages": messages, "max_tokens": 2, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_the_messages_api_continues_a_trailing_assistant_message_as_chat_does(srv):
    c = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=60)
    message = c.messages.create(model=MODEL, max_tokens=8, messages=[QUESTION, OPENED], extra_body={"temperature": 0})
    (block,) = message.content
    chat = srv.client().chat.completions.create(messages=[QUESTION, OPENED], max_tokens=8, **greedy(),
                                                extra_body=CONTINUE)
    assert block.type == "text" and block.text == chat.choices[0].message.content
    u = message.usage  # (Anthropic's input_tokens leave out what the cache held)
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = c.messages.count_tokens(model=MODEL, messages=[QUESTION, OPENED])
    assert counted.input_tokens == chat.usage.prompt_tokens


def continued_call_and_its_result(client, model: str):
    """A continued turn that ends in a call, then the request that sends its message back whole (the
    opening joined with the answer's content, the calls) with the result; checks that the second reads
    the whole paused context back (its prompt starts with it; all of it cached but the last token).
    Returns both responses, the message sent back and the results."""
    ask = dict(model=model, tools=TOOLS, temperature=0)
    first = client.chat.completions.create(**ask, messages=[*WEATHER, LOOKING], max_tokens=40,
                                           extra_body={**CONTINUE, "return_token_ids": True})
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", message
    paused = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    whole = {"role": "assistant", "content": LOOKING["content"] + (message.content or ""),
             "tool_calls": [c.model_dump() for c in message.tool_calls]}
    results = [{"role": "tool", "tool_call_id": c.id, "content": RESULT} for c in message.tool_calls]
    second = client.chat.completions.create(**ask, messages=[*WEATHER, whole, *results], max_tokens=8,
                                            extra_body={"return_token_ids": True})
    assert second.model_extra["prompt_token_ids"][:len(paused)] == paused
    assert second.usage.prompt_tokens_details.cached_tokens == len(paused) - 1
    return first, second, whole, results


def test_a_continued_turn_that_calls_resumes_when_its_message_comes_back_whole(srv):
    """A continued turn that ends in a call stays paused; the client sends its message back whole (the
    opening it wrote joined with the answer's content, the calls) with the result: the turn resumes (the
    whole paused context is read, from the continued prompt to the call's last token) and answers what
    the same prompt answers from scratch. Sent back as another assistant message after the opening, it is
    not the turn the model generated (the template renders two turns): served fresh."""
    client = srv.client()
    first, second, whole, results = continued_call_and_its_result(client, MODEL)
    message = first.choices[0].message
    assert first.usage.total_tokens - 1 == second.usage.prompt_tokens_details.cached_tokens
    prompt_ids, output_ids = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    again = client.completions.create(prompt=prompt_ids, max_tokens=len(output_ids), **greedy(),
                                      extra_body={"return_token_ids": True})
    assert again.choices[0].model_extra["token_ids"] == output_ids
    srv.assert_no_leak()

    client.chat.completions.create(messages=[*WEATHER, LOOKING], tools=TOOLS, max_tokens=40, **greedy(),
                                   extra_body=CONTINUE)
    apart = {"role": "assistant", "content": message.content, "tool_calls": whole["tool_calls"]}
    fresh = client.chat.completions.create(messages=[*WEATHER, LOOKING, apart, *results], tools=TOOLS,
                                           max_tokens=2, **greedy())
    assert fresh.usage.prompt_tokens_details.cached_tokens < first.usage.total_tokens - 16
    srv.abort_paused()


def test_the_messages_api_resumes_a_continued_turn_sent_back_after_its_prefill(srv):
    """Anthropic's SDK loop appends the answer after the prefill as a message of its own; Anthropic
    combines consecutive messages of one role into one turn, so the server does too: the prefill and the
    answer are the continued turn's message, which resumes the paused generation."""
    c = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=60)
    ask = dict(model=MODEL, tools=[TOOL], extra_body={"temperature": 0})
    first = c.messages.create(**ask, max_tokens=40, messages=[*WEATHER, LOOKING])
    assert first.stop_reason == "tool_use", first
    uses = [b for b in first.content if b.type == "tool_use"]
    sent_back = [*WEATHER, LOOKING, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": RESULT} for u in uses]}]
    second = c.messages.create(**ask, max_tokens=4, messages=sent_back)
    u = first.usage
    assert second.usage.cache_read_input_tokens == u.input_tokens + u.cache_read_input_tokens + u.output_tokens - 1
    srv.assert_no_leak()


def test_a_continued_turn_that_calls_resumes_on_either_backend(backend_url):
    """The same resume of a continued turn on the native engine and on vLLM (the turn layer keeps the
    pause either way): the whole paused context is read back."""
    import openai

    client = openai.OpenAI(base_url=backend_url, api_key="unused", max_retries=0, timeout=120)
    continued_call_and_its_result(client, "smol")
