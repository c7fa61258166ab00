"""Unit tests of infercept.engine.tool_parsers: spans, the pause rule, parsing, the registry.

Pure Python and fast: no model, no torch in the module under test.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stdlib_only import non_stdlib_imports
from infercept.engine.tool_parsers import (PARSERS, Glm4ToolParser, HermesToolParser, Llama3JsonToolParser,
                                           MistralToolParser, ParseResult, PythonicToolParser, Qwen3CoderToolParser,
                                           ToolCall, ToolParser, get_tool_parser, parser_for_model)

MODULE = Path(__file__).resolve().parents[1] / "engine" / "tool_parsers.py"

hermes = HermesToolParser()
llama = Llama3JsonToolParser()
mistral = MistralToolParser()
pythonic = PythonicToolParser()
qwen3_coder = Qwen3CoderToolParser()
glm45 = Glm4ToolParser()
deepseek = get_tool_parser("deepseek_v31")


def state(parser: ToolParser, text: str) -> tuple[int, bool, bool, bool]:
    """(complete_calls, pending_call_open, may_continue_with_call, turn_done)."""
    return (parser.complete_calls(text), parser.pending_call_open(text), parser.may_continue_with_call(text),
            parser.turn_done(text))


def calls(result: ParseResult) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def hermes_call(name: str, arguments: object, key: str = "arguments") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, key: arguments})}\n</tool_call>'


# -- hermes ----------------------------------------------------------------------------------------

def test_hermes_single_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris",  "days": 3}}\n</tool_call>'
    result = hermes.parse(text)
    assert result == ParseResult(content="", invalid=[], tool_calls=[
        ToolCall(name="get_weather", arguments='{"city": "Paris", "days": 3}', raw=text)])
    assert state(hermes, text) == (1, False, True, False)


def test_hermes_content_before_between_and_after_calls():
    a, b = hermes_call("a", {"x": 1}), hermes_call("b", {})
    result = hermes.parse(f"  Let me check both.\n{a}\n{b}\nDone.  ")
    assert calls(result) == [("a", {"x": 1}), ("b", {})]
    assert result.content == "Let me check both.\n\n\nDone."
    assert [c.raw for c in result.tool_calls] == [a, b]
    assert result.invalid == []


def test_hermes_plain_text_has_no_calls():
    text = "The <tool_ tag is not a call, nor is </tool_call> on its own."
    assert hermes.parse(text) == ParseResult(content=text, tool_calls=[], invalid=[])
    assert state(hermes, text) == (0, False, False, False)


def test_hermes_nested_braces_and_markers_inside_strings():
    arguments = {"code": "if (a) { b(); } </tool_call> <tool_call>", "nested": {"deep": [{"k": "}"}, "]"]},
                 "quote": 'say "hi" \\ back\\', "brace": "{"}
    text = hermes_call("run", arguments)
    assert text.count("</tool_call>") == 2  # one inside the string
    assert state(hermes, text) == (1, False, True, False)
    result = hermes.parse(text + "\n<tool_call>")
    assert calls(result) == [("run", arguments)]
    assert result.invalid == ["<tool_call>"]  # the unclosed second span


def test_hermes_unicode_and_normalized_arguments():
    text = '<tool_call>{"name":"traduire","arguments":{"texte":"héllo 世界 🙂","n":1.5e3}}</tool_call>'
    (call,) = hermes.parse(text).tool_calls
    assert call.name == "traduire"
    assert call.arguments == '{"texte": "héllo 世界 🙂", "n": 1500.0}'  # ensure_ascii=False
    escaped = '<tool_call>{"name":"t","arguments":{"s":"\\u00e9\\ud83d\\ude42"}}</tool_call>'
    assert hermes.parse(escaped).tool_calls[0].arguments == '{"s": "é🙂"}'


def test_hermes_arguments_as_json_string():
    text = hermes_call("f", json.dumps({"a": [1, {"b": None}]}))
    assert calls(hermes.parse(text)) == [("f", {"a": [1, {"b": None}]})]


@pytest.mark.parametrize("arguments", ["not json", "", "[1, 2]", "5", [1, 2], 3, True, "null"])
def test_hermes_arguments_that_are_not_an_object_are_invalid(arguments):
    text = "Before " + hermes_call("f", arguments)
    result = hermes.parse(text)
    assert result.tool_calls == []
    assert result.invalid == [text[len("Before "):]]
    assert result.content == text  # invalid spans stay in the content, in place


@pytest.mark.parametrize("obj", [{"arguments": {}}, {"name": "", "arguments": {}}, {"name": "  "},
                                 {"name": 7, "arguments": {}}, {"name": None}, ["f", {}], "f"])
def test_hermes_missing_or_bad_name_is_invalid(obj):
    text = f"<tool_call>{json.dumps(obj)}</tool_call>"
    assert hermes.parse(text) == ParseResult(content=text, tool_calls=[], invalid=[text])
    assert hermes.complete_calls(text) == 1  # closed, though invalid: the engine may still pause on it


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {}', '{"name": "f"} {"name": "g"}', "",
                                  '{"name": "f", "arguments": {"x": NaN}}', "name: f",
                                  '{"name": "f", "arguments": {"x": 1,}}'])
def test_hermes_malformed_body_is_invalid(body):
    text = f"ok <tool_call>{body}</tool_call> then " + hermes_call("g", {})
    result = hermes.parse(text)
    assert calls(result) == [("g", {})]
    assert result.invalid == [f"<tool_call>{body}</tool_call>"]
    assert result.content == f"ok <tool_call>{body}</tool_call> then"


def test_hermes_lenient_shapes():
    assert calls(hermes.parse('<tool_call>{"name": "f"}</tool_call>')) == [("f", {})]
    assert calls(hermes.parse('<tool_call>{"name": "f", "arguments": null}</tool_call>')) == [("f", {})]
    assert calls(hermes.parse(hermes_call("f", {"a": 1}, key="parameters"))) == [("f", {"a": 1})]
    openai = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert calls(hermes.parse(f"<tool_call>{json.dumps(openai)}</tool_call>")) == [("f", {"a": 1})]
    spaced = '<tool_call>  \n\n {\n  "name" :  " f ",\n  "arguments" : { "a" : 1 }\n}\n\n</tool_call>'
    assert calls(hermes.parse(spaced)) == [("f", {"a": 1})]
    extra = '<tool_call>{"name": "f", "arguments": {}, "id": "call_1"}</tool_call>'
    assert calls(hermes.parse(extra)) == [("f", {})]


def test_hermes_unclosed_span():
    text = 'Thinking.\n<tool_call>\n{"name": "f", "arguments": {"a": "b'
    assert state(hermes, text) == (0, True, False, False)
    result = hermes.parse(text)
    assert result.tool_calls == [] and result.invalid == [text[len("Thinking.\n"):]]
    assert result.content == text
    # an odd number of quotes swallows the close tag: the span stays open until EOS
    odd = '<tool_call>{"name": "f", "arguments": {"a": "b}}</tool_call>'
    assert state(hermes, odd) == (0, True, False, False)


# -- the pause rule (hermes) -----------------------------------------------------------------------

CALL = hermes_call("f", {"q": "x"})


@pytest.mark.parametrize("text, expected", [
    ("", (0, False, False, False)),
    ("I will call f.", (0, False, False, False)),
    ("<tool_", (0, False, False, False)),
    ("<tool_call>", (0, True, False, False)),
    ('<tool_call>\n{"name": "f"', (0, True, False, False)),
    (CALL[:-1], (0, True, False, False)),
    (CALL, (1, False, True, False)),  # a parallel call may follow: keep generating
    (CALL + "\n", (1, False, True, False)),
    (CALL + "\n\n <", (1, False, True, False)),
    (CALL + "\n<tool_c", (1, False, True, False)),
    (CALL + "\n<tool_call>", (1, True, False, False)),  # second call open
    (CALL + "\n<tool_call>\n{", (1, True, False, False)),
    (CALL + "\n" + CALL, (2, False, True, False)),
    (CALL + "\nThe", (1, False, False, True)),  # the model moved on: pause
    (CALL + "<tool_response>", (1, False, False, True)),  # hallucinated result: pause
    (CALL + "\n<tool_call>x</tool_call>", (2, False, True, False)),  # invalid spans count as calls
    (CALL + "\n<tool_call>x</tool_call>.", (2, False, False, True)),
])
def test_hermes_pause_rule(text, expected):
    assert state(hermes, text) == expected


def test_hermes_streaming_pauses_only_when_the_model_writes_something_else():
    text = "Checking.\n" + CALL + "\n" + hermes_call("g", {"a": [1, "}"]}) + "\nNow I wait"
    trace = [state(hermes, text[:i]) for i in range(len(text) + 1)]
    first_done = next(i for i, s in enumerate(trace) if s[3])
    assert text[:first_done].endswith("\nN")  # the first character that cannot start a call
    counts = [s[0] for s in trace]
    assert counts == sorted(counts) and counts[-1] == 2
    assert not any(s[1] and s[2] for s in trace)  # pending and may-continue exclude each other
    assert calls(hermes.parse(text[:first_done])) == [("f", {"q": "x"}), ("g", {"a": [1, "}"]})]
    assert hermes.parse(text[:first_done]).content == "Checking.\n\n\nN"  # the stray token is content


# -- llama3_json -----------------------------------------------------------------------------------

def test_llama_untagged_call():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    result = llama.parse(text)
    assert result == ParseResult(content="", invalid=[], tool_calls=[
        ToolCall(name="get_weather", arguments='{"city": "Paris"}', raw=text)])
    assert state(llama, text) == (1, False, True, False)
    assert state(llama, "\n " + text[:-1]) == (0, True, False, False)


def test_llama_tagged_calls_with_content_and_separators():
    first = '{"name": "a", "parameters": {"x": "{;}"}}'
    second = '{"name": "b", "arguments": {"y": [1, 2]}}'
    text = f"Let me look that up.<|python_tag|>{first}; {second}"
    result = llama.parse(text)
    assert calls(result) == [("a", {"x": "{;}"}), ("b", {"y": [1, 2]})]
    assert [c.raw for c in result.tool_calls] == ["<|python_tag|>" + first, second]
    assert result.content == "Let me look that up."
    assert state(llama, text) == (2, False, True, False)
    assert calls(llama.parse(f"<|python_tag|>{first};<|python_tag|>{second}")) == calls(result)
    assert calls(llama.parse(f"{first}\n{second}")) == calls(result)  # whitespace-separated


@pytest.mark.parametrize("suffix, expected", [
    ("", (1, False, True, False)),
    (";", (1, False, True, False)),
    ("; ", (1, False, True, False)),
    (";\n<|python", (1, False, True, False)),
    ("; {", (1, True, False, False)),
    ('; {"name": "g", "parameters": {}}', (2, False, True, False)),
    ("<|python_tag|>", (1, True, False, False)),
    (" I called it.", (1, False, False, True)),
    ("\n\nThe result", (1, False, False, True)),
])
def test_llama_pause_rule(suffix, expected):
    assert state(llama, '{"name": "f", "parameters": {}}' + suffix) == expected


def test_llama_trailing_text_is_content():
    result = llama.parse('{"name": "f", "parameters": {}}; and then some text')
    assert calls(result) == [("f", {})]
    assert result.content == "; and then some text"


@pytest.mark.parametrize("text", [
    '{"name": "Alice", "age": 30}',  # a JSON answer, not a call
    '{"result": 42}',
    '{"name": "f", "parameters": {}',  # still open at the end of the turn: invalid
    'Sure: {"name": "f", "parameters": {}}',  # untagged calls must start the message
    "Use {braces} freely; {\"name\": \"f\"}",
    "plain text",
    "",
])
def test_llama_json_answers_and_prose_are_content(text):
    result = llama.parse(text)
    if text.startswith("{") and llama.pending_call_open(text):
        assert result.invalid == [text]  # unclosed at the end of the turn
    else:
        assert result == ParseResult(content=text.strip(), tool_calls=[], invalid=[])
        assert state(llama, text) == (0, False, False, False)


def test_llama_json_answer_then_tagged_call():
    answer = '{"name": "Alice", "note": "<|python_tag|>"}'
    text = answer + ' ok<|python_tag|>{"name": "f", "parameters": {"a": 1}}'
    result = llama.parse(text)
    assert calls(result) == [("f", {"a": 1})] and result.content == answer + " ok"
    assert calls(llama.parse('{ <|python_tag|>{"name": "f", "parameters": {}}')) == [("f", {})]
    assert llama.pending_call_open('{"name": "f", "parameters": {"a": "<|python_tag|>')  # cannot tell yet


def test_llama_tagged_invalid_and_builtin_calls():
    bad = '<|python_tag|>{"parameters": {}}'
    assert state(llama, bad) == (1, False, True, False)
    assert llama.parse(bad) == ParseResult(content=bad, tool_calls=[], invalid=[bad])
    builtin = 'Searching.<|python_tag|>brave_search.call(query="weather in {city}")'
    assert state(llama, builtin) == (0, True, False, False)  # runs to <|eom_id|>, then invalid
    assert llama.parse(builtin).invalid == [builtin[len("Searching."):]]
    assert llama.parse('<|python_tag|>{"name": "f", "parameters": "{\\"a\\": 1}"}').tool_calls[0].arguments \
        == '{"a": 1}'
    assert llama.parse('<|python_tag|>{"name": "f", "parameters": "nope"}').tool_calls == []


# -- mistral ---------------------------------------------------------------------------------------

def test_mistral_json_array():
    first = '{"name": "a", "arguments": {"x": [1, {"y": "]"}]}, "id": "abc123xyz"}'
    second = '{"name": "b", "arguments": "{\\"z\\": \\"é\\"}"}'
    text = f"Calling.[TOOL_CALLS][{first}, {second}]"
    result = mistral.parse(text)
    assert calls(result) == [("a", {"x": [1, {"y": "]"}]}), ("b", {"z": "é"})]
    assert [c.raw for c in result.tool_calls] == [first, second]
    assert result.content == "Calling." and result.invalid == []
    assert state(mistral, text) == (1, False, True, False)  # one block
    assert state(mistral, text[:-1]) == (0, True, False, False)
    assert state(mistral, text + "</s>?") == (1, False, False, True)


def test_mistral_single_object_and_spacing():
    text = '[TOOL_CALLS] \n{"name": "f", "arguments": {}}'
    assert calls(mistral.parse(text)) == [("f", {})]
    assert mistral.parse(text).tool_calls[0].raw == text


@pytest.mark.parametrize("text, expected", [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}', [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]a[ARGS]{"s": "}{"}[TOOL_CALLS]b.c-d[ARGS]{}', [("a", {"s": "}{"}), ("b.c-d", {})]),
])
def test_mistral_v11(text, expected):
    result = mistral.parse(text)
    assert calls(result) == expected and result.invalid == [] and result.content == ""
    assert mistral.complete_calls(text) == len(expected)


@pytest.mark.parametrize("text, expected", [
    ("[TOOL_CALLS]", (0, True, False, False)),
    ("[TOOL_CALLS]get_wea", (0, True, False, False)),
    ("[TOOL_CALLS]get_weather[ARGS]", (0, True, False, False)),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', (0, True, False, False)),
    ('[TOOL_CALLS]f[ARGS]{}', (1, False, True, False)),
    ('[TOOL_CALLS]f[ARGS]{}[TOOL_', (1, False, True, False)),
    ('[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g', (1, True, False, False)),
    ('[TOOL_CALLS]f[ARGS]{} Now', (1, False, False, True)),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}', (0, True, False, False)),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}]', (1, False, True, False)),
])
def test_mistral_pause_rule(text, expected):
    assert state(mistral, text) == expected


def test_mistral_invalid_blocks_and_elements():
    broken = '[TOOL_CALLS][{"name": "f", "arguments": {}},]'
    assert mistral.parse(broken) == ParseResult(content=broken, tool_calls=[], invalid=[broken])
    assert mistral.parse("[TOOL_CALLS][]").invalid == ["[TOOL_CALLS][]"]
    mixed = mistral.parse('[TOOL_CALLS][{"arguments": {}}, {"name": "g", "arguments": {}}, 3]')
    assert calls(mixed) == [("g", {})]
    assert mixed.invalid == ['{"arguments": {}}', "3"]
    bad_args = '[TOOL_CALLS]f[ARGS]{"a": NaN}'
    assert mistral.parse(bad_args).invalid == [bad_args]
    # text after the marker that is neither JSON nor name[ARGS]: invalid, up to the next block
    garbage = mistral.parse('[TOOL_CALLS]oops, no call here [TOOL_CALLS]f[ARGS]{"a": 1}')
    assert calls(garbage) == [("f", {"a": 1})]
    assert garbage.invalid == ["[TOOL_CALLS]oops, no call here "]
    assert mistral.pending_call_open("[TOOL_CALLS]oops, no call here")


def test_mistral_without_marker_is_content():
    text = '[{"name": "f", "arguments": {}}]'
    assert mistral.parse(text) == ParseResult(content=text, tool_calls=[], invalid=[])


# -- pythonic --------------------------------------------------------------------------------------

def test_pythonic_calls_python_and_json_literals():
    text = ('[get_weather(city="Paris", days=3), search.web(q=\'it\\\'s "x"]\', tags=["a", (1, -2.5)], '
            'opts={"deep": True, "n": None}, raw=true, none=null)]')
    result = pythonic.parse(text)
    assert calls(result) == [("get_weather", {"city": "Paris", "days": 3}),
                             ("search.web", {"q": 'it\'s "x"]', "tags": ["a", [1, -2.5]],
                                             "opts": {"deep": True, "n": None}, "raw": True, "none": None})]
    assert [c.raw for c in result.tool_calls] == ['get_weather(city="Paris", days=3)', text[text.index("search"):-1]]
    assert result.content == "" and result.invalid == []
    assert calls(pythonic.parse("[clock()]")) == [("clock", {})]
    # JSON escapes are read as JSON (what a grammar writes), not as Python
    assert calls(pythonic.parse('[f(s="a\\/b\\u00e9")]')) == [("f", {"s": "a/b\u00e9"})]


def test_pythonic_wrapped_in_python_start_and_end():
    text = '<|python_start|>[f(a=1)]<|python_end|>'
    assert calls(pythonic.parse(text)) == [("f", {"a": 1})] and pythonic.parse(text).content == ""
    assert state(pythonic, text) == (1, False, True, False)
    assert state(pythonic, "<|python_st") == (0, True, False, False)
    assert state(pythonic, text[:-len("<|python_end|>")] + "<|python") == (1, False, True, False)


@pytest.mark.parametrize("text, expected", [
    ("[", (0, True, False, False)),
    ("[get_wea", (0, True, False, False)),
    ('[get_weather(city="Pa', (0, True, False, False)),
    ('[get_weather(city="]"', (0, True, False, False)),  # a bracket inside a string does not close
    ('[f(a=1), g(', (0, True, False, False)),
    ("[f()]", (1, False, True, False)),
    ("[f()]\n", (1, False, True, False)),
    ("[f()] Done.", (1, False, False, True)),
    ("[f()]\n[g()]", (1, False, False, True)),  # one list per message
    ("[1, 2]", (0, False, False, False)),  # a list, not of calls: content
    ("[see the docs](https://x)", (0, False, False, False)),
    ("Sure: [f()]", (0, False, False, False)),  # calls start the message
    ("", (0, False, False, False)),
])
def test_pythonic_pause_rule(text, expected):
    assert state(pythonic, text) == expected


@pytest.mark.parametrize("text, invalid", [
    ("[f(1)]", ["f(1)"]),  # positional arguments
    ("[f(a=b)]", ["f(a=b)"]),  # a variable, not a literal
    ("[f(a=1, a=2)]", ["f(a=1, a=2)"]),
    ("[f(**kw)]", ["f(**kw)"]),
    ("[f(a=1j)]", ["f(a=1j)"]),
    ("[f(a={1: 2})]", ["f(a={1: 2})"]),
    ("[f(a=1)(b=2)]", ["f(a=1)(b=2)"]),
    ("[f(a=1]", None),  # never closes: still open at the end of the turn
    ("[f(a=1) g(b=2)]", ["[f(a=1) g(b=2)]"]),  # not Python
])
def test_pythonic_invalid_calls_stay_content(text, invalid):
    result = pythonic.parse(text)
    assert result.tool_calls == []
    assert result.invalid == (invalid if invalid is not None else [text])
    mixed = pythonic.parse("[f(a=1), g(1), h()]")
    assert calls(mixed) == [("f", {"a": 1}), ("h", {})] and mixed.invalid == ["g(1)"]


# -- qwen3_coder -------------------------------------------------------------------------------------

def xml_call(name: str, values: dict[str, str]) -> str:
    return (f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
            + "</function>\n</tool_call>")


ALARM = {"type": "object", "properties": {
    "hour": {"type": "integer"}, "label": {"type": "string"}, "loud": {"type": "boolean"}, "days": {"type": "array"},
    "note": {"type": ["string", "null"]}, "level": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    "unit": {"$ref": "#/$defs/unit"}, "any": {}}, "$defs": {"unit": {"enum": ["c", "f"]}}}


def test_qwen3_coder_values_are_typed_by_the_schema():
    text = "Setting it.\n" + xml_call("set_alarm", {
        "hour": "7", "label": "007", "loud": "True", "days": '["mon", "tue"]', "note": "null", "level": "0.5",
        "unit": "f", "any": '{"a": 1}'}) + "\n" + xml_call("clock", {})
    result = qwen3_coder.parse(text, {"set_alarm": ALARM})
    assert calls(result) == [("set_alarm", {"hour": 7, "label": "007", "loud": True, "days": ["mon", "tue"],
                                            "note": None, "level": 0.5, "unit": "f", "any": {"a": 1}}), ("clock", {})]
    assert result.content == "Setting it." and result.tool_calls[0].raw in text
    # text where the schema allows strings only, or where the JSON is of a type it does not allow
    typed = calls(qwen3_coder.parse(xml_call("set_alarm", {"label": "true", "hour": "seven", "note": "12"}),
                                    {"set_alarm": ALARM}))
    assert typed == [("set_alarm", {"label": "true", "hour": "seven", "note": "12"})]
    # without a schema: JSON where the value is JSON (not a string), else the text; multi-line values whole
    untyped = calls(qwen3_coder.parse(xml_call("f", {"n": "12", "s": "Paris", "code": "a\n  b\n"})))
    assert untyped == [("f", {"n": 12, "s": "Paris", "code": "a\n  b\n"})]


@pytest.mark.parametrize("text, expected", [
    (xml_call("f", {"a": "1"}), (1, False, True, False)),
    (xml_call("f", {"a": "1"}) + "\n<tool", (1, False, True, False)),
    (xml_call("f", {"a": "1"}) + "\nDone.", (1, False, False, True)),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1", (0, True, False, False)),
    ("The weather is fine.", (0, False, False, False)),
])
def test_qwen3_coder_pause_rule(text, expected):
    assert state(qwen3_coder, text) == expected


@pytest.mark.parametrize("body", ["<tool_call>\nno function\n</tool_call>",
                                  "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
                                  "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n"
                                  "</parameter>\n</function>\n</tool_call>",
                                  "<tool_call>\n<function=>\n</function>\n</tool_call>"])
def test_qwen3_coder_invalid_calls_stay_content(body):
    result = qwen3_coder.parse("Here: " + body)
    assert result.tool_calls == [] and result.invalid == [body] and body in result.content


# -- glm45 -------------------------------------------------------------------------------------------

def glm_call(name: str, values: dict[str, str], newlines: bool = True) -> str:
    nl = "\n" if newlines else ""
    return (f"<tool_call>{name}{nl}" + "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}"
                                               for k, v in values.items()) + "</tool_call>")


@pytest.mark.parametrize("newlines", [True, False])  # GLM-4.5 / 4.6, and GLM-4.7's compact form
def test_glm45_calls_are_read_in_both_forms_and_typed_by_the_schema(newlines):
    text = "Setting it.\n" + glm_call("set_alarm", {"hour": "7", "label": "007", "days": '["mon"]', "unit": "f"},
                                      newlines) + "\n" + glm_call("clock", {}, newlines)
    result = glm45.parse(text, {"set_alarm": ALARM})
    assert calls(result) == [("set_alarm", {"hour": 7, "label": "007", "days": ["mon"], "unit": "f"}), ("clock", {})]
    assert result.content == "Setting it." and result.tool_calls[0].raw in text
    untyped = calls(glm45.parse(glm_call("f", {"n": "12", "code": "a\n  b\n"}, newlines)))
    assert untyped == [("f", {"n": 12, "code": "a\n  b\n"})]  # (a value is its text whole, newlines and all)
    assert isinstance(get_tool_parser("glm47"), Glm4ToolParser)


@pytest.mark.parametrize("text, expected", [
    (glm_call("f", {"a": "1"}), (1, False, True, False)),
    (glm_call("f", {"a": "1"}) + "\n<tool", (1, False, True, False)),
    (glm_call("f", {"a": "1"}) + "<|observation|>", (1, False, False, True)),
    ("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1", (0, True, False, False)),
    ("The weather is fine.", (0, False, False, False)),
])
def test_glm45_pause_rule(text, expected):
    assert state(glm45, text) == expected


@pytest.mark.parametrize("body", ["<tool_call>\n</tool_call>", "<tool_call>two words</tool_call>",
                                  "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\nstray</tool_call>",
                                  "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key>"
                                  "<arg_value>2</arg_value></tool_call>",
                                  '<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
def test_glm45_invalid_calls_stay_content(body):
    result = glm45.parse("Here: " + body)
    assert result.tool_calls == [] and result.invalid == [body] and body in result.content


# -- deepseek_v31 ------------------------------------------------------------------------------------

DS_CALL = "<｜tool▁call▁begin｜>{}<｜tool▁sep｜>{}<｜tool▁call▁end｜>"


def test_deepseek_v31_reads_a_section_of_calls():
    section = ("<｜tool▁calls▁begin｜>" + DS_CALL.format("get_weather", '{"city": "Paris"}')
               + DS_CALL.format("clock", "{}") + "<｜tool▁calls▁end｜>")
    result = deepseek.parse("Let me look." + section)
    assert calls(result) == [("get_weather", {"city": "Paris"}), ("clock", {})] and result.content == "Let me look."
    assert state(deepseek, section) == (1, False, True, False)
    assert state(deepseek, section[:-5]) == (0, True, False, False)
    assert state(deepseek, section + "<｜end▁of▁sentence｜>") == (1, False, False, True)


@pytest.mark.parametrize("body", ["<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>",
                                  "<｜tool▁calls▁begin｜>" + DS_CALL.format("f", "[1]") + "<｜tool▁calls▁end｜>",
                                  "<｜tool▁calls▁begin｜>" + DS_CALL.format("f", "{}") + "stray<｜tool▁calls▁end｜>",
                                  "<｜tool▁calls▁begin｜>" + DS_CALL.format("two words", "{}") + "<｜tool▁calls▁end｜>"])
def test_deepseek_v31_invalid_sections_stay_content(body):
    result = deepseek.parse("Here: " + body)
    assert result.tool_calls == [] and result.invalid == [body] and body in result.content


# -- round trips (hypothesis) ----------------------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers(-10**18, 10**18)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
                | st.sampled_from(["</tool_call>", "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "}", "]", "{[",
                                   '"', "\\", "\\\"", ";", "\n"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
arguments_dicts = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)
call_lists = st.lists(st.tuples(names, arguments_dicts), min_size=1, max_size=3)


def expressible(family: str, tool_calls: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """The calls as ``family`` can write them: pythonic names and keywords are Python identifiers;
    qwen3_coder's parameter names have no ``>`` or newline, its values (text) never close an element, and
    its calls' names differ (each is typed by a schema of its own: `schemas_of`); glm45's likewise, its keys
    without ``<`` or blanks."""
    if family == "qwen3_coder":
        def fits(value) -> bool:
            written = value if isinstance(value, str) else json.dumps(value)
            return not any(tag in written for tag in ("</parameter>", "</function>", "</tool_call>"))
        return [(f"{n}_{i}", {f"k{j}_" + "".join(ch for ch in k if ch not in ">\n"): v
                              for j, (k, v) in enumerate(a.items()) if fits(v)}) for i, (n, a) in enumerate(tool_calls)]
    if family in ("glm45", "glm47"):  # (keys without "<" or blanks: the parser strips a key's blanks)
        def fits_glm(value) -> bool:
            written = value if isinstance(value, str) else json.dumps(value)
            return not any(tag in written for tag in ("</arg_value>", "</tool_call>"))
        return [(f"{n}_{i}", {f"k{j}_" + "".join(ch for ch in k if ch != "<" and not ch.isspace()): v
                              for j, (k, v) in enumerate(a.items()) if fits_glm(v)})
                for i, (n, a) in enumerate(tool_calls)]
    if family != "pythonic":
        return tool_calls
    def ident(text: str, i: int) -> str:
        text = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in text if ch.isascii())
        return f"k{i}_{text}"
    return [(".".join(ident(part, 0) for part in name.split(".")),
             {ident(k, i): v for i, (k, v) in enumerate(a.items())}) for name, a in tool_calls]


def render(family: str, tool_calls: list[tuple[str, dict]], variant: int, ascii_: bool) -> str:
    """The text a model of ``family`` would generate for these calls (variant picks among the forms)."""
    dumps = lambda obj: json.dumps(obj, ensure_ascii=ascii_, indent=None if variant % 2 else 1)  # noqa: E731
    if family == "pythonic":  # values as JSON (as a grammar writes them) or as Python literals
        value = dumps if variant % 2 else repr
        calls_ = ", ".join(f"{n}({', '.join(f'{k}={value(v)}' for k, v in a.items())})" for n, a in tool_calls)
        return ("<|python_start|>" if variant == 3 else "") + f"[{calls_}]"
    if family == "qwen3_coder":
        return "\n".join(xml_call(n, {k: v if isinstance(v, str) else dumps(v) for k, v in a.items()})
                         for n, a in tool_calls)
    if family in ("glm45", "glm47"):  # GLM-4.5's newlines, or GLM-4.7's compact form
        return "\n".join(glm_call(n, {k: v if isinstance(v, str) else dumps(v) for k, v in a.items()}, variant % 2 == 0)
                         for n, a in tool_calls)
    if family == "deepseek_v31":
        return "<｜tool▁calls▁begin｜>" + "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{dumps(a)}<｜tool▁call▁end｜>"
                                                 for n, a in tool_calls) + "<｜tool▁calls▁end｜>"
    if family == "hermes":
        sep = "\n" if variant % 2 else ""
        return sep.join(f"<tool_call>\n{dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in tool_calls)
    if family == "llama3_json":
        tag = "<|python_tag|>" if variant % 2 else ""
        return tag + "; ".join(dumps({"name": n, "parameters": a}) for n, a in tool_calls)
    if variant % 2:
        return "[TOOL_CALLS]" + dumps([{"name": n, "arguments": a, "id": "abcdefghi"} for n, a in tool_calls])
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a)}" for n, a in tool_calls)


def schemas_of(tool_calls: list[tuple[str, dict]]) -> dict[str, dict]:
    """Each call's parameters schema: each value's own JSON type (qwen3_coder reads values by it)."""
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return {n: {"type": "object", "properties": {k: {"type": kinds[type(v)]} if v is not None else {"type": "null"}
                                                 for k, v in a.items()}} for n, a in tool_calls}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(sorted(PARSERS)), tool_calls=call_lists, variant=st.integers(0, 3),
       ascii_=st.booleans(), content=st.text(max_size=20))
def test_parse_round_trips_rendered_calls(family, tool_calls, variant, ascii_, content):
    parser = get_tool_parser(family)
    tool_calls = expressible(family, tool_calls)
    body = render(family, tool_calls, variant, ascii_)
    if family == "pythonic" or (family == "llama3_json" and not body.startswith("<|python_tag|>")):
        content = ""  # untagged Llama calls and pythonic lists must start the message
    elif any(marker in content for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<｜tool▁calls▁begin｜>")):
        content = ""
    text = content + body
    result = parser.parse(text, schemas_of(tool_calls))
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == tool_calls
    assert all(c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False) for c in result.tool_calls)
    assert all(c.raw in text for c in result.tool_calls)
    assert result.invalid == [] and result.content == content.strip()
    assert not parser.pending_call_open(text) and parser.may_continue_with_call(text)
    assert not parser.turn_done(text)


small_call_lists = st.lists(st.tuples(names, st.dictionaries(st.text(max_size=4), json_values, max_size=2)),
                            min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(sorted(PARSERS)), tool_calls=small_call_lists, variant=st.integers(0, 3))
def test_streaming_prefixes_never_pause_inside_a_run_of_calls(family, tool_calls, variant):
    """Over every prefix of a run of calls: counts only grow, an open span and a possible next call exclude
    each other, and turn_done stays false (between calls, the next opening marker may always follow)."""
    parser = get_tool_parser(family)
    text = render(family, expressible(family, tool_calls), variant, ascii_=False)
    previous = 0
    for i in range(len(text) + 1):
        count, pending, may_continue, done = state(parser, text[:i])
        assert count >= previous
        assert not (pending and may_continue)
        assert not done, text[:i]
        previous = count
    assert previous == (1 if (family == "mistral" and variant % 2) or family in ("pythonic", "deepseek_v31")
                        else len(tool_calls))  # (a list, or a section, holds them all)


fragments = st.sampled_from(["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "{", "}",
                              "[", "]", '"', "\\", ";", ",", ":", " ", "\n", '"name"', '"arguments"', '"parameters"',
                              '"f"', "f", "1", "null", "é"])


@settings(max_examples=200, deadline=None)
@given(family=st.sampled_from(sorted(PARSERS)), pieces=st.lists(fragments, max_size=30))
def test_arbitrary_text_never_breaks_the_invariants(family, pieces):
    parser = get_tool_parser(family)
    text = "".join(pieces)
    count, pending, may_continue, done = state(parser, text)
    assert not (pending and may_continue)
    assert done == (count > 0 and not pending and not may_continue)
    result = parser.parse(text)
    assert all(raw in text for raw in result.invalid) and all(c.raw in text for c in result.tool_calls)
    assert all(raw.strip() in result.content for raw in result.invalid)
    assert len(result.tool_calls) + len(result.invalid) >= count


# -- registry and model mapping --------------------------------------------------------------------

def test_registry():
    assert sorted(PARSERS) == ["deepseek_v31", "glm45", "glm47", "hermes", "llama3_json", "mistral", "pythonic",
                               "qwen3_coder"]
    for name, cls in PARSERS.items():
        parser = get_tool_parser(name)
        assert isinstance(parser, cls) and isinstance(parser, ToolParser) and parser.name == name
    with pytest.raises(ValueError, match="deepseek_v31, glm45, glm47, hermes, llama3_json, mistral, pythonic, qwen3"):
        get_tool_parser("qwen3_xml")


QWEN_TEMPLATE = ('{%- if tools %}...For each function call, return a json object with function name and arguments '
                 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
                 '<args-json-object>}\\n</tool_call><|im_end|>{%- endif %}')
LLAMA31_TEMPLATE = ("{%- if builtin_tools is defined or tools is not none %}{{- 'Environment: ipython\\n' }}"
                    "{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
                    '{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}<|eot_id|>')
LLAMA32_TEMPLATE = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                    "its value}.Do not use variables.{{- '<|eot_id|>' }}")
LLAMA3_TEMPLATE = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + content + '<|eot_id|>' }}"
MISTRAL_TEMPLATE = '{{- "[AVAILABLE_TOOLS] [" }}...{{- "[TOOL_CALLS] [" }}...{{- "[/AVAILABLE_TOOLS]" }}'
# vLLM's pythonic templates (Llama 3.2, Llama 4) ask for calls so; they also write <|eot_id|> / <|python_tag|>
PYTHONIC_TEMPLATE = ("{{- 'If you decide to invoke any of the function(s), you MUST put it in the format of "
                     "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]' }}"
                     "{{- '<|python_tag|>' }}{{- '<|eot_id|>' }}")
QWEN3_CODER_TEMPLATE = ("{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                        "{{- '<parameter=' + args_name + '>\\n' }}{{- '\\n</parameter>\\n' }}")
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
                   "+ '<|im_end|>' + '\\n'}}{% endfor %}")


@pytest.mark.parametrize("model_type, template, expected", [
    ("qwen2", QWEN_TEMPLATE, "hermes"),
    ("qwen3", None, "hermes"),
    ("qwen2", "", "hermes"),
    ("llama", QWEN_TEMPLATE, "hermes"),  # a Hermes fine-tune of Llama
    ("llama", LLAMA31_TEMPLATE, "llama3_json"),
    ("llama", LLAMA32_TEMPLATE, "llama3_json"),
    ("llama", LLAMA3_TEMPLATE, "hermes"),  # Llama 3.0: no tool section
    ("llama", CHATML_TEMPLATE, "hermes"),  # SmolLM2
    ("llama", None, "hermes"),
    ("qwen2", LLAMA32_TEMPLATE, "hermes"),  # the "parameters" heuristic is for Llama model types only
    ("mistral", MISTRAL_TEMPLATE, "mistral"),
    ("mistral", "[INST] {{ content }} [/INST]", "hermes"),  # Mistral v0.1: no tools
    ("llama", PYTHONIC_TEMPLATE, "pythonic"),
    ("llama4", PYTHONIC_TEMPLATE, "pythonic"),
    ("qwen3_moe", QWEN3_CODER_TEMPLATE, "qwen3_coder"),  # Qwen3-Coder: <tool_call> too, but XML inside
    ("glm4_moe", "{{ '\\n<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>", "glm45"),
    ("deepseek_v3", "{{'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments + '<｜tool▁call▁end｜>'}}",
     "deepseek_v31"),
    ("deepseek_v3", "{{'<｜tool▁call▁begin｜>' + type + '<｜tool▁sep｜>' + name + '\\n```json\\n' + arguments}}",
     "hermes"),  # DeepSeek-V3's fenced JSON: vLLM's deepseek_v3 (--backend vllm)
])
def test_parser_for_model(model_type, template, expected):
    assert parser_for_model(model_type, template) == expected


# -- no torch --------------------------------------------------------------------------------------

def test_module_imports_only_stdlib():
    assert non_stdlib_imports(MODULE) == []


def test_module_loads_without_torch():
    """Through the package (`infercept.engine` exports lazily): torch and numpy never load."""
    probe = textwrap.dedent("""
        import sys
        import infercept.engine.tool_parsers as module
        assert module.get_tool_parser("hermes").parse("<tool_call>{\\"name\\": \\"f\\"}</tool_call>").tool_calls
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy"))
        assert not leaked, leaked
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- the judge: which calls count ------------------------------------------------------------------

def test_call_judge_keeps_calls_of_known_tools_with_valid_arguments():
    from infercept.engine.tool_format import CallJudge, ToolSpec

    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    search, clock = ToolSpec.function("search", schema), ToolSpec.function("clock")
    good, bad = hermes_call("search", {"q": "x"}), hermes_call("search", {"q": 3})
    unknown = hermes_call("launch", {})
    judge = CallJudge("hermes", (search, clock))
    verdict = judge.judge(f"First. {good}\n{hermes_call('clock', {})}")
    assert [c.name for c in verdict.calls] == ["search", "clock"] and verdict.complete
    assert verdict.content == "First."
    verdict = judge.judge(f"{good}\n{bad}\n{unknown}")  # the others' text stays, in place
    assert [c.name for c in verdict.calls] == ["search"] and not verdict.complete
    assert verdict.content == f"{bad}\n{unknown}"
    assert judge.judge("no call here") is None
    assert not judge.judge(unknown).calls
    one = CallJudge("hermes", (search, clock), parallel=False).judge(f"{good}\n{good}")
    assert len(one.calls) == 1 and not one.complete  # the second call would never get a result
    anything = CallJudge("hermes").judge(unknown)  # no tools given: every well-formed call counts
    assert [c.name for c in anything.calls] == ["launch"] and anything.complete
    prefixed = CallJudge("hermes", (search,), text_prefix=good[:20])
    assert prefixed.turn_done(good[20:] + "\nDone") and prefixed.judge(good[20:]).calls[0].name == "search"

