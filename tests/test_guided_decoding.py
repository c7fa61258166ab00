"""Grammar-constrained decoding (engine/guided_decoding.py) on the real model: what comes out matches
the grammar, a grammar that allows everything changes nothing, and matchers follow the request's turns.
The server's use of it (forced tool calls, streamed arguments) is tested in test_server.py."""
from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from infercept.engine import SamplingParams
from infercept.engine.guided_decoding import unpack_bitmask
from infercept.engine.request import InterceptParams
from infercept.engine.sampling_params import GuidedDecodingParams
from infercept.engine.hermes_format import text_without_grammar
from live_server import MODEL

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"], "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["city"], "properties": {
        "city": {"type": "object", "additionalProperties": False, "required": ["name", "population"], "properties": {
            "name": {"type": "string", "maxLength": 10}, "population": {"type": "integer", "minimum": 0,
                                                                        "maximum": 10 ** 8}}}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["tags"], "properties": {
        "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 8}}}},
}
QUESTIONS = {"flat": "Describe a person as JSON.", "nested": "Give me a city and its population as JSON.",
             "array": "List some tags for a blog post about cooking, as JSON."}


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def drain(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_json_schema_outputs_always_validate(llm_fp32, engine):
    prompts, params, schemas = [], [], []
    for name, schema in SCHEMAS.items():
        guided = GuidedDecodingParams(json_schema=schema | {"x-guidance": JSON_STYLE})
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=7)):
            prompts.append(chat_prompt(llm_fp32.tokenizer, QUESTIONS[name]))
            params.append(SamplingParams(max_tokens=48, guided=guided, **sampling))
            schemas.append(schema)
    outs = llm_fp32.generate(prompts, params)  # one batch: guided rows side by side
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", out.text  # the grammar ended, and then so did the request
        jsonschema.validate(json.loads(out.text), schema)
    assert not engine.runner.guided.matchers


def test_a_grammar_that_allows_everything_changes_nothing(llm_fp32, engine):
    prompt = chat_prompt(llm_fp32.tokenizer, "Write one sentence about the sea.")
    free = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    anything = SamplingParams(temperature=0, max_tokens=24, logprobs=2,
                              guided=GuidedDecodingParams(lark="start: /(.|\\n)*/"))
    plain, guided = llm_fp32.generate([prompt, prompt], [free, anything])
    assert guided.token_ids == plain.token_ids and len(plain.token_ids) > 10
    # Special tokens other than EOS are not text, so even this grammar excludes them: their tiny
    # probability mass leaves the normalizer, and the logprobs move by about 1e-5.
    assert [s.logprob for s in guided.logprobs] == pytest.approx([s.logprob for s in plain.logprobs], abs=1e-4)


def test_each_turn_starts_its_own_grammar_and_matchers_are_freed(llm_fp32, engine):
    """A resumed turn begins after appended (prompt) tokens: it follows the grammar of its own params."""
    tokenizer = llm_fp32.tokenizer
    city = {"type": "object", "required": ["city"], "additionalProperties": False,
            "properties": {"city": {"type": "string", "maxLength": 10}}}
    first = SamplingParams(temperature=0, max_tokens=24,
                           guided=GuidedDecodingParams(json_schema=city | {"x-guidance": JSON_STYLE}))
    rid = engine.add_request(chat_prompt(tokenizer, "Which city should I visit? Answer as JSON."), first,
                             intercept=InterceptParams(pause_on_stop=True))
    out = drain(engine)[-1]
    assert out.paused and set(json.loads(out.text)) == {"city"}
    assert rid not in engine.runner.guided.matchers  # its grammar ended with the turn

    appended = tokenizer.encode("\n<|im_start|>user\nIs it sunny there?<|im_end|>\n<|im_start|>assistant\n",
                                add_special_tokens=False)
    second = SamplingParams(temperature=0, max_tokens=8,
                            guided=GuidedDecodingParams(lark='start: "Answer: " ("yes" | "no") "."'))
    engine.resume(rid, appended, second)
    out = drain(engine)[-1]
    assert out.paused and out.text in ("Answer: yes.", "Answer: no.")  # paused at its stop again
    assert not engine.runner.guided.matchers
    engine.abort(rid)


def test_abort_frees_the_matcher(llm_fp32, engine):
    params = SamplingParams(temperature=0, max_tokens=30,
                            guided=GuidedDecodingParams(json_schema={"type": "array", "items": {"type": "integer"}}))
    rid = engine.add_request(chat_prompt(llm_fp32.tokenizer, "Some numbers as a JSON array?"), params)
    while rid not in engine.runner.guided.matchers:
        engine.step()
    engine.abort(rid)
    engine.step()  # the runner hears of finished requests with the next scheduler output
    assert rid not in engine.runner.guided.matchers


@pytest.mark.parametrize("make", [
    lambda: GuidedDecodingParams(lark="start: undefined_rule"),
    lambda: GuidedDecodingParams(json_schema={"type": "no-such-type"}),
    lambda: GuidedDecodingParams(),
    lambda: GuidedDecodingParams(lark='start: "a"', json_schema={"type": "object"}),
    lambda: SamplingParams(min_tokens=2, guided=GuidedDecodingParams(lark='start: "a"')),
    lambda: SamplingParams(ignore_eos=True, guided=GuidedDecodingParams(lark='start: "a"')),
])
def test_bad_grammars_are_refused_up_front(make):
    with pytest.raises(ValueError):
        make()


def test_unpack_bitmask_reads_bits_little_end_first():
    bits = torch.zeros(2, 2, dtype=torch.int32)
    bits[0, 0] = 1 << 3  # token 3
    bits[1, 1] = -2 ** 31  # the sign bit of word 1: token 63
    mask = unpack_bitmask(bits, 70)  # a model vocabulary padded past the tokenizer's 64
    assert mask.shape == (2, 70)
    assert mask[0].nonzero().flatten().tolist() == [3]
    assert mask[1].nonzero().flatten().tolist() == [63]
    assert unpack_bitmask(bits, 40).shape == (2, 40)


def test_the_no_call_grammar_refuses_only_a_call_opening(tokenizer):
    """tool_choice "none" (Hermes): a turn may not start with "<" nor ever write "<tool_call>"; any
    other text passes, and it may end anywhere."""
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    grammar = GuidedDecodingParams(lark=text_without_grammar("<tool_call>")).grammar

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()

    assert accepts("") and accepts("  The <b>tool</b> said: 21 C.\n<tool_") and accepts("x <tool_call")
    assert not accepts("<tool_call>") and not accepts(" <b>") and not accepts("It calls <tool_call> now")


# -- the server: forced tool calls and streamed arguments (the shared live server) ------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm clock",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["hour", "period"], "properties": {
        "hour": {"type": "integer", "minimum": 1, "maximum": 12}, "period": {"enum": ["am", "pm"]},
        "label": {"type": "string", "maxLength": 20}}}}}
TOOLS = [WEATHER, ALARM]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def ask(client, question: str, **kw):
    kw = {"tools": TOOLS, "max_tokens": 48} | kw
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], **kw)


@pytest.mark.parametrize("question, choice, sampling", [
    ("Weather in Oslo?", named("get_weather"), dict(temperature=0)),
    ("Weather in Oslo?", named("set_alarm"), dict(temperature=0)),  # the tool does not fit the question
    ("Tell me a joke.", "required", dict(temperature=0)),
    ("Wake me up tomorrow.", "required", dict(temperature=1.0, seed=3)),
])
def test_forced_calls_parse_and_validate(srv, question, choice, sampling):
    out = ask(srv.client(), question, tool_choice=choice, **sampling)
    choice_out = out.choices[0]
    assert choice_out.finish_reason == "tool_calls" and choice_out.message.tool_calls
    for call in choice_out.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])
        if choice != "required":
            assert call.function.name == choice["function"]["name"]


def test_auto_reports_a_call_that_does_not_validate_as_text(srv):
    """The model answers "Paris" where the schema allows only Rome or Berlin: with "auto" that is text,
    never a broken call; forced, the grammar keeps the arguments inside the schema."""
    only = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Rome", "Berlin"]}}, "required": ["city"]}}}
    client = srv.client()
    auto = ask(client, "What is the weather in Paris?", tools=[only], temperature=0)
    message = auto.choices[0].message
    assert not message.tool_calls and auto.choices[0].finish_reason == "stop"
    assert '<tool_call>' in message.content and '"Paris"' in message.content
    forced = ask(client, "What is the weather in Paris?", tools=[only], tool_choice="required", temperature=0)
    (call,) = forced.choices[0].message.tool_calls
    assert json.loads(call.function.arguments)["city"] in ("Rome", "Berlin")


def test_forced_call_arguments_stream_token_by_token(srv):
    client = srv.client()
    for question, choice in (("Weather in Oslo?", named("get_weather")), ("Set an alarm for 7 am.", "required")):
        full = ask(client, question, tool_choice=choice, temperature=0).choices[0].message.tool_calls
        stream = ask(client, question, tool_choice=choice, temperature=0, stream=True)
        deltas = [d for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or []]
        first = deltas[0]
        assert first.id.startswith("call_") and first.type == "function"
        assert first.function.name == full[0].function.name and first.function.arguments == ""
        fragments = [d.function.arguments for d in deltas if d.index == 0 and d.id is None]
        assert len(fragments) >= 3  # arguments came as they were generated, not in one piece at the end
        assert "".join(fragments) == full[0].function.arguments
        jsonschema.validate(json.loads("".join(fragments)), SCHEMA[first.function.name])


def test_a_schema_that_cannot_be_enforced_is_refused_only_when_forced(srv):
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": 5}, "required": "x"}}}
    client = srv.client()
    fine = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    assert ask(client, "Hi", tools=[odd], max_tokens=1).choices  # auto: served; its calls are checked as objects
    with pytest.raises(openai.BadRequestError, match="^Error code: 400 - tool 'f': its parameters cannot be "
                                                     "enforced: [^\n]+$") as refused:  # the tool named, no listing
        ask(client, "Hi", tools=[fine, odd], tool_choice="required")
    assert refused.value.body["param"] == "tools"


# -- the server: response_format (the shared live server) --------------------------------------------

def json_schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_response_format_json_object_and_json_schema(srv):
    client = srv.client()
    free = ask(client, "Give me a city and its population.", tools=None, temperature=0)
    assert free.choices[0].message.content.lstrip()[:1] != "{"  # unconstrained, the model writes prose
    obj = ask(client, "Give me a city and its population.", tools=None, temperature=0,
              response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    for name, schema in SCHEMAS.items():
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=11)):
            out = ask(client, QUESTIONS[name], tools=None, response_format=json_schema_format(schema), **sampling)
            assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
            jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    # Streamed, the same JSON arrives in pieces.
    schema = json_schema_format(SCHEMAS["flat"])
    full = ask(client, QUESTIONS["flat"], tools=None, temperature=0, response_format=schema)
    stream = ask(client, QUESTIONS["flat"], tools=None, temperature=0, response_format=schema, stream=True)
    pieces = [c.delta.content for chunk in stream for c in chunk.choices if c.delta.content]
    assert len(pieces) >= 3 and "".join(pieces) == full.choices[0].message.content


def test_parse_with_a_pydantic_model(srv):
    class City(BaseModel):
        name: str = Field(max_length=12)
        population: int = Field(ge=0, le=10 ** 8)

    out = srv.client().chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": QUESTIONS["nested"]}],
                                              response_format=City, max_tokens=48, temperature=0)
    assert isinstance(out.choices[0].message.parsed, City)


def test_response_format_with_tools(srv):
    """auto: calls (arguments per schema) or the JSON answer, the model chooses; none: the JSON answer,
    from the same prompt; forced: calls, the format has no answer to constrain."""
    client = srv.client()
    person = json_schema_format(SCHEMAS["flat"])
    call = ask(client, "Weather in Oslo?", temperature=0, response_format=person)
    assert call.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    # The call is grammar-written, so a stream shows its arguments as they come, as in a forced turn.
    stream = ask(client, "Weather in Oslo?", temperature=0, response_format=person, stream=True)
    fragments = [d.function.arguments for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or []]
    assert len(fragments) >= 3 and "".join(fragments) == call.choices[0].message.tool_calls[0].function.arguments
    answer = ask(client, "Weather in Oslo?", temperature=0, response_format=person, tool_choice="none")
    jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMAS["flat"])
    assert answer.usage.prompt_tokens == call.usage.prompt_tokens
    forced = ask(client, "Describe a person.", temperature=0, response_format=person, tool_choice=named("set_alarm"))
    jsonschema.validate(json.loads(forced.choices[0].message.tool_calls[0].function.arguments), SCHEMA["set_alarm"])
    for sampling in (dict(temperature=1.0, seed=s) for s in range(2)):
        out = ask(client, "Describe a person, or set an alarm.", response_format=person, **sampling).choices[0]
        if out.finish_reason == "tool_calls":
            for c in out.message.tool_calls:
                jsonschema.validate(json.loads(c.function.arguments), SCHEMA[c.function.name])
        else:
            assert out.finish_reason == "stop" and not out.message.tool_calls
            jsonschema.validate(json.loads(out.message.content), SCHEMAS["flat"])


@pytest.mark.parametrize("response_format, message", [
    (json_schema_format({"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}}),
     "cannot be enforced"),
    (json_schema_format({"$ref": "#/nowhere"}), "cannot be enforced"),
    ({"type": "json_schema"}, "json_schema is required"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "json_schema is required"),
    ({"type": "yaml"}, "response_format"),
])
def test_response_formats_that_cannot_be_served_are_400(srv, response_format, message):
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        ask(srv.client(), "Hi", tools=None, response_format=response_format)
    assert raised.value.body["param"].startswith("response_format")
