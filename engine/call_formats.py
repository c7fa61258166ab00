"""How each chat family writes tool calls: prefills and grammars that force, allow or forbid calls, and
the calls a stream may show while they are written. `ToolFormat` (tool_format.py) picks one writer per
family; parsing stays the parsers' (tool_parsers.py).

Every writer has the same five answers:

* ``forced_prefill(name)`` -- fixed text the server puts at the end of the prompt of a forced turn
  (tool_choice "required": name None; a named tool_choice: that tool), read by the parser before the
  generated text (`InterceptParams.text_prefix`);
* ``forced_grammar(tools, name, parallel)`` -- Lark (llguidance) of the rest of a forced turn: calls of
  the allowed tools only, each one's arguments following its parameters schema;
* ``answer_or_call_grammar(tools, parallel, answer_schema)`` -- an auto turn under a JSON
  response_format: calls, or a JSON answer that follows the schema;
* ``no_call_grammar()`` -- tool_choice "none": text that never opens a call;
* ``partial_calls(text)`` -- the calls of a grammar-written turn as far as they are written.

The forms written, each the form the family's chat template renders a past call in (so a paused turn
and the conversation that resumes it agree):

``llama3_json``  ``{"name": "f", "parameters": {...}}``, untagged, one call per message (the Llama
                 3.1/3.2 templates render a single call; several calls refuse there).
``mistral``      ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` (templates up to v7), or,
                 for templates that write ``[ARGS]`` (v11+: Mistral Small 3.2, Magistral, Devstral),
                 ``[TOOL_CALLS]f[ARGS]{...}``, each parallel call with its own ``[TOOL_CALLS]``.
``pythonic``     ``[f(a=1, b="x"), g()]``: the keyword arguments in the schema's property order,
                 required ones always, optional ones maybe, each value JSON that follows its property's
                 schema (JSON literals are pythonic values to the parser).
``qwen3_coder``  ``\\n<tool_call>\\n<function=f>\\n<parameter=a>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``
                 per call: the parameters in the schema's property order, a value whose schema allows
                 only strings as text, any other as JSON (the parser types the values by the schema).
``deepseek_v31`` ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``:
                 every call after the section's opening, its arguments JSON.
``glm45``        ``\\n<tool_call>f\\n<arg_key>a</arg_key>\\n<arg_value>value</arg_value>\\n</tool_call>`` per call
                 (GLM-4.5, 4.6), or the same without its newlines where the template writes it so
                 (GLM-4.7): the parameters and values as qwen3_coder's.

Special tokens in a grammar: ``[TOOL_CALLS]`` and ``[ARGS]`` are single tokens of Mistral's
vocabularies (DeepSeek's markers of its own), which a grammar names by id (``<[id]>``); without the id (a
vocabulary where they are plain text) the grammar writes them as text. The JSON is written as
``json.dumps`` / the templates' ``tojson`` writes it (hermes_format.JSON_STYLE).

Pure standard library.
"""
from __future__ import annotations

import ast
import json
import keyword
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from . import hermes_format as hermes
from .hermes_format import PartialCall, json_grammar_schema
from .tool_parsers import (DeepSeekV31ToolParser, Glm4ToolParser, PythonicToolParser, Qwen3CoderToolParser, ToolCall,
                           _resolved, value_types)

if TYPE_CHECKING:
    from .tool_spec import ToolSpec

_JSON = json.JSONDecoder()
_NAME = r'("(?:[^"\\]|\\.)*")'  # a JSON string literal


def _lit(text: str) -> str:
    """A Lark string literal (a JSON string literal is one)."""
    return json.dumps(text)


def _json_rule(rule: str, schema: Mapping) -> str:
    return f"{rule}: %json {json.dumps(json_grammar_schema(dict(schema)))}"


def _allowed(tools: Sequence[ToolSpec], tool_name: str | None) -> list[int]:
    allowed = [i for i, t in enumerate(tools) if tool_name is None or t.name == tool_name]
    if not allowed:
        raise ValueError(f"no tool named {tool_name!r}")
    return allowed


def _text_grammar(regex: str, *refused: str) -> str:
    """Lark of text matching `regex` that matches none of the `refused` regexes (all ``(?s:...)``)."""
    return "start: TEXT\nTEXT: " + " & ".join([f"/{regex}/"] + [f"~/{r}/" for r in refused])


def _answer(answer_schema: dict) -> str:
    return _json_rule("answer", answer_schema)


class Writer:
    """The Hermes writer's interface (hermes_format.py), and the default answers."""

    family = "hermes"
    openers: tuple[str, ...] = (hermes.OPENER,)

    def forced_prefill(self, tool_name: str | None) -> str:
        return hermes.forced_prefill(tool_name)

    def forced_grammar(self, tools: Sequence[ToolSpec], tool_name: str | None, parallel: bool) -> str:
        allowed = [t for t in tools if tool_name is None or t.name == tool_name]
        return hermes.calls_grammar(allowed, self.forced_prefill(tool_name), parallel)

    def answer_or_call_grammar(self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict) -> str:
        return hermes.calls_grammar(tools, "", parallel, answer_schema)

    def no_call_grammar(self) -> str:
        return hermes.text_without_grammar(hermes.OPENER)

    def partial_calls(self, text: str) -> list[PartialCall]:
        return hermes.partial_calls(text)

    def safe_content(self, text: str) -> str:
        """The part of `text` that cannot belong to a tool call: before the first call opener (or a
        trailing piece that may still become one), trailing whitespace held back."""
        cut = len(text)
        for opener in self.openers:
            at = text.find(opener)
            if at >= 0:
                cut = min(cut, at)
            for k in range(min(len(opener) - 1, len(text)), 0, -1):
                if text.endswith(opener[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return text[:cut].rstrip()


def _json_partial_calls(text: str, pos: int, head: re.Pattern, between: str, limit: int | None = None
                        ) -> list[PartialCall]:
    """Calls written as ``head`` (a regex whose group 1 is the name's JSON string) + arguments + ``}``,
    the first at `pos`, each next one after ``}`` + `between`: those whose name is complete, the last
    possibly still being written."""
    calls: list[PartialCall] = []
    while limit is None or len(calls) < limit:
        m = head.match(text, pos)
        if m is None:
            break
        name = json.loads(m.group(1))
        try:
            _, end = _JSON.raw_decode(text, m.end())
        except ValueError:  # still open: everything after the head is arguments so far
            calls.append(PartialCall(name, text[m.end():], False))
            break
        calls.append(PartialCall(name, text[m.end():end], True))
        pos = end + 1 + len(between)
        if not text.startswith("}" + between, end):
            break
    return calls


class Llama3JsonWriter(Writer):
    """``{"name": "f", "parameters": {...}}``, one call (module docstring)."""

    family = "llama3_json"
    openers = ("<|python_tag|>", "{")
    HEAD = '{"name": '
    _head = re.compile(r'\{"name": ' + _NAME + r', "parameters": ')
    _blank = re.compile(r"\s*")

    def _start(self, name: str) -> str:
        return self.HEAD + json.dumps(name, ensure_ascii=False) + ', "parameters": '

    def forced_prefill(self, tool_name: str | None) -> str:
        return self.HEAD + '"' if tool_name is None else self._start(tool_name)

    def _calls(self, tools: Sequence[ToolSpec], indices: list[int], prefill: str) -> list[str]:
        lines = ["call: " + " | ".join(" ".join(([_lit(self._start(tools[i].name)[len(prefill):])]
                                                 if self._start(tools[i].name) != prefill else [])
                                                + [f"args{i}", _lit("}")]) for i in indices)]
        return lines + [_json_rule(f"args{i}", tools[i].arguments_schema) for i in indices]

    def forced_grammar(self, tools: Sequence[ToolSpec], tool_name: str | None, parallel: bool) -> str:
        return "\n".join(["start: call"] + self._calls(tools, _allowed(tools, tool_name),
                                                         self.forced_prefill(tool_name)))

    def answer_or_call_grammar(self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict) -> str:
        # A call and a JSON answer both open with "{": each is one %json (a call as the object schema
        # {"name": its name, "parameters": its schema}, keys in that order), so the grammar's lexemes
        # agree on the shared opening. The parameters' $defs move to the call's root, where their
        # "#/$defs/..." references now point.
        def call_schema(tool: ToolSpec) -> dict:
            parameters = dict(tool.arguments_schema)
            defs = {k: parameters.pop(k) for k in ("$defs", "definitions") if k in parameters}
            return {"type": "object", "properties": {"name": {"const": tool.name}, "parameters": parameters},
                    "required": ["name", "parameters"], "additionalProperties": False, **defs}

        return "\n".join(["start: " + " | ".join(f"call{i}" for i in range(len(tools))) + " | answer"]
                         + [_json_rule(f"call{i}", call_schema(tool)) for i, tool in enumerate(tools)]
                         + [_answer(answer_schema)])

    def no_call_grammar(self) -> str:
        # A call opens a message with "{" or is tagged: refuse a first "{" (the model's next choice is
        # its answer) and the tag written as text (the tag token is not text: no text grammar allows it).
        return _text_grammar(r"(?s:\s*([^{\s].*)?)", r"(?s:.*<\|python_tag\|>.*)")

    def partial_calls(self, text: str) -> list[PartialCall]:
        return _json_partial_calls(text, self._blank.match(text).end(), self._head, "", limit=1)


class _MarkerWriter(Writer):
    """A format whose call markers may be tokens of the vocabulary (`token_ids`: their ids)."""

    def __init__(self, token_ids: Mapping[str, int] | None = None):
        self.token_ids = dict(token_ids or {})

    def _token(self, text: str) -> str:
        """A marker in a grammar: its special token by id, or text where the vocabulary has none."""
        token_id = self.token_ids.get(text)
        return _lit(text) if token_id is None else f"<[{token_id}]>"


def _named_json_calls(text: str, pos: int, head: re.Pattern, after: str) -> list[PartialCall]:
    """Calls written as ``head`` (a regex whose group 1 is the name) + JSON arguments + `after`, the first
    at `pos`, each next one right after: those whose name is complete, the last possibly still being
    written."""
    calls: list[PartialCall] = []
    while (m := head.match(text, pos)) is not None:
        try:
            _, end = _JSON.raw_decode(text, m.end())
        except ValueError:  # still open: everything after the head is arguments so far
            calls.append(PartialCall(m.group(1), text[m.end():], False))
            break
        calls.append(PartialCall(m.group(1), text[m.end():end], True))
        if not text.startswith(after, end):
            break
        pos = end + len(after)
    return calls


class MistralWriter(_MarkerWriter):
    """``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` (module docstring)."""

    family = "mistral"
    MARK = "[TOOL_CALLS]"
    openers = (MARK,)
    OPEN = MARK + " ["
    _head = re.compile(r'\{"name": ' + _NAME + r', "arguments": ')
    _open = re.compile(r"\s*\[TOOL_CALLS\]\s*\[")

    def _element(self, name: str) -> str:
        return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '

    def forced_prefill(self, tool_name: str | None) -> str:
        return self.OPEN + ('{"name": "' if tool_name is None else self._element(tool_name))

    def _call_rules(self, tools: Sequence[ToolSpec], indices: list[int], prefill: str, parallel: bool) -> list[str]:
        first = " | ".join(" ".join(([_lit(self._element(tools[i].name)[len(prefill):])]
                                     if self._element(tools[i].name) != prefill else [])
                                    + [f"args{i}", _lit("}")]) for i in indices)
        lines = [f"first: {first}"]
        everyone = list(range(len(tools))) if parallel else indices
        if parallel:
            lines.append("call: " + " | ".join(f"{_lit(self._element(tools[i].name))} args{i} {_lit('}')}"
                                               for i in everyone))
        return lines + [_json_rule(f"args{i}", tools[i].arguments_schema) for i in everyone]

    def forced_grammar(self, tools: Sequence[ToolSpec], tool_name: str | None, parallel: bool) -> str:
        prefill = self.forced_prefill(tool_name)[len(self.OPEN):]
        rest = ' (", " call)*' if parallel else ""
        return "\n".join([f'start: first{rest} "]"']
                         + self._call_rules(tools, _allowed(tools, tool_name), prefill, parallel))

    def answer_or_call_grammar(self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict) -> str:
        rest = ' (", " call)*' if parallel else ""
        return "\n".join(["start: calls | answer", f'calls: {self._token(self.MARK)} " [" first{rest} "]"']
                         + self._call_rules(tools, list(range(len(tools))), "", parallel)
                         + [_answer(answer_schema)])

    def no_call_grammar(self) -> str:
        # A call opens with the [TOOL_CALLS] token, which no text grammar allows; the marker written
        # as text would parse too, so that is refused as well.
        return _text_grammar(r"(?s:.*)", r"(?s:.*\[TOOL_CALLS\].*)")

    def partial_calls(self, text: str) -> list[PartialCall]:
        m = self._open.match(text)
        return [] if m is None else _json_partial_calls(text, m.end(), self._head, ", ")


class MistralArgsWriter(MistralWriter):
    """v11+: ``[TOOL_CALLS]f[ARGS]{...}``, each call with its own ``[TOOL_CALLS]`` (module docstring)."""

    ARGS = "[ARGS]"
    _call = re.compile(r"\s*\[TOOL_CALLS\]([A-Za-z0-9_.:\-]+)\[ARGS\]")

    def forced_prefill(self, tool_name: str | None) -> str:
        return self.MARK + ("" if tool_name is None else tool_name + self.ARGS)

    def _calls(self, tools: Sequence[ToolSpec], indices: list[int]) -> list[str]:
        args = self._token(self.ARGS)
        return ["call: " + " | ".join(f"{_lit(tools[i].name)} {args} args{i}" for i in indices)]

    def forced_grammar(self, tools: Sequence[ToolSpec], tool_name: str | None, parallel: bool) -> str:
        allowed = _allowed(tools, tool_name)
        everyone = list(range(len(tools))) if parallel else allowed
        more = f" ({self._token(self.MARK)} call)*" if parallel else ""
        if tool_name is None:
            lines = [f"start: call{more}"] + self._calls(tools, everyone)
        else:  # the prefill wrote the name and [ARGS]: its arguments follow
            lines = [f"start: args{allowed[0]}{more}"] + (self._calls(tools, everyone) if parallel else [])
        return "\n".join(lines + [_json_rule(f"args{i}", tools[i].arguments_schema)
                                  for i in sorted(set(everyone) | set(allowed))])

    def answer_or_call_grammar(self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict) -> str:
        mark = self._token(self.MARK)
        calls = f"calls: {mark} call" + (f" ({mark} call)*" if parallel else "")
        everyone = list(range(len(tools)))
        return "\n".join(["start: calls | answer", calls] + self._calls(tools, everyone)
                         + [_json_rule(f"args{i}", tools[i].arguments_schema) for i in everyone]
                         + [_answer(answer_schema)])

    def partial_calls(self, text: str) -> list[PartialCall]:
        return _named_json_calls(text, 0, self._call, "")


# -- deepseek_v31 ------------------------------------------------------------------------------------

class DeepSeekV31Writer(_MarkerWriter):
    """``<｜tool▁calls▁begin｜>`` + ``<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` per call +
    ``<｜tool▁calls▁end｜>``, as DeepSeek-V3.1's template renders past calls (module docstring)."""

    family = "deepseek_v31"
    P = DeepSeekV31ToolParser
    openers = (P.OPEN,)
    _call = re.compile(r"\s*<｜tool▁call▁begin｜>([^\s<]+)<｜tool▁sep｜>")

    def forced_prefill(self, tool_name: str | None) -> str:
        return self.P.OPEN + self.P.CALL + ("" if tool_name is None else tool_name + self.P.SEP)

    def _grammar(self, tools: Sequence[ToolSpec], first: list[int], named: bool, parallel: bool,
                 answer_schema: dict | None = None) -> str:
        """The calls after the prefill (`answer_schema`: after nothing, or the JSON answer instead): the
        first of the tools `first` (`named`: its name and separator written already), then, `parallel`,
        calls of any tool, then the section's end."""
        sep, end = self._token(self.P.SEP), self._token(self.P.CALL_END)
        later = list(range(len(tools))) if parallel else []

        def call(i: int) -> str:
            return f"{_lit(tools[i].name)} {sep} args{i} {end}"

        lines = ["first: " + (f"args{first[0]} {end}" if named else " | ".join(call(i) for i in first))]
        if parallel:
            lines.append("call: " + " | ".join(call(i) for i in later))
        calls = "first" + (f" ({self._token(self.P.CALL)} call)*" if parallel else "") + " " + self._token(self.P.CLOSE)
        if answer_schema is None:
            lines.insert(0, f"start: {calls}")
        else:
            opening = f"{self._token(self.P.OPEN)} {self._token(self.P.CALL)}"
            lines[:0] = ["start: calls | answer", f"calls: {opening} {calls}"]
            lines.append(_answer(answer_schema))
        schemas = [_json_rule(f"args{i}", tools[i].arguments_schema) for i in sorted(set(first) | set(later))]
        return "\n".join(lines + schemas)

    def forced_grammar(self, tools: Sequence[ToolSpec], tool_name: str | None, parallel: bool) -> str:
        return self._grammar(tools, _allowed(tools, tool_name), tool_name is not None, parallel)

    def answer_or_call_grammar(self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict) -> str:
        return self._grammar(tools, list(range(len(tools))), False, parallel, answer_schema)

    def no_call_grammar(self) -> str:
        # The section opens with its marker token, which no text grammar allows; as text it would parse
        # too, so that is refused as well.
        return _text_grammar(r"(?s:.*)", r"(?s:.*<｜tool▁calls▁begin｜>.*)")

    def partial_calls(self, text: str) -> list[PartialCall]:
        start = len(text) - len(text.lstrip())
        if not text.startswith(self.P.OPEN, start):
            return []
        return _named_json_calls(text, start + len(self.P.OPEN), self._call, self.P.CALL_END)


# -- pythonic ----------------------------------------------------------------------------------------

_SCHEMA_KEYS = {"type", "properties", "required", "additionalProperties", "$defs", "definitions", "title",
                "description", "$schema", "$id", "$comment", "examples", "default", "strict"}


def _identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def _dotted(name: str) -> bool:
    return all(_identifier(part) for part in name.split("."))


class _CallListWriter(Writer):
    """A format whose calls follow one another, each a tool's name and its arguments' rules (pythonic,
    qwen3_coder): the grammars of a forced turn (after its prefill) and of calls or a JSON answer.
    A subclass says how call `i` is written (`_call`, without its name where the prefill wrote it), its
    arguments' rules (`_tool_rules`), what comes between calls (`SEPARATOR`), after the last (`CLOSE`)
    and, in an answer-or-call turn that has no prefill, before the first (`OPEN`)."""

    SEPARATOR = OPEN = CLOSE = ""

    def _call(self, i: int, tool: ToolSpec, named: bool) -> str:
        raise NotImplementedError

    def _tool_rules(self, i: int, tool: ToolSpec) -> list[str]:
        raise NotImplementedError

    def _grammar(self, tools: Sequence[ToolSpec], first: list[int], skip_name: bool, parallel: bool,
                 answer_schema: dict | None = None) -> str:
        everyone = list(range(len(tools))) if parallel or answer_schema is not None else first
        lines = ["first: " + " | ".join(self._call(i, tools[i], not skip_name) for i in first)]
        rest = (f" ({_lit(self.SEPARATOR)} call)*" if parallel else "") + (f" {_lit(self.CLOSE)}" if self.CLOSE else "")
        if parallel:
            lines.append("call: " + " | ".join(self._call(i, tools[i], True) for i in everyone))
        if answer_schema is None:
            lines.insert(0, f"start: first{rest}")
        else:
            lines[:0] = ["start: calls | answer", f"calls: {_lit(self.OPEN)} first{rest}"]
            lines.append(_answer(answer_schema))
        for i in sorted(set(everyone) | set(first)):
            lines += self._tool_rules(i, tools[i])
        return "\n".join(lines)

    def forced_grammar(self, tools: Sequence[ToolSpec], tool_name: str | None, parallel: bool) -> str:
        return self._grammar(tools, _allowed(tools, tool_name), tool_name is not None, parallel)

    def answer_or_call_grammar(self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict) -> str:
        return self._grammar(tools, list(range(len(tools))), False, parallel, answer_schema)


class PythonicWriter(_CallListWriter):
    """``[f(a=1, b="x"), g()]`` (module docstring)."""

    family = "pythonic"
    openers = ("[", PythonicToolParser.START)
    SEPARATOR, OPEN, CLOSE = ", ", "[", "]"
    _parser = PythonicToolParser()
    _call_head = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\(")

    def forced_prefill(self, tool_name: str | None) -> str:
        return "[" if tool_name is None else f"[{tool_name}("

    @staticmethod
    def _keywords(i: int, tool: ToolSpec) -> list[str]:
        """Rules ``kw{i}``: the keyword arguments of tool `i` (without the parentheses), each value
        following its property's schema, in the schema's property order, required ones always."""
        schema = tool.arguments_schema
        if not _dotted(tool.name):
            raise ValueError(f"tool {tool.name!r}: a pythonic call's name must be a (dotted) Python identifier")
        if schema.get("type", "object") != "object" or set(schema) - _SCHEMA_KEYS:
            raise ValueError(f"tool {tool.name!r}: the pythonic format can enforce a parameters schema of "
                             "properties, required and additionalProperties only; this one has "
                             + ", ".join(sorted(set(schema) - _SCHEMA_KEYS) or ["a type other than object"]))
        properties = schema.get("properties") or {}
        required = [p for p in schema.get("required") or [] if isinstance(p, str)]
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        items = [(p, p in required, s) for p, s in properties.items()]
        items += [(p, True, {}) for p in required if p not in properties]
        for p, needed, _ in items:
            if needed and not _identifier(p):
                raise ValueError(f"tool {tool.name!r}: parameter {p!r} cannot be a pythonic keyword argument")
        items = [(p, needed, s) for p, needed, s in items if _identifier(p)]
        n = len(items)
        lines = [f"kw{i}: kw{i}s0"]
        for k, (p, needed, s) in enumerate(items):
            item = f"{_lit(p + '=')} v{i}x{k}"
            after = f"kw{i}r{k + 1}"
            lines.append(f"kw{i}s{k}: {item} {after}" + ("" if needed else f" | kw{i}s{k + 1}"))
            lines.append(f"kw{i}r{k}: " + (f'", " {item} {after}' if needed else f'(", " {item})? {after}'))
            value = dict(s) if isinstance(s, Mapping) else {}
            lines.append(_json_rule(f"v{i}x{k}", value | defs))  # a $ref into the tool's $defs resolves
        lines += [f'kw{i}s{n}: ""', f'kw{i}r{n}: ""']
        return lines

    def _call(self, i: int, tool: ToolSpec, named: bool) -> str:
        return (f"{_lit(tool.name + '(')} " if named else "") + f'kw{i} ")"'

    def _tool_rules(self, i: int, tool: ToolSpec) -> list[str]:
        return self._keywords(i, tool)

    def no_call_grammar(self) -> str:
        # Calls open the message with "[" (or the <|python_start|> token, which no text grammar allows).
        return _text_grammar(r"(?s:\s*([^\[\s].*)?)", r"(?s:\s*<\|python_start\|>.*)")

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The complete calls of a list being written (a pythonic call shows once its ``)`` is out:
        its arguments are not JSON until then)."""
        body = text.lstrip()
        if body.startswith(PythonicToolParser.START):
            body = body[len(PythonicToolParser.START):].lstrip()
        if not body.startswith("["):
            return []
        calls: list[PartialCall] = []
        pos = 1
        while (m := self._call_head.match(body, pos)) is not None:
            end = PythonicToolParser._list_end(body, m.end() - 1)
            if end is None:
                break
            raw = body[m.start(1):end]
            try:
                node = ast.parse(raw, mode="eval").body
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                break
            call = PythonicToolParser._call(node, raw, raw)
            if call is None:
                break
            calls.append(PartialCall(call.name, call.arguments, True))
            pos = end
            if body.startswith(", ", pos):
                pos += 2
        return calls

    def safe_content(self, text: str) -> str:
        """Calls open the message: text that does not start as a call list may all be shown."""
        body = text.lstrip()
        if not body or body.startswith(self.openers) or PythonicToolParser.START.startswith(body):
            return ""
        return text.rstrip()


# -- qwen3_coder -------------------------------------------------------------------------------------

_PARAMETER_KEYS = {"type", "enum", "const", "minLength", "maxLength", "title", "description", "default",
                   "examples", "$comment"}  # what a string parameter's grammar enforces, or may ignore


class _TaggedArgumentsWriter(_CallListWriter):
    """A call list whose arguments are tagged elements, one per parameter (qwen3_coder, glm45): the
    parameters in the schema's property order, required ones always, optional ones maybe; a parameter
    whose schema allows only strings is text (its enum's values, or any text within its length bounds
    that does not close the element), any other JSON that follows its schema. A tool without declared
    properties is called without parameters. A subclass says how an element opens (`_opening`), what
    follows its value (`VALUE_CLOSE`, starting with the closing tag `VALUE_END`), and which names its
    tags can hold (`NAME`)."""

    family: str
    VALUE_END = VALUE_CLOSE = ""
    NAME = re.compile(r"[^>\n\s]+")

    def _opening(self, name: str) -> str:
        raise NotImplementedError

    def _parameters(self, i: int, tool: ToolSpec) -> list[str]:
        """Rule ``params{i}``: the parameters of tool `i`, each element whole, its value as its schema says."""
        schema, family = tool.arguments_schema, self.family
        if not self.NAME.fullmatch(tool.name):
            raise ValueError(f"tool {tool.name!r}: the name cannot be a {family} function name")
        if schema.get("type", "object") != "object" or set(schema) - _SCHEMA_KEYS:
            raise ValueError(f"tool {tool.name!r}: the {family} format can enforce a parameters schema of "
                             "properties, required and additionalProperties only; this one has "
                             + ", ".join(sorted(set(schema) - _SCHEMA_KEYS) or ["a type other than object"]))
        properties = schema.get("properties") or {}
        required = {p for p in schema.get("required") or [] if isinstance(p, str)}
        if required - set(properties):
            raise ValueError(f"tool {tool.name!r}: required parameters without a schema: {sorted(required - set(properties))}")
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        close, end = self.VALUE_CLOSE, _regex_text(self.VALUE_END)
        lines, items = [], []
        for k, (name, value_schema) in enumerate(properties.items()):
            if not self.NAME.fullmatch(name):
                raise ValueError(f"tool {tool.name!r}: parameter {name!r} cannot be a {family} parameter name")
            rule = f"p{i}x{k}"
            items.append(rule + ("" if name in required else "?"))
            head = _lit(self._opening(name))
            value_schema = _resolved(value_schema if isinstance(value_schema, Mapping) else {}, schema)
            types = value_types(value_schema, schema)
            if types == {"string"}:
                if set(value_schema) - _PARAMETER_KEYS:
                    raise ValueError(f"tool {tool.name!r}: parameter {name!r}: {family} writes strings as text, "
                                     "whose grammar enforces enum, const, minLength and maxLength only")
                values = value_schema.get("enum") or ([value_schema["const"]] if "const" in value_schema else None)
                if values is not None and not all(isinstance(v, str) for v in values):
                    raise ValueError(f"tool {tool.name!r}: parameter {name!r}: a string whose enum holds other values")
                if values is not None:
                    lines.append(f"{rule}: {head} (" + " | ".join(_lit(v + close) for v in values) + ")")
                else:
                    low, high = int(value_schema.get("minLength", 0)), value_schema.get("maxLength")
                    bound = f"{{{low},{'' if high is None else int(high)}}}"
                    lines.append(f"{rule}: {head} V{i}X{k}")
                    lines.append(f"V{i}X{k}: /(?s:.{bound}){_regex_text(close)}/ & ~/(?s:.*{end}.*{end}.*)/")
            elif types is not None and "string" not in types:
                lines.append(f"{rule}: {head} v{i}x{k} {_lit(close)}")
                lines.append(_json_rule(f"v{i}x{k}", dict(value_schema) | defs))
            else:
                raise ValueError(f"tool {tool.name!r}: parameter {name!r}: {family} writes a value as text or "
                                 "as JSON, so its schema must allow strings only or no strings")
        return [f"params{i}: " + (" ".join(items) or '""')] + lines

    def _tool_rules(self, i: int, tool: ToolSpec) -> list[str]:
        return self._parameters(i, tool)

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The complete calls written so far, their values as text (a value is whole only once its
        element closes; ToolFormat types them by the tools' schemas)."""
        calls: list[PartialCall] = []
        pos = 0
        while (m := self._element.match(text, pos)) is not None:
            parsed = self._parser._parse_span(m.group().strip())
            if not isinstance(parsed[0], ToolCall):
                break
            calls.append(PartialCall(parsed[0].name, parsed[0].arguments, True))
            pos = m.end()
        return calls


def _regex_text(text: str) -> str:
    """`text` matched literally inside a Lark ``/.../`` regex."""
    return re.escape(text).replace("\\\n", "\\n").replace("/", "\\/")


class Qwen3CoderWriter(_TaggedArgumentsWriter):
    """``\n<tool_call>\n<function=f>\n<parameter=a>\nvalue\n</parameter>\n</function>\n</tool_call>``
    per call, as Qwen3-Coder's template renders a past call (each call after a newline)."""

    family = "qwen3_coder"
    openers = (Qwen3CoderToolParser.OPEN,)
    CALL = "\n<tool_call>\n<function="
    END = "</function>\n</tool_call>"
    SEPARATOR = OPEN = CALL
    VALUE_END = "</parameter>"
    VALUE_CLOSE = "\n</parameter>\n"
    _element = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>.*?</function>\s*</tool_call>", re.S)
    _parser = Qwen3CoderToolParser()

    def forced_prefill(self, tool_name: str | None) -> str:
        return self.CALL + ("" if tool_name is None else tool_name + ">\n")

    def _opening(self, name: str) -> str:
        return f"<parameter={name}>\n"

    def _call(self, i: int, tool: ToolSpec, named: bool) -> str:
        return (f"{_lit(tool.name + '>' + chr(10))} " if named else "") + f"params{i} {_lit(self.END)}"


class Glm4Writer(_TaggedArgumentsWriter):
    """GLM's calls as its template renders a past call: GLM-4.5 and 4.6's
    ``\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>value</arg_value>\n</tool_call>`` per call (each
    after a newline), or, where the template writes its tags without newlines (GLM-4.7),
    ``<tool_call>f<arg_key>a</arg_key><arg_value>value</arg_value></tool_call>``."""

    family = "glm45"
    openers = (Glm4ToolParser.OPEN,)
    END = Glm4ToolParser.CLOSE
    VALUE_END = "</arg_value>"
    NAME = re.compile(r"[^<>\s]+")
    _element = re.compile(r"\s*<tool_call>.*?</tool_call>", re.S)
    _parser = Glm4ToolParser()

    def __init__(self, compact: bool = False):
        self.newline = "" if compact else "\n"
        self.CALL = self.newline + Glm4ToolParser.OPEN
        self.SEPARATOR = self.OPEN = self.CALL
        self.VALUE_CLOSE = self.VALUE_END + self.newline

    def forced_prefill(self, tool_name: str | None) -> str:
        return self.CALL + ("" if tool_name is None else tool_name + self.newline)

    def _opening(self, name: str) -> str:
        return f"<arg_key>{name}</arg_key>{self.newline}<arg_value>"

    def _call(self, i: int, tool: ToolSpec, named: bool) -> str:
        return (f"{_lit(tool.name + self.newline)} " if named else "") + f"params{i} {_lit(self.END)}"


def writer_for(family: str, chat_template: str | None = None, token_ids: Mapping[str, int] | None = None) -> Writer:
    """The writer of `family`; for mistral, the v11+ form where the template writes ``[ARGS]`` (or, with
    no template, where the vocabulary has an ``[ARGS]`` token)."""
    if family == "hermes":
        return Writer()
    if family == "llama3_json":
        return Llama3JsonWriter()
    if family == "pythonic":
        return PythonicWriter()
    if family == "qwen3_coder":
        return Qwen3CoderWriter()
    if family == "deepseek_v31":
        return DeepSeekV31Writer(token_ids)
    if family in ("glm45", "glm47"):  # (GLM-4.7's template writes its tags without newlines)
        return Glm4Writer(compact="</arg_key><arg_value>" in (chat_template or ""))
    if family == "mistral":
        args = "[ARGS]" in chat_template if chat_template else "[ARGS]" in (token_ids or {})
        return MistralArgsWriter(token_ids) if args else MistralWriter(token_ids)
    raise ValueError(f"no call writer for {family!r}")
