"""Thinking models (--reasoning-parser): the split of <think>...</think>, and a paused generation whose
thinking survives the tool call.

Qwen3's chat template drops earlier turns' thinking from the history a client sends back, so that
history no longer renders to the paused generation's tokens. The end-to-end tests serve a tiny random
Qwen3 model (built here: transformers' Qwen3ForCausalLM saved with safetensors, a byte-level BPE
tokenizer trained on a few sentences with <think>, </think>, <tool_call>, ... as added tokens, and a
Qwen3-style template written for this test) and check that the request bringing the tool result
resumes the paused generation, thinking included: every paused token is cached, and the greedy answer
equals a fresh run of the whole context (thinking included) on the same engine.

A random model neither thinks nor calls on its own: its first turn is forced by a grammar (the server's
grammar hook, patched for that request) to think (free lowercase text the model picks) and then call.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import replace

import openai
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from infercept.engine.backend import ToolFormat
from infercept.engine.hermes_format import call_start, json_grammar_schema
from infercept.engine.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from infercept.engine.sampling_params import GuidedDecodingParams
from infercept.engine.tool_format import CallJudge, ToolSpec
from infercept.server import turns as turns_module
from infercept.server.chat import AssistantTurn, ChatRenderer, Message, Call
from live_server import MODEL, LiveServer
from test_architectures import randomize

# -- the reasoning parsers, on text -----------------------------------------------------------------

QWEN3, R1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_qwen3_splits_thinking_from_content():
    split = QWEN3.split("<think>\nThe user wants Paris.\n\n</think>\n\nIt is sunny.")
    assert (split.reasoning, split.content) == ("The user wants Paris.", "It is sunny.")
    # No thinking: all content (leading blanks included, as the tool parser reads it).
    assert QWEN3.split("\nIt is sunny.").reasoning is None
    assert QWEN3.split("\nIt is sunny.").content == "\nIt is sunny."
    # A turn cut while thinking (max_tokens): the thinking so far, no answer.
    assert QWEN3.split("<think>\nhmm, Paris").reasoning == "hmm, Paris"
    assert QWEN3.split("<think>\nhmm, Paris").content == ""
    # An empty thinking block (Qwen3 with thinking switched off writes one).
    assert (QWEN3.split("<think>\n\n</think>\n\nHi").reasoning, QWEN3.split("<think>\n\n</think>\n\nHi").content) \
        == ("", "Hi")
    # Only a turn that opens with <think> thinks: a </think> later in the answer is content.
    assert QWEN3.split("x</think>y") == QWEN3.split("x</think>y", final=False)
    assert QWEN3.split("x</think>y").reasoning is None


def test_deepseek_r1_thinks_from_the_first_token():
    assert (R1.split("The user wants Paris.\n</think>\n\nSunny.").reasoning,
            R1.split("The user wants Paris.\n</think>\n\nSunny.").content) == ("The user wants Paris.", "Sunny.")
    assert R1.split("<think>a</think>b").reasoning == "a"
    assert (R1.split("still thinking").reasoning, R1.split("still thinking").content) == ("still thinking", "")


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", [
    "<think>\nLet me call it.\n</think>\n\n" + CALL,
    "  <think>\n\n</think>\n\nSunny, 21 degrees.",
    "<think>I could write " + CALL + " but first</think>answer",
    "<think>\nno end",
    "plain answer </think> here",
])
def test_a_stream_shows_prefixes_of_the_final_split(name, text):
    """Cut anywhere (inside <think>, inside </think>, inside the newlines around them): what a stream may
    show of the reasoning and of the content is a prefix of the final split of each."""
    parser = get_reasoning_parser(name)
    final = parser.split(text)
    for k in range(len(text) + 1):
        partial = parser.split(text[:k], final=False)
        if partial.reasoning is not None:
            assert final.reasoning is not None and final.reasoning.startswith(partial.reasoning), (k, partial)
        assert final.content.startswith(partial.content), (k, partial)
        if text[:k].startswith("<think>") and "</think>" not in text[:k]:
            assert partial.content == ""  # nothing leaks to the content while the model thinks
    assert parser.split(text, final=False).content == final.content or "</think>" not in text


def test_module_imports_only_stdlib():
    """The engine's output stage, the vLLM backend's judge and `infercept --help` import it: no torch."""
    from pathlib import Path

    from stdlib_only import non_stdlib_imports

    assert non_stdlib_imports(Path(__file__).resolve().parents[1] / "engine" / "reasoning_parsers.py") == []


def test_glms_names_read_turns_as_qwen3_does():
    for name in ("glm45", "glm47"):
        parser = get_reasoning_parser(name)
        assert isinstance(parser, type(QWEN3)) and parser.split("<think>a</think>b") == QWEN3.split("<think>a</think>b")
        assert parser.after_prompt("[gMASK]<sop><|user|>\nHi<|assistant|><think>").split("a</think>b").reasoning == "a"


def test_unknown_reasoning_parser():
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("o1")


TOOL = ToolSpec.function("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]})


def test_calls_are_read_after_the_thinking_only():
    judge = CallJudge("hermes", [TOOL], reasoning="qwen3")
    # A call written while thinking is no call, and a turn still thinking is not done.
    thinking = "<think>\nmaybe " + CALL + "\nor not"
    assert judge.judge(thinking) is None and not judge.turn_done(thinking + "\n")
    assert judge.judge(thinking + "\n</think>\n\nIt is sunny.") is None
    # The call after the thinking counts; the verdict's content leaves the thinking out.
    verdict = judge.judge("<think>\nI should call " + CALL + "\n</think>\n\nLet me check.\n" + CALL)
    assert [c.name for c in verdict.calls] == ["get_weather"] and verdict.complete
    assert verdict.content == "Let me check."
    # Without a reasoning parser the same text has two calls (the one in the thinking included).
    assert len(CallJudge("hermes", [TOOL]).judge("<think>\n" + CALL + "\n</think>\n" + CALL).calls) == 2
    # <think> inside a call's arguments (qwen3: the turn did not open with <think>) stays in the arguments.
    odd = CALL.replace('"Paris"', '"<think>Paris</think>"')
    (call,) = judge.judge(odd).calls
    assert json.loads(call.arguments) == {"city": "<think>Paris</think>"}


def test_tool_choice_none_leaves_a_thinking_model_free_to_think():
    """The no-call grammar refuses a turn that opens with "<" (a call's opener): with a reasoning parser
    tool_choice none goes unconstrained instead (a call written anyway is content), so the model thinks."""
    from infercept.engine.sampling_params import SamplingParams
    from infercept.server.tool_mode import tool_mode, with_grammar

    mode, params = tool_mode([TOOL], "none"), SamplingParams(max_tokens=4)
    assert with_grammar(ToolFormat("hermes"), params, mode, None).guided is not None
    assert with_grammar(ToolFormat("hermes"), params, mode, None, thinking=True).guided is None


def test_serve_flag():
    from infercept.server.cli import build_parser, server_settings

    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert server_settings(args).reasoning_parser == "qwen3"
    assert server_settings(build_parser().parse_args(["serve"])).reasoning_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "nope"])


# -- a tiny Qwen3-style model ------------------------------------------------------------------------

# A Qwen3-style chat template, written for this test: ChatML turns, Hermes tool calls, tool results as
# user turns, and thinking shown only in the last assistant turn (an empty block when it has none);
# earlier turns' thinking is dropped, so a turn followed by its tool results renders without it.
TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\nTo call a tool write <tool_call>\n{"name": NAME, "arguments": ARGUMENTS}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- set thinking = message.reasoning_content or '' %}
{%- if '</think>' in content %}
{%- set thinking = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.last %}{{- '<think>\n' + thinking.strip('\n') + '\n</think>\n\n' }}{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
"""
OPENS_THINKING = ("{{- '<|im_start|>assistant\\n' }}{%- endif %}",
                  "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")  # a thinking-only model's template


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CORPUS = ["what is the weather in paris today", "the sky is clear and the temperature is warm",
          "let me think about which city the user means", "call the tool to get the weather first",
          '{"name": "get_weather", "arguments": {"city": "Paris"}}', "system user assistant tools type function",
          '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}']


def build_model(folder, template: str = TEMPLATE) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])  # kept in decoded text
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = template.strip()
    fast.save_pretrained(folder)
    config = Qwen3Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"), pad_token_id=fast.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).eval()
    randomize(model, seed=0)  # logits far apart: greedy choices are no near-ties
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    build_model(folder)
    return str(folder)


@pytest.fixture(scope="module")
def srv(qwen3_dir):
    # No prefix cache: a fresh run of a context recomputes all of it, and a resume reuses only what the
    # paused generation kept.
    server = LiveServer(qwen3_dir, "preserve", prefix_caching=False, reasoning_parser="qwen3")
    yield server
    server.close()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = "clear, 21 degrees"


def think_then_call_grammar(answer: bool = False, opened: bool = False) -> str:
    """A turn that thinks (8 to 24 lowercase letters and spaces, as the model picks them), then calls
    get_weather (arguments per its schema: the model picks the city), or with `answer` answers in 4 to
    12 of those characters; `opened`: the prompt opened the thinking. The markers are single tokens
    (`<think>`: llguidance's token syntax), as a Qwen3 model writes them."""
    schema = json.dumps(json_grammar_schema(TOOLS[0]["function"]["parameters"]))
    then = "ANSWER" if answer else '<tool_call> CALL args "}\\n" </tool_call>'
    return "\n".join([
        "start: " + ("" if opened else '<think> "\\n" ') + f'THINK "\\n" </think> "\\n\\n" {then}',
        "THINK: /[a-z ]{8,24}/",
        "ANSWER: /[a-z][a-z ]{3,11}/",
        f"CALL: {json.dumps(call_start('get_weather')[len('<tool_call>'):])}",
        f"args: %json {schema}"])


@contextlib.contextmanager
def forced_thinking_call(answer: bool = False, opened: bool = False):
    """While in the block, every chat turn the server opens is constrained to think and then call (or
    answer)."""
    original = turns_module.with_grammar
    turns_module.with_grammar = lambda fmt, params, *args: replace(
        params, guided=GuidedDecodingParams(lark=think_then_call_grammar(answer, opened)))
    try:
        yield
    finally:
        turns_module.with_grammar = original


def greedy(**kw) -> dict:
    return {"model": MODEL, "temperature": 0, **kw}


def thinking_turn(client: openai.OpenAI, messages=QUESTION, opened: bool = False):
    with forced_thinking_call(opened=opened):
        first = client.chat.completions.create(messages=messages, tools=TOOLS, max_tokens=80,
                                               extra_body={"return_token_ids": True}, **greedy())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    return first


def returned(call) -> list[dict]:
    """The assistant turn of `call` as a client returns it (no thinking) and its result."""
    return [{"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT}]


def test_resume_keeps_the_thinking_the_history_drops(srv, qwen3_dir):
    client = srv.client()
    first = thinking_turn(client)
    message = first.choices[0].message
    thinking = message.model_extra["reasoning_content"]
    assert 8 <= len(thinking) <= 24 and "<think>" not in thinking
    assert message.content is None  # the thinking is not content
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    paused = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    assert f"<think>\n{thinking}\n</think>" in tokenizer.decode(paused)
    # Its thinking tokens: those up to </think> (here a single token, as in Qwen3's vocabulary).
    output = first.choices[0].model_extra["token_ids"]
    reasoning_tokens = output.index(tokenizer.convert_tokens_to_ids("</think>")) + 1
    assert first.usage.completion_tokens_details.reasoning_tokens == reasoning_tokens

    # The client's history omits the thinking (as chat templates and most clients drop it)...
    conversation = QUESTION + returned(call)
    # ... and the template renders that history without it: re-rendered, the prompt would not extend the
    # paused tokens (this is what defeats prefix caching on other servers).
    rendered = tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert thinking not in rendered
    assert tokenizer.encode(rendered, add_special_tokens=False)[:len(paused) - 1] != paused[:-1]

    second = client.chat.completions.create(messages=conversation, tools=TOOLS, max_tokens=8,
                                            extra_body={"return_token_ids": True, "ignore_eos": True}, **greedy())
    prompt_ids, output_ids = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    # The paused generation resumed: its whole context was reused (all but its last token, the EOS,
    # which was sampled and never fed back), and the prompt is that context, thinking included, + the result.
    assert prompt_ids[:len(paused)] == paused
    assert second.usage.prompt_tokens_details.cached_tokens == len(paused) - 1 == first.usage.total_tokens - 1
    assert RESULT in tokenizer.decode(prompt_ids[len(paused):])
    # Greedy output equals a fresh run of the whole context (thinking included) on the same engine.
    fresh = client.completions.create(prompt=prompt_ids, max_tokens=len(output_ids), **greedy(
        extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].model_extra["token_ids"] == output_ids
    # This turn did not think (no <think>: no reasoning_content, no reasoning tokens), nor does a token turn.
    assert "reasoning_content" not in second.choices[0].message.model_extra
    assert second.usage.completion_tokens_details is None and fresh.usage.completion_tokens_details is None
    assert srv.engine_state()["requests"] == {}


def test_a_template_that_opens_the_thinking(tmp_path):
    """A thinking-only model's template opens the thinking in the generation prompt: the turn thinks from
    its first token (no <think> of its own), and the history renders the turn with neither the opening
    nor the thinking; the resume still reuses the whole paused context and answers as a fresh run."""
    build_model(tmp_path, TEMPLATE.replace(*OPENS_THINKING))
    server = LiveServer(str(tmp_path), "preserve", prefix_caching=False, reasoning_parser="qwen3")
    try:
        client = server.client()
        first = thinking_turn(client, opened=True)
        message = first.choices[0].message
        assert 8 <= len(message.model_extra["reasoning_content"]) <= 24 and message.content is None
        (call,) = message.tool_calls
        second = client.chat.completions.create(messages=QUESTION + returned(call), tools=TOOLS, max_tokens=6,
                                                extra_body={"return_token_ids": True, "ignore_eos": True}, **greedy())
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1
        prompt_ids, output_ids = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
        fresh = client.completions.create(prompt=prompt_ids, max_tokens=len(output_ids), **greedy(
            extra_body={"return_token_ids": True, "ignore_eos": True}))
        assert fresh.choices[0].model_extra["token_ids"] == output_ids
    finally:
        server.close()


def test_two_thinking_rounds_keep_both_thinkings(srv, qwen3_dir):
    """The second round thinks and calls again: its paused context has both rounds' thinking, and the
    third request, whose history has neither, reuses all of it."""
    client = srv.client()
    first = thinking_turn(client)
    (call_1,) = first.choices[0].message.tool_calls
    conversation = QUESTION + returned(call_1)
    second = thinking_turn(client, conversation)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1
    (call_2,) = second.choices[0].message.tool_calls
    thinkings = [t.choices[0].message.model_extra["reasoning_content"] for t in (first, second)]
    third = client.chat.completions.create(messages=conversation + returned(call_2), tools=TOOLS, max_tokens=4,
                                           extra_body={"return_token_ids": True}, **greedy())
    assert third.usage.prompt_tokens_details.cached_tokens == second.usage.total_tokens - 1
    prompt = AutoTokenizer.from_pretrained(qwen3_dir).decode(third.model_extra["prompt_token_ids"])
    assert all(f"<think>\n{t}\n</think>" in prompt for t in thinkings)
    assert srv.engine_state()["requests"] == {}


def test_a_thinking_answer(srv):
    """A turn that thinks and answers (no call): the answer is the content, the thinking apart, streamed
    or not, in chat completions and in the Responses API."""
    client = srv.client()
    with forced_thinking_call(answer=True):
        full = client.chat.completions.create(messages=QUESTION, max_tokens=60, **greedy())
        chunks = list(client.chat.completions.create(messages=QUESTION, max_tokens=60, stream=True, **greedy()))
        response = client.responses.create(model=MODEL, input=QUESTION[0]["content"], max_output_tokens=60,
                                           temperature=0)
        events = list(client.responses.create(model=MODEL, input=QUESTION[0]["content"], max_output_tokens=60,
                                              temperature=0, stream=True))
    message = full.choices[0].message
    thinking, answer = message.model_extra["reasoning_content"], message.content
    assert 8 <= len(thinking) <= 24 and 4 <= len(answer) <= 12 and "<" not in answer + thinking
    assert full.choices[0].finish_reason == "stop"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thinking
    assert "".join(d.content or "" for d in deltas) == answer
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(d.model_extra.get("reasoning_content") for d in deltas[first_content:])  # thinking first
    assert [(item.type, getattr(item, "content")[0].text) for item in response.output] == \
        [("reasoning", thinking), ("message", answer)]
    kinds = [(e.type, getattr(e, "output_index", None)) for e in events]
    assert kinds.index(("response.reasoning_text.done", 0)) < kinds.index(("response.output_item.added", 1)) \
        < kinds.index(("response.output_text.delta", 1))
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer


def test_include_reasoning_false_leaves_the_thinking_out_but_the_resume_keeps_it(srv):
    """vLLM's `include_reasoning: false`: no reasoning_content (chat, streamed or not), no reasoning item
    or events (Responses); the paused generation still holds the thinking, so the result resumes it."""
    client = srv.client()
    hidden = {"include_reasoning": False}
    with forced_thinking_call():
        full = client.chat.completions.create(messages=QUESTION, tools=TOOLS, max_tokens=80, extra_body=hidden,
                                              **greedy())
        chunks = list(client.chat.completions.create(messages=QUESTION, tools=TOOLS, max_tokens=80, stream=True,
                                                     extra_body=hidden, **greedy()))
    message = full.choices[0].message
    assert "reasoning_content" not in message.model_extra and message.content is None and message.tool_calls
    assert full.usage.completion_tokens_details.reasoning_tokens >= 4  # (it did think)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.model_extra.get("reasoning_content") for d in deltas) and any(d.tool_calls for d in deltas)
    (call,) = message.tool_calls
    second = client.chat.completions.create(messages=QUESTION + returned(call), tools=TOOLS, max_tokens=2, **greedy())
    assert second.usage.prompt_tokens_details.cached_tokens == full.usage.total_tokens - 1

    tools = [{"type": "function", **TOOLS[0]["function"]}]
    with forced_thinking_call():
        response = client.responses.create(model=MODEL, input=QUESTION[0]["content"], tools=tools,
                                           max_output_tokens=80, temperature=0, extra_body=hidden)
        events = list(client.responses.create(model=MODEL, input=QUESTION[0]["content"], tools=tools,
                                              max_output_tokens=80, temperature=0, stream=True, extra_body=hidden))
    assert [item.type for item in response.output] == ["function_call"]
    assert not any("reasoning" in e.type for e in events)
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "function_call")] and [i.type for i in events[-1].response.output] == ["function_call"]
    call = response.output[0]
    resumed = client.responses.create(model=MODEL, previous_response_id=response.id, tools=tools, max_output_tokens=2,
                                      temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                             "output": RESULT}])
    assert resumed.usage.input_tokens_details.cached_tokens == response.usage.total_tokens - 1
    srv.abort_paused()  # (the two streamed turns' pauses)
    assert srv.engine_state()["requests"] == {}


def test_the_sdk_message_goes_back_as_is(srv):
    """Agents send the SDK's message object back: it carries reasoning_content, which is not rendered
    (the paused generation has the thinking as its tokens) and does not stop the resume."""
    client = srv.client()
    first = thinking_turn(client)
    message = first.choices[0].message
    (call,) = message.tool_calls
    second = client.chat.completions.create(
        messages=QUESTION + [message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}],
        tools=TOOLS, max_tokens=4, **greedy())
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens - 1


def test_only_the_generation_that_made_the_call_resumes(srv):
    """Two paused turns of the same question with the same thinking, content and call differ only by
    their call ids: each result resumes its own; an edited call resumes none (served fresh)."""
    client = srv.client()
    a, b = thinking_turn(client), thinking_turn(client)
    (call_a,), (call_b,) = a.choices[0].message.tool_calls, b.choices[0].message.tool_calls
    assert call_a.function.arguments == call_b.function.arguments and call_a.id != call_b.id
    assert len(srv.engine_state()["requests"]) == 2

    def result_for(call, arguments=None):
        call = call.model_copy(update={"function": call.function.model_copy(
            update={"arguments": arguments or call.function.arguments})})
        return client.chat.completions.create(messages=QUESTION + returned(call), tools=TOOLS, max_tokens=2,
                                              extra_body={"return_token_ids": True}, **greedy())

    other_city = '{"city": "Oslo"}' if json.loads(call_a.function.arguments)["city"] == "Paris" else '{"city": "Paris"}'
    edited = result_for(call_a, other_city)
    assert edited.usage.prompt_tokens_details.cached_tokens == 0
    assert len(srv.engine_state()["requests"]) == 2  # both still paused
    resumed_b = result_for(call_b)
    assert resumed_b.usage.prompt_tokens_details.cached_tokens == b.usage.total_tokens - 1
    (left,) = srv.engine_state()["requests"].values()
    assert left == "intercepted"
    resumed_a = result_for(call_a)
    assert resumed_a.usage.prompt_tokens_details.cached_tokens == a.usage.total_tokens - 1
    assert srv.engine_state()["requests"] == {}


def test_streamed_reasoning_content(srv):
    client = srv.client()
    with forced_thinking_call():
        chunks = list(client.chat.completions.create(messages=QUESTION, tools=TOOLS, max_tokens=80, stream=True,
                                                     **greedy()))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert 8 <= len(reasoning) <= 24
    assert sum(1 for d in deltas if d.model_extra.get("reasoning_content")) > 1  # it streamed as it was written
    assert "".join(d.content or "" for d in deltas) == ""  # neither the thinking nor the call is content
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Left paused; released by the test server's TTL or the next test's limits (nothing else to check).
    (call_id,) = {tc.id for tc in calls if tc.id}
    client.chat.completions.create(messages=QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": "".join(tc.function.arguments or "" for tc in calls)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT}], tools=TOOLS, max_tokens=1, **greedy())
    assert srv.engine_state()["requests"] == {}


def test_responses_reasoning_item_and_resume(srv):
    client = srv.client()
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    with forced_thinking_call():
        first = client.responses.create(model=MODEL, input=QUESTION[0]["content"], tools=tools, max_output_tokens=80,
                                        temperature=0)
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.summary == [] and reasoning.id.startswith("rs_")
    (text,) = reasoning.content
    assert text.type == "reasoning_text" and 8 <= len(text.text) <= 24
    assert call.type == "function_call" and call.name == "get_weather"
    # <think>, "\n", the thinking (a token per character at most), "\n", </think>: fewer than the call's.
    details = first.usage.output_tokens_details
    assert 4 <= details.reasoning_tokens <= 4 + len(text.text) and details.reasoning_tokens < first.usage.output_tokens / 2
    # The client keeps the history itself and sends every output item back, the reasoning item included.
    second = client.responses.create(model=MODEL, tools=tools, max_output_tokens=4, temperature=0, input=[
        QUESTION[0], reasoning.model_dump(exclude_none=True), call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}])
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1
    assert second.output[0].type == "message"


def test_responses_stream_reasoning_events(srv):
    client = srv.client()
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    with forced_thinking_call():
        events = list(client.responses.create(model=MODEL, input=QUESTION[0]["content"], tools=tools,
                                              max_output_tokens=80, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "reasoning" and events[2].output_index == 0
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert "".join(deltas) == done.text and 8 <= len(done.text) <= 24
    completed = events[-1].response
    assert [item.type for item in completed.output] == ["reasoning", "function_call"]
    assert completed.output[0].content[0].text == done.text
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "function_call")]
    # Resumed through previous_response_id: the stored conversation has no thinking, the paused one does.
    call = completed.output[1]
    second = client.responses.create(model=MODEL, previous_response_id=completed.id, tools=tools, max_output_tokens=4,
                                     temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                            "output": RESULT}])
    assert second.usage.input_tokens_details.cached_tokens == completed.usage.total_tokens - 1
    assert srv.engine_state()["requests"] == {}


def test_messages_api_thinking_blocks_stream_and_resume(srv):
    """Anthropic's Messages API: the thinking is a `thinking` block before the `tool_use` one, streamed
    as `thinking_delta`s; the client sends both blocks back, and the result's turn resumes the paused
    generation, thinking included."""
    import anthropic

    c = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=60)
    tool = {"name": "get_weather", "description": TOOLS[0]["function"]["description"],
            "input_schema": TOOLS[0]["function"]["parameters"]}
    kinds = []
    with forced_thinking_call(), c.messages.stream(model=MODEL, max_tokens=80, messages=QUESTION, tools=[tool],
                                                   extra_body={"temperature": 0}) as stream:
        for event in stream:
            if event.type in ("content_block_start", "content_block_delta"):
                kinds.append(event.content_block.type if event.type == "content_block_start" else event.delta.type)
        first = stream.get_final_message()
    thinking, use = first.content
    assert thinking.type == "thinking" and 8 <= len(thinking.thinking) <= 24 and thinking.signature == ""
    assert use.type == "tool_use" and use.input["city"] in ("Paris", "Oslo") and first.stop_reason == "tool_use"
    assert kinds[0] == "thinking" and kinds.count("thinking_delta") > 1 and kinds.index("tool_use") > kinds.index(
        "thinking_delta")
    second = c.messages.create(model=MODEL, max_tokens=4, tools=[tool], extra_body={"temperature": 0}, messages=[
        *QUESTION, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}])
    u = second.usage
    assert u.cache_read_input_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.content[0].type == "text"
    assert srv.engine_state()["requests"] == {}


def test_messages_api_thinking_disabled_closes_the_thinking_in_the_prompt(srv, qwen3_dir):
    """`thinking: {"type": "disabled"}` renders Qwen3's switch (`enable_thinking` false: an empty thinking
    block after the generation prompt, here and in Qwen3's own template); other types leave it alone."""
    import anthropic

    c = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=60)
    ask = dict(model=MODEL, messages=QUESTION)
    plain = c.messages.count_tokens(**ask).input_tokens
    empty_thinking = AutoTokenizer.from_pretrained(qwen3_dir).encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert c.messages.count_tokens(**ask, extra_body={"thinking": {"type": "disabled"}}).input_tokens == \
        plain + len(empty_thinking)
    assert c.messages.count_tokens(**ask, extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}}
                                   ).input_tokens == plain


def test_a_thinking_budget_closes_the_thinking_there(srv, qwen3_dir):
    """`thinking_token_budget` (vLLM's, here on completions): the thinking the prompt opened stops after
    that many tokens, counted from after <think> (the prompt's newline is the first), with </think>
    forced where an unbudgeted run thinks on; the tokens before it are the unbudgeted run's."""
    end = AutoTokenizer.from_pretrained(qwen3_dir).convert_tokens_to_ids("</think>")
    prompt = "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"

    def run(**extra) -> list[int]:
        out = srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
        return out.choices[0].model_extra["token_ids"]

    free, budgeted = run(), run(thinking_token_budget=4)
    assert end not in free[:4]
    assert budgeted[:3] == free[:3] and budgeted[3] == end
    assert run(thinking_token_budget=-1) == free  # vLLM's "no budget"


def test_messages_api_thinking_budget_tokens_bound_the_thinking_block(srv):
    """Anthropic's `thinking: {"type": "enabled", "budget_tokens": N}` is the turn's thinking budget:
    after a prefill that opens the thinking, the thinking block stops early and the answer follows."""
    import anthropic

    c = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=60)
    ask = dict(model=MODEL, max_tokens=16, messages=[*QUESTION, {"role": "assistant", "content": "<think>"}],
               extra_body={"temperature": 0})

    def blocks(message) -> dict[str, str]:
        return {b.type: b.thinking if b.type == "thinking" else b.text for b in message.content}

    free = blocks(c.messages.create(**ask, thinking={"type": "adaptive"}))
    budgeted = blocks(c.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 3}))
    assert "text" not in free  # unbudgeted, the 16 tokens are all thinking
    assert budgeted["thinking"] and free["thinking"].startswith(budgeted["thinking"])
    assert len(budgeted["thinking"]) < len(free["thinking"]) and budgeted["text"]


# -- the renderer, on its own ------------------------------------------------------------------------

@pytest.mark.parametrize("opened", [False, True], ids=["qwen3-template", "thinking-opened-by-the-prompt"])
def test_renderer_splices_a_thinking_turn_the_template_renders_apart(qwen3_dir, opened):
    """Unit view of the mechanism: a known turn (its tokens: thinking + call + EOS) replaces the
    template's rendering of it, although the template renders it differently as the last message (an
    empty thinking block) than followed by its result (none), and, with a template that opens the
    thinking in the generation prompt, although the turn's history rendering lacks that opening."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    if opened:
        tokenizer.chat_template = tokenizer.chat_template.replace(*OPENS_THINKING)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tokenizer, frozenset({eos}), ToolFormat("hermes"))
    tools = [TOOL]
    question = (Message("user", "What is the weather in Paris?"),)
    call = Call.make("call_1", "get_weather", '{"city": "Paris"}')
    generated = ("" if opened else "<think>\n") + "the user means paris\n</think>\n\n" + CALL
    turn_ids = tuple(renderer.encode(generated)) + (eos,)
    turn = AssistantTurn(Message("assistant", "", None, (call,)), turn_ids)
    conversation = question + (turn.message, Message("tool", RESULT, tool_call_id="call_1"))
    context = renderer.render(question, tools) + list(turn_ids)  # the paused generation's tokens
    assert tokenizer.decode(context).count("<think>") == 1
    ids = renderer.render(conversation, tools, lambda m: turn if m == turn.message else None)
    assert ids[:len(context)] == context
    assert tokenizer.decode(ids[len(context):]) == "\n<|im_start|>user\n<tool_response>\n" + RESULT + \
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n" + ("<think>\n" if opened else "")
    # A message the turn's call does not match renders from the template (no thinking anywhere).
    plain = tokenizer.decode(renderer.render(conversation, tools, lambda m: None))
    assert "the user means" not in plain and plain.count("<think>") == int(opened)
    # A template that renders the turn followed by more otherwise than with a piece of it cut out (here it
    # adds a mark): the turn is not found, and the conversation renders fresh from the template.
    assistant_end = "{{- '<|im_end|>\\n' }}"
    assert tokenizer.chat_template.count(assistant_end) == 1
    tokenizer.chat_template = tokenizer.chat_template.replace(
        assistant_end, "{%- if not loop.last %}{{- ' [answered]' }}{%- endif %}" + assistant_end)
    other = ChatRenderer(tokenizer, frozenset({eos}), ToolFormat("hermes"))
    assert other.render(conversation, tools, lambda m: turn if m == turn.message else None) == \
        other.render(conversation, tools, lambda m: None)


def test_which_turns_think(qwen3_dir):
    """A turn the server opens with a forced call's prefill does not think (it starts with the call);
    a grammar-constrained one does not under deepseek_r1 (whose parser takes a turn as thinking from its
    first token), while qwen3's splits only text that opens with <think>, whatever wrote it."""
    from infercept.server.conversations import ConversationStore
    from infercept.server.settings import ConversationPolicy
    from infercept.server.tool_mode import tool_mode
    from infercept.server.turns import Sampling, Turns, TurnSpec

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    renderer = ChatRenderer(tokenizer, frozenset({tokenizer.eos_token_id}), ToolFormat("hermes"))
    store = ConversationStore(ConversationPolicy(), lambda *args: None)
    question = (Message("user", "What is the weather in Paris?"),)

    def thinks(parser: str, choice: str, schema: dict | None = None) -> str | None:
        turns = Turns(None, store, None, None, renderer, 2048, len(tokenizer), True, get_reasoning_parser(parser))
        prepared = turns._prepare(TurnSpec("chat", Sampling(max_tokens=4), question, mode=tool_mode([TOOL], choice),
                                           answer_schema=schema))
        assert (prepared.reasoning.name if prepared.reasoning else None) == prepared.intercept.reasoning_parser
        return prepared.intercept.reasoning_parser

    assert thinks("qwen3", "auto") == "qwen3" and thinks("deepseek_r1", "auto") == "deepseek_r1"
    assert thinks("qwen3", "required") is None and thinks("deepseek_r1", "get_weather") is None
    assert thinks("qwen3", "auto", {"type": "object"}) == "qwen3"
    assert thinks("deepseek_r1", "auto", {"type": "object"}) is None
    # A template that opens the thinking in the generation prompt (thinking-only models): the turn thinks
    # from its first token, without a <think> of its own, as deepseek_r1 reads every turn.
    tokenizer.chat_template = tokenizer.chat_template.replace(*OPENS_THINKING)
    renderer = ChatRenderer(tokenizer, frozenset({tokenizer.eos_token_id}), ToolFormat("hermes"))
    assert renderer.render(question, None)[-2:] == tokenizer.encode("<think>\n", add_special_tokens=False)
    assert thinks("qwen3", "auto") == "deepseek_r1" and thinks("qwen3", "auto", {"type": "object"}) is None


def test_a_prompt_that_opens_the_thinking():
    assert QWEN3.after_prompt("<|im_start|>assistant\n<think>\n") is not QWEN3
    assert QWEN3.after_prompt("<|im_start|>assistant\n<think>\n").split("hmm</think>ok") == \
        R1.split("hmm</think>ok")
    assert QWEN3.after_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n") is QWEN3  # thinking switched off
    assert R1.after_prompt("<|im_start|>assistant\n") is R1


def test_langchain_chat_model_shows_the_thinking(srv):
    """ChatInferCept puts reasoning_content in the AIMessage's additional_kwargs, streamed or not."""
    from infercept.integrations.langchain import ChatInferCept

    model = ChatInferCept(base_url=srv.url, model=MODEL, temperature=0, max_tokens=60)
    with forced_thinking_call(answer=True):
        message = model.invoke("What is the weather in Paris?")
        chunks = list(model.stream("What is the weather in Paris?"))
    thinking = message.additional_kwargs["reasoning_content"]
    assert 8 <= len(thinking) <= 24 and message.content and thinking not in message.content
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.additional_kwargs["reasoning_content"] == thinking and merged.content == message.content
