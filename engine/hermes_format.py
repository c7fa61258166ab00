"""The Hermes tool-call format beyond parsing: how calls are written, prompted, forced and streamed.

``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` (Qwen2.5, Qwen3, Hermes, and the prompt
the server gives templates without a tool section, such as SmolLM2's). Parsing is `HermesToolParser`'s
(tool_parsers.py); this module writes the rest:

* **Prompt** for templates without a tool section: a Hermes tool system prompt and two example
  exchanges built from the first tool (`tool_prompt`, `example_exchanges`).
* **Grammars** (llguidance Lark): a forced turn starts with a prefill of the call's fixed opening and
  `calls_grammar` takes it from there: names of the allowed tools only, arguments that follow each
  tool's schema, written as ``json.dumps`` writes them; with an answer schema a turn may be calls or a
  JSON answer; `text_without_grammar` is text that never opens a call (tool_choice "none").
* **Streaming**: `partial_calls` follows calls written in exactly the grammar's form while they are
  generated, so a stream can show a guided call's arguments token by token.

Pure standard library; tools are `ToolSpec`s (tool_format.py), not a wire type.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tool_spec import ToolSpec

OPENER = "<tool_call>"
CALL = OPENER + "\n{body}\n</tool_call>"
CALL_HEAD = OPENER + '\n{"name": '  # json.dumps of {"name": ..., "arguments": ...} starts so
CALL_TAIL = "}\n</tool_call>"

# The arguments' JSON is written as json.dumps writes it, as in the tool prompt's examples; flexible
# whitespace would also let a small model wander into endless blank lines.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_text(name: str, arguments: Any) -> str:
    return CALL.format(body=json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False))


def call_start(name: str) -> str:
    """A call's text up to its arguments (which follow, then `CALL_TAIL`)."""
    return CALL_HEAD + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def forced_prefill(tool_name: str | None) -> str:
    """Text that starts a turn that must call `tool_name` (None: any tool)."""
    return CALL_HEAD + '"' if tool_name is None else call_start(tool_name)


# -- grammars ----------------------------------------------------------------------------------------

def json_grammar_schema(schema: dict) -> dict:
    """`schema` with llguidance's JSON style of the tool prompt (see `JSON_STYLE`)."""
    return schema | {"x-guidance": JSON_STYLE}


def calls_grammar(tools: Sequence[ToolSpec], prefill: str, parallel: bool, answer_schema: dict | None = None) -> str:
    """Lark grammar (llguidance) of what a turn generates after `prefill`: the rest of a call of one of
    the `tools` whose call text starts with `prefill`, then, with `parallel`, more calls, one per line.
    Each call's arguments follow its tool's parameters schema. With `answer_schema` (a turn that may
    answer instead of calling, under a JSON response_format), the turn may also be a JSON answer that
    follows it."""
    def call(i: int, before_arguments: str) -> str:  # a JSON string literal is a Lark one too
        return " ".join(([json.dumps(before_arguments)] if before_arguments else [])
                        + [f"args{i}", json.dumps(CALL_TAIL)])

    starts = [call_start(tool.name) for tool in tools]
    first = [i for i, start in enumerate(starts) if start.startswith(prefill)]
    if not first:
        raise ValueError(f"no tool's call starts with {prefill!r}")
    if answer_schema is not None and prefill:
        raise ValueError("a prefilled turn is a call: it cannot answer instead")
    lines = ["start: calls" + (" | answer" if answer_schema is not None else ""),
             "calls: first" + (' ("\\n" call)*' if parallel else ""),
             "first: " + " | ".join(call(i, starts[i][len(prefill):]) for i in first)]
    if parallel:
        lines.append("call: " + " | ".join(call(i, start) for i, start in enumerate(starts)))
    for i in range(len(tools)) if parallel else first:
        lines.append(f"args{i}: %json {json.dumps(json_grammar_schema(tools[i].arguments_schema))}")
    if answer_schema is not None:
        lines.append(f"answer: %json {json.dumps(json_grammar_schema(answer_schema))}")
    return "\n".join(lines)


def text_without_grammar(opener: str) -> str:
    """Lark grammar (llguidance) of text that never writes `opener` and does not start (after blanks)
    with its first character. A model that means to call starts its turn with the opener: refused the
    first character, its next choice is the answer itself. Later in the text only the whole opener is
    refused, at the token that would complete it (which leaves an odd fragment, but no call)."""
    return (f"start: TEXT\nTEXT: /(?s:\\s*([^{re.escape(opener[0])}\\s].*)?)/"
            f" & ~/(?s:.*{re.escape(opener)}.*)/")


# -- calls while they stream -------------------------------------------------------------------------

@dataclass(frozen=True)
class PartialCall:
    """A call as far as it is written: its name is complete, its arguments maybe not."""

    name: str
    arguments: str  # JSON text written so far
    complete: bool  # the arguments object is closed


_PARTIAL_HEAD = re.compile(re.escape(CALL_HEAD) + r'("(?:[^"\\]|\\.)*"), "arguments": ')
_JSON = json.JSONDecoder()


def partial_calls(text: str) -> list[PartialCall]:
    """The calls in `text` written in exactly the form `calls_grammar` allows, in order: those whose
    name is complete, the last one possibly still being written."""
    calls: list[PartialCall] = []
    pos = 0
    while (head := _PARTIAL_HEAD.search(text, pos)) is not None:
        name = json.loads(head.group(1))
        try:
            _, end = _JSON.raw_decode(text, head.end())
        except ValueError:  # still open: everything after the head is arguments so far
            calls.append(PartialCall(name, text[head.end():], False))
            break
        calls.append(PartialCall(name, text[head.end():end], True))
        pos = end
    return calls


# -- the prompt for templates without a tool section -------------------------------------------------

def tool_prompt(tools: Sequence[ToolSpec]) -> str:
    signatures = "\n".join(json.dumps(t.definition, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


_VERB_PREFIX = re.compile(r"^(get|fetch|lookup|look_up|find|search|query|check|read|retrieve|compute)[_\-]")
_LOCATION_WORDS = ("city", "location", "place", "country", "region", "town", "where", "address")
_SAMPLES = {"string": ("Rome", "Berlin"), "integer": (3, 7), "number": (2.5, 4.0), "boolean": (True, False),
            "array": ([], []), "object": ({}, {})}


def _sample_value(schema: dict, k: int) -> Any:
    for key in ("examples", "enum"):
        values = schema.get(key)
        if isinstance(values, list) and values:
            return values[k % len(values)]
    if "default" in schema:
        return schema["default"]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    return _SAMPLES.get(kind if isinstance(kind, str) else "string", _SAMPLES["string"])[k]


def example_exchanges(tool: ToolSpec) -> list[dict]:
    """Two user questions, each answered by a call of `tool`, arguments built from its schema.

    Small models follow a demonstration far better than an instruction: with these, SmolLM2-135M
    answers "What is the weather in Paris?" with a well-formed get_weather call. (Examples that also
    show a tool result and an answer make it imitate the tool result instead, so there are none.)
    """
    params = tool.parameters or {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = [p for p in params.get("required") or [] if p in props] or list(props)[:1]
    subject = _VERB_PREFIX.sub("", tool.name).replace("_", " ").replace("-", " ").strip() or tool.name
    prep = "in" if any(w in p.lower() for p in required for w in _LOCATION_WORDS) else "for"
    messages = []
    for k in range(2):
        args = {p: _sample_value(props[p] if isinstance(props[p], dict) else {}, k) for p in required}
        shown = [v for v in args.values() if isinstance(v, (str, int, float)) and not isinstance(v, bool)]
        question = f"What is the {subject}" + (f" {prep} {' and '.join(map(str, shown))}" if shown else "") + "?"
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": call_text(tool.name, args)}]
    return messages
