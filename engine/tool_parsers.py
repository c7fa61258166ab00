"""Tool-call parsers: where does a generated turn contain tool calls, and when may the engine pause?

The engine calls a parser on the text generated so far in the current assistant turn (after every new
token). Parsers are stateless, so one instance can serve any number of requests. Five chat families:

``hermes``       ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3,
                 Hermes, and our own prompt for templates without a tool section, e.g. SmolLM2). Several
                 calls may follow one another (parallel calls).
``llama3_json``  Llama-3.1/3.2: the message is ``{"name": "f", "parameters": {...}}`` (``"arguments"``
                 accepted too), optionally after ``<|python_tag|>``; several calls separated by ``;``.
``mistral``      ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, and the v11+ form
                 ``[TOOL_CALLS]f[ARGS]{...}`` (also ``f[CALL_ID]id[ARGS]{...}`` and ``f{...}``).
``pythonic``     Llama 3.2 / Llama 4 pythonic templates: the message is a Python list of calls,
                 ``[f(a=1, b="x"), g()]``, optionally inside ``<|python_start|>...<|python_end|>``.
``qwen3_coder``  Qwen3-Coder: ``<tool_call>\n<function=f>\n<parameter=a>\nvalue\n</parameter>\n</function>
                 \n</tool_call>``, any number of them. A value is text; the tool's parameters schema says
                 which values are JSON (numbers, booleans, objects, ...) and which are strings as written.

Special tokens (``<|python_tag|>``, ``[TOOL_CALLS]``, ``[ARGS]``) must be kept in the detokenized text
(``<tool_call>`` is ordinary text for most Hermes-style vocabularies). Without ``<|python_tag|>`` a
Llama message still parses when it starts with the JSON object.

**Pause rule.** Every parser finds *call spans* in the text: an opening marker and everything up to the
marker or bracket that closes it. The engine pauses a generation

* on EOS (``<|im_end|>``, ``<|eot_id|>``, ``<|eom_id|>``, ``</s>``...), as for any request; or
* when :meth:`ToolParser.turn_done` is true: at least one call span is closed, no call span is open
  (:meth:`ToolParser.pending_call_open`), and the text after the last closed span can no longer start
  another call (:meth:`ToolParser.may_continue_with_call` is false) -- i.e. the model has started writing
  something else.

So ``...</tool_call>`` and ``...</tool_call>\\n<tool`` keep generating (a parallel call may follow) and
``...</tool_call>\\nThe weather`` pauses. Pausing right at the first ``</tool_call>`` would make parallel
calls impossible. The token that triggered the pause is already in the text; :meth:`ToolParser.parse`
reports it as content.

**Closing markers inside JSON strings do not count.** A ``</tool_call>``, ``}`` or ``]`` inside a JSON
string literal does not close a span, so arguments may contain any text. The price: a body with an odd
number of unescaped ``"`` never closes, and the generation runs on to EOS, where :meth:`ToolParser.parse`
reports the unclosed span as invalid.

**Invalid spans.** A call-shaped span that does not parse as a call (bad JSON, no ``"name"``, arguments
that are not an object or a JSON string holding one, unclosed at the end) is never reported as a call:
its raw text goes to :attr:`ParseResult.invalid` and stays, in place, in :attr:`ParseResult.content`, so
the server shows it to the client as text.

Pure standard library (no torch): the server imports it without the engine. Each method costs one pass
over the text (regex scans in C).
"""
from __future__ import annotations

import ast
import json
import re
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = ["PARSERS", "VLLM_PREFIX", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "ParseResult",
           "ParsedByVllm", "PythonicToolParser", "Qwen3CoderToolParser", "ToolCall", "ToolParser", "get_tool_parser", "parser_for_model",
           "vllm_parser_name"]


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call.

    ``arguments`` is the JSON text of the arguments object, normalized with
    ``json.dumps(obj, ensure_ascii=False)``; ``raw`` is the exact generated text of the call, markers
    included (``<tool_call>...</tool_call>``, ``<|python_tag|>{...}``, ``[TOOL_CALLS]f[ARGS]{...}``;
    for a Mistral JSON array, the array element; ``""`` for a call vLLM's parser found). ``id``: the id
    the parser gave the call (vLLM's parsers give one; ours none, and the server names the call).
    """

    name: str
    arguments: str
    raw: str
    id: str | None = None


@dataclass(frozen=True)
class ParseResult:
    """A parsed turn.

    ``content``: the text outside valid tool calls, stripped; the raw text of invalid spans stays in it,
    in place. ``tool_calls``: the valid calls in order. ``invalid``: the raw text of each call-shaped span
    (or Mistral array element) that failed to parse -- for logging; it is already part of ``content``.
    """

    content: str
    tool_calls: list[ToolCall]
    invalid: list[str]


@dataclass(frozen=True)
class _Span:
    """A call span: ``text[start:end]``; ``end == len(text)`` while it is still open."""

    start: int
    end: int
    closed: bool


# -- JSON scanning ----------------------------------------------------------------------------------

_OUTSIDE_STRING = re.compile(r'["{}\[\]]')
_INSIDE_STRING = re.compile(r'["\\]')


def _string_end(text: str, pos: int) -> int | None:
    """``pos`` is just after an opening ``"``: index just after the closing one, else None."""
    while True:
        m = _INSIDE_STRING.search(text, pos)
        if m is None:
            return None
        if m.group() == "\\":
            pos = m.end() + 1  # skip the escaped character
            continue
        return m.end()


def _json_end(text: str, start: int) -> int | None:
    """``text[start]`` is ``{`` or ``[``: index just after the bracket that balances it (brackets in
    strings ignored), or None while it is still open."""
    depth, pos = 0, start
    while True:
        m = _OUTSIDE_STRING.search(text, pos)
        if m is None:
            return None
        ch, pos = m.group(), m.end()
        if ch == '"':
            end = _string_end(text, pos)
            if end is None:
                return None
            pos = end
        elif ch in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return pos


def _array_items(array_text: str) -> list[str]:
    """Raw text of each top-level element of a JSON array already known to parse."""
    items: list[str] = []
    depth, pos, item_start = 0, 0, 1
    splitter = re.compile(r'["{}\[\],]')
    while True:
        m = splitter.search(array_text, pos)
        if m is None:
            return items
        ch, pos = m.group(), m.end()
        if ch == '"':
            pos = _string_end(array_text, pos) or len(array_text)
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:  # the array's own closing bracket
                last = array_text[item_start:m.start()].strip()
                if last:
                    items.append(last)
                return items
        elif depth == 1:  # a comma between elements
            items.append(array_text[item_start:m.start()].strip())
            item_start = pos


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """Strict JSON: NaN/Infinity rejected (json.dumps could not write them back as JSON)."""
    return json.loads(text, parse_constant=_reject_constant)


def _try_loads(text: str) -> tuple[bool, Any]:
    try:
        return True, _loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, NaN, over-long ints; absurd nesting
        return False, None


def _make_call(obj: Any, raw: str, arguments: Any = None, name: Any = None) -> ToolCall | None:
    """A ToolCall from a decoded ``{"name": ..., "arguments"|"parameters": ...}`` object, or None.

    Arguments may be an object or a JSON string holding an object; missing or null means ``{}``. The
    OpenAI shape ``{"type": "function", "function": {"name": ..., "arguments": ...}}`` is accepted too.
    ``name``/``arguments`` given explicitly (Mistral v11) bypass the object.
    """
    if name is None:
        if not isinstance(obj, dict):
            return None
        if "name" not in obj and isinstance(obj.get("function"), dict):
            obj = obj["function"]
        name = obj.get("name")
        if "arguments" in obj:
            arguments = obj["arguments"]
        else:
            arguments = obj.get("parameters")
    if not isinstance(name, str) or not name.strip():
        return None
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        ok, arguments = _try_loads(arguments)
        if not ok:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name.strip(), arguments=json.dumps(arguments, ensure_ascii=False), raw=raw)


# -- the parsers -------------------------------------------------------------------------------------

class ToolParser(ABC):
    """Finds the tool calls of one chat family in the text of the current turn.

    Subclasses define where call spans are (:meth:`_spans`), what one span holds (:meth:`_parse_span`)
    and which text may still lead into another call (``openers``, ``separators``).
    """

    name: ClassVar[str]
    openers: ClassVar[tuple[str, ...]]  # text that opens a call span
    separators: ClassVar[str] = " \t\r\n"  # characters allowed between two calls

    @abstractmethod
    def _spans(self, text: str) -> list[_Span]:
        """The call spans of ``text`` in order; only the last may be open."""

    @abstractmethod
    def _parse_span(self, raw: str) -> list[ToolCall | str]:
        """The calls in one closed span; a ``str`` item is the raw text of an invalid call."""

    def _gap(self, gap: str) -> str:
        """Content contributed by the text between two spans."""
        return gap

    # -- the engine's questions --

    def complete_calls(self, text: str) -> int:
        """Number of closed call spans in ``text``, valid or not (Mistral: one per ``[TOOL_CALLS]``)."""
        return sum(span.closed for span in self._spans(text))

    def pending_call_open(self, text: str) -> bool:
        """True while a call span is open: its opening marker is out, its closing one is not."""
        spans = self._spans(text)
        return bool(spans) and not spans[-1].closed

    def may_continue_with_call(self, text: str) -> bool:
        """True when the last span is closed and the text after it is still separators followed by a
        prefix of an opening marker (``""``, ``"\\n"``, ``"\\n<tool"``...): another call may follow."""
        spans = self._spans(text)
        return bool(spans) and spans[-1].closed and self._may_continue(text[spans[-1].end:])

    def _may_continue(self, rest: str) -> bool:
        rest = rest.lstrip(self.separators)
        return any(opener.startswith(rest) for opener in self.openers)

    def turn_done(self, text: str) -> bool:
        """The pause rule (module docstring): a call span is closed, none is open, and the model has
        started writing something that cannot open another call. EOS pauses independently of this."""
        spans = self._spans(text)
        return bool(spans) and spans[-1].closed and not self._may_continue(text[spans[-1].end:])

    def typed(self, call: ToolCall, schema: Mapping | None) -> ToolCall:
        """The call with its arguments as the tool's parameters `schema` (None: unknown) reads them: the
        formats whose arguments are JSON already need nothing of it."""
        return call

    def parse(self, text: str, schemas: Mapping[str, Mapping] | None = None) -> ParseResult:
        """Calls, content and invalid spans of ``text`` (normally the finished or paused turn); `schemas`:
        each tool's parameters schema by name, where the format's arguments are typed by it (qwen3_coder)."""
        content: list[str] = []
        calls: list[ToolCall] = []
        invalid: list[str] = []
        pos = 0
        for i, span in enumerate(self._spans(text)):
            gap = text[pos:span.start]
            content.append(gap if i == 0 else self._gap(gap))
            raw = text[span.start:span.end]
            items: list[ToolCall | str] = self._parse_span(raw) if span.closed else [raw]
            for item in items:
                if isinstance(item, ToolCall):
                    calls.append(self.typed(item, (schemas or {}).get(item.name)))
                else:
                    invalid.append(item)
                    content.append(item)
            pos = span.end
        content.append(text[pos:])
        return ParseResult(content="".join(content).strip(), tool_calls=calls, invalid=invalid)


class _MarkedSpansParser(ToolParser):
    """Call spans from an ``OPEN`` marker to the ``CLOSE`` marker after it, anywhere in the text, any
    number of them; the last one may be open."""

    OPEN: ClassVar[str]
    CLOSE: ClassVar[str]

    def _close_at(self, text: str, pos: int) -> int | None:
        """Index of the ``CLOSE`` ending a span whose body starts at ``pos``, or None: the first one."""
        close = text.find(self.CLOSE, pos)
        return close if close >= 0 else None

    def _spans(self, text: str) -> list[_Span]:
        spans: list[_Span] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            close = self._close_at(text, start + len(self.OPEN))
            if close is None:
                spans.append(_Span(start, len(text), False))
                break
            pos = close + len(self.CLOSE)
            spans.append(_Span(start, pos, True))
        return spans


class HermesToolParser(_MarkedSpansParser):
    """``<tool_call>{json}</tool_call>`` spans, anywhere in the text, any number of them.

    A span closes at the first ``</tool_call>`` outside a JSON string. Its body (stripped) must be one
    JSON object with a ``"name"``; ``"arguments"`` (or ``"parameters"``) defaults to ``{}``.
    """

    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    openers = (OPEN,)
    _close_or_quote = re.compile(r'"|</tool_call>')

    def _close_at(self, text: str, pos: int) -> int | None:
        while True:
            m = self._close_or_quote.search(text, pos)
            if m is None:
                return None
            if m.group() == self.CLOSE:
                return m.start()
            end = _string_end(text, m.end())
            if end is None:
                return None
            pos = end

    def _parse_span(self, raw: str) -> list[ToolCall | str]:
        ok, obj = _try_loads(raw[len(self.OPEN):-len(self.CLOSE)].strip())
        call = _make_call(obj, raw) if ok else None
        return [call if call is not None else raw]


class Llama3JsonToolParser(ToolParser):
    """Llama-3.1/3.2 JSON calls: ``[<|python_tag|>]{"name": ..., "parameters": {...}}`` separated by ``;``.

    Calls start at the start of the message when it begins with an untagged call object -- one that
    parses with a ``"name"`` and a ``"parameters"``/``"arguments"`` key; any other JSON object there is
    an answer, i.e. content -- or else at the first ``<|python_tag|>`` (text before it is content). After
    a call, further calls may follow after ``;``/whitespace, each optionally tagged; anything else ends
    the calls and is content. A tag not followed by ``{`` (Llama's built-in ``brave_search.call(...)``)
    opens a span that never closes and ends up invalid.
    """

    name = "llama3_json"
    TAG = "<|python_tag|>"
    openers = (TAG, "{")
    separators = " \t\r\n;"

    @staticmethod
    def _is_call_object(raw: str) -> bool:
        ok, obj = _try_loads(raw)
        return ok and isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj)

    def _spans(self, text: str) -> list[_Span]:
        stripped = text.lstrip()
        pos = text.find(self.TAG)
        if stripped.startswith("{"):  # an untagged call, or a JSON answer
            start = len(text) - len(stripped)
            end = _json_end(text, start)
            if end is None and pos < 0:
                return [_Span(start, len(text), False)]  # cannot tell yet
            if end is not None:
                if self._is_call_object(text[start:end]):
                    pos = start
                else:
                    pos = text.find(self.TAG, end)
        if pos < 0:
            return []
        spans: list[_Span] = []
        while True:
            start = pos
            tagged = text.startswith(self.TAG, pos)
            if tagged:
                pos += len(self.TAG)
                pos += len(text[pos:]) - len(text[pos:].lstrip())
            if pos == len(text) or text[pos] != "{":
                spans.append(_Span(start, len(text), False))  # awaiting "{", or not JSON at all
                return spans
            end = _json_end(text, pos)
            if end is None:
                spans.append(_Span(start, len(text), False))
                return spans
            spans.append(_Span(start, end, True))
            rest = text[end:].lstrip(self.separators)
            if not rest.startswith(self.openers):
                return spans
            pos = len(text) - len(rest)

    def _parse_span(self, raw: str) -> list[ToolCall | str]:
        body = raw[len(self.TAG):] if raw.startswith(self.TAG) else raw
        ok, obj = _try_loads(body.strip())
        call = _make_call(obj, raw) if ok else None
        return [call if call is not None else raw]

    def _gap(self, gap: str) -> str:
        return ""  # only separators lie between two Llama calls


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` blocks: a JSON array of calls (or a single call object), or v11+
    ``name[ARGS]{...}`` / ``name[CALL_ID]id[ARGS]{...}`` / ``name{...}``.

    A block closes when its array or object balances. In an array that parses, each element is a call or
    an invalid item on its own; an array that does not parse (or an empty one) is one invalid item. A
    block that matches neither form runs to the next ``[TOOL_CALLS]`` (closed) or stays open.
    """

    name = "mistral"
    MARK = "[TOOL_CALLS]"
    openers = (MARK,)
    _v11 = re.compile(r"\s*([A-Za-z0-9_.:\-]+)(?:\[CALL_ID\][A-Za-z0-9_\-]*)?(?:\[ARGS\])?\s*(?=\{)")

    def _spans(self, text: str) -> list[_Span]:
        spans: list[_Span] = []
        pos = 0
        while (start := text.find(self.MARK, pos)) >= 0:
            body = start + len(self.MARK)
            k = body + len(text[body:]) - len(text[body:].lstrip())
            if k < len(text) and text[k] in "[{":
                end = _json_end(text, k)
            elif (m := self._v11.match(text, body)) is not None:
                end = _json_end(text, m.end())
            else:  # still writing the name, or garbage: up to the next block if there is one
                following = text.find(self.MARK, body)
                if following >= 0:
                    spans.append(_Span(start, following, True))
                    pos = following
                    continue
                end = None
            if end is None:
                spans.append(_Span(start, len(text), False))
                break
            spans.append(_Span(start, end, True))
            pos = end
        return spans

    def _parse_span(self, raw: str) -> list[ToolCall | str]:
        body = raw[len(self.MARK):]
        payload = body.lstrip()
        if payload.startswith("["):
            ok, obj = _try_loads(payload)
            if not ok or not isinstance(obj, list) or not obj:
                return [raw]
            items = _array_items(payload)
            if len(items) != len(obj):  # cannot happen for valid JSON; be safe
                items = [json.dumps(element, ensure_ascii=False) for element in obj]
            out: list[ToolCall | str] = []
            for element, item_raw in zip(obj, items):
                call = _make_call(element, item_raw)
                out.append(call if call is not None else item_raw)
            return out
        if payload.startswith("{"):
            ok, obj = _try_loads(payload)
            call = _make_call(obj, raw) if ok else None
            return [call if call is not None else raw]
        m = self._v11.match(body)
        if m is None:
            return [raw]
        ok, arguments = _try_loads(body[m.end():])
        if not ok or not isinstance(arguments, dict):
            return [raw]
        call = _make_call(None, raw, arguments=arguments, name=m.group(1))
        return [call if call is not None else raw]


class PythonicToolParser(ToolParser):
    """Pythonic calls (Llama 3.2 / Llama 4 style, the templates that ask for
    ``[func_name1(params_name1=params_value1, ...), func_name2(params)]``): one Python list of calls
    that starts the message, optionally wrapped in ``<|python_start|>`` ... ``<|python_end|>``.

    A call is ``name(key=value, ...)``: a name or a dotted name, keyword arguments only, values Python
    or JSON literals (``'x'``, ``"x"``, numbers, ``True``/``true``, ``None``/``null``, lists, tuples,
    dicts with literal keys). A message that starts with ``[`` but not with ``[name(`` (a JSON array, a
    markdown link) is content; so is everything after the list. The list is read with ``ast`` (never
    evaluated): a list that does not parse is one invalid span; in one that does, each element is a
    call or an invalid item on its own. Parallel calls are elements of the same list, so a message holds
    one span at most.
    """

    name = "pythonic"
    START = "<|python_start|>"
    END = "<|python_end|>"
    openers = ("[", START)
    _head = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_]*(?:\s*\.\s*[A-Za-z_][A-Za-z0-9_]*)*\s*\(")
    _head_prefix = re.compile(r"\[\s*(?:[A-Za-z_][A-Za-z0-9_]*(?:\s*\.\s*(?:[A-Za-z_][A-Za-z0-9_]*)?)*\s*)?\Z")
    _OUTSIDE = re.compile(r"[\"'()\[\]{}]")

    @classmethod
    def _list_end(cls, text: str, start: int) -> int | None:
        """``text[start]`` is ``[``: index just after the bracket that balances it (brackets in Python
        strings, single- or double-quoted, ignored), or None while it is still open."""
        depth, pos = 0, start
        while True:
            m = cls._OUTSIDE.search(text, pos)
            if m is None:
                return None
            ch, pos = m.group(), m.end()
            if ch in "\"'":
                while True:  # to the closing quote of the same kind; a backslash escapes one character
                    k = min((i for i in (text.find(ch, pos), text.find("\\", pos)) if i >= 0), default=-1)
                    if k < 0:
                        return None
                    if text[k] == "\\":
                        pos = k + 2
                        continue
                    pos = k + 1
                    break
            elif ch in "([{":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return pos

    def _spans(self, text: str) -> list[_Span]:
        start = len(text) - len(text.lstrip())
        pos = start
        wrapped = text.startswith(self.START, pos)
        if wrapped:
            pos += len(self.START)
            pos += len(text[pos:]) - len(text[pos:].lstrip())
        elif pos < len(text) and self.START.startswith(text[pos:]):
            return [_Span(start, len(text), False)]  # the wrapper's opening, still being written
        if pos == len(text):
            return [_Span(start, len(text), False)] if wrapped else []
        if text[pos] != "[":
            return []
        end = self._list_end(text, pos)
        if end is None:  # open: a call list while its head can still be one
            head = self._head.match(text, pos) is not None or self._head_prefix.match(text, pos) is not None
            return [_Span(start, len(text), False)] if head else []
        if self._head.match(text, pos) is None:
            return []  # a list, but not of calls: content
        rest = text[end:].lstrip()
        if rest.startswith(self.END):
            end = len(text) - len(rest) + len(self.END)
        return [_Span(start, end, True)]

    def _may_continue(self, rest: str) -> bool:
        rest = rest.strip()
        return not rest or self.END.startswith(rest)

    def _parse_span(self, raw: str) -> list[ToolCall | str]:
        body = raw.strip()
        if body.startswith(self.START):
            body = body[len(self.START):]
        if body.endswith(self.END):
            body = body[:-len(self.END)]
        body = body.strip()
        try:
            with warnings.catch_warnings():  # model output: an escape Python does not know ("\\/") is no warning
                warnings.simplefilter("ignore", SyntaxWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return [raw]
        if not isinstance(tree, ast.List):
            return [raw]
        out: list[ToolCall | str] = []
        for element in tree.elts:
            item_raw = ast.get_source_segment(body, element) or ""
            call = self._call(element, body, item_raw)
            out.append(call if call is not None else item_raw)
        return out or [raw]

    @classmethod
    def _call(cls, node: ast.expr, body: str, raw: str) -> ToolCall | None:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted_name(node.func)
        if name is None:
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:  # **kwargs, or a repeated keyword
                return None
            ok, value = _literal(keyword.value, body)
            if not ok:
                return None
            arguments[keyword.arg] = value
        return _make_call(None, raw, arguments=arguments, name=name)


def _dotted_name(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr, body: str) -> tuple[bool, Any]:
    """A pythonic argument's value as JSON data: the source read as JSON first (what a grammar writes,
    escapes and all), else as a Python literal, with JSON's true/false/null accepted too."""
    segment = ast.get_source_segment(body, node)
    if segment is not None:
        ok, value = _try_loads(segment)
        if ok:
            return True, value
    try:
        return True, _python_literal(node)
    except (ValueError, TypeError, RecursionError):
        return False, None


def _python_literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (bool, str, int)):
            return node.value
        if isinstance(node.value, float) and node.value == node.value and abs(node.value) != float("inf"):
            return node.value
        raise ValueError("not a JSON value")
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_python_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            if not isinstance(key, ast.Constant) or not isinstance(key.value, str):
                raise ValueError("dict keys must be strings")
            out[key.value] = _python_literal(value)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _python_literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")


# -- qwen3_coder -------------------------------------------------------------------------------------

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}


def _resolved(schema: Any, root: Mapping) -> Any:
    """`schema`, or what its local ``$ref`` (``#/$defs/x``, ``#/definitions/x``) names in `root`."""
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        return target if isinstance(target, Mapping) else {}
    return schema


def value_types(schema: Any, root: Mapping) -> set[str] | None:
    """The JSON types a parameter's schema allows (``integer`` within ``number``); None when it does not
    say (no ``type``, ``enum``, ``const``, or ``anyOf`` / ``oneOf`` of schemas that say)."""
    schema = _resolved(schema, root)
    if not isinstance(schema, Mapping):
        return None
    kind = schema.get("type")
    if isinstance(kind, str) or (isinstance(kind, list) and all(isinstance(k, str) for k in kind)):
        return {kind} if isinstance(kind, str) else set(kind)
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema \
        else None
    if values is not None:
        return {_JSON_TYPES.get(type(v), "object") for v in values}
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches:
        types = [value_types(b, root) for b in branches]
        return None if any(t is None for t in types) else set().union(*types)
    return None


# Python's spellings, as Qwen3-Coder's template writes a past call's values (Jinja's `string` filter)
_PYTHON_LITERALS = {"True": ("boolean", True), "False": ("boolean", False), "None": ("null", None)}


def typed_value(text: str, schema: Any, root: Mapping) -> Any:
    """A parameter's value as written (text) as its schema reads it: the text itself where the schema
    allows only strings, else the JSON it holds where that is of a type the schema allows (any type, for
    a schema that names none; ``True``, ``False`` and ``None`` read as JSON's), else the text."""
    types = value_types(schema, root)
    if types == {"string"}:
        return text
    if text.strip() in _PYTHON_LITERALS:
        kind, value = _PYTHON_LITERALS[text.strip()]
        return value if types is None or kind in types else text
    ok, value = _try_loads(text)
    if not ok or isinstance(value, str):
        return text
    kind = _JSON_TYPES.get(type(value), "object")
    if types is None or kind in types or (kind == "integer" and "number" in types):
        return value
    return text


class Qwen3CoderToolParser(_MarkedSpansParser):
    """Hermes's ``<tool_call>`` spans, each holding one ``<function=NAME>`` of ``<parameter=NAME>``
    elements, anywhere in the text, any number of them.

    A span closes at the first ``</tool_call>`` (values are text, not JSON: no quotes to skip). A
    parameter's value is the text between its tags, less one newline after the opening tag and one
    before the closing tag; `parse` types it by the tool's schema (`typed_value`), and without a schema
    a value that is JSON (not a string) is that JSON. A span with anything else (no function, text
    between the elements, a parameter named twice) is invalid.
    """

    name = "qwen3_coder"
    OPEN, CLOSE = HermesToolParser.OPEN, HermesToolParser.CLOSE
    openers = (OPEN,)
    _function = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
    _parameter = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def _parse_span(self, raw: str) -> list[ToolCall | str]:
        m = self._function.fullmatch(raw, len(self.OPEN), len(raw) - len(self.CLOSE))
        if m is None or not m.group(1).strip():
            return [raw]
        body, pos, arguments = m.group(2), 0, {}
        while (p := self._parameter.match(body, pos)) is not None:
            if p.group(1) in arguments:
                return [raw]
            arguments[p.group(1)] = p.group(2)
            pos = p.end()
        if body[pos:].strip():
            return [raw]
        return [ToolCall(m.group(1).strip(), json.dumps(arguments, ensure_ascii=False), raw)]

    def typed(self, call: ToolCall, schema: Mapping | None) -> ToolCall:
        root = schema if isinstance(schema, Mapping) else {}
        properties = root.get("properties") if isinstance(root.get("properties"), Mapping) else {}
        values = {k: typed_value(v, properties.get(k) if schema is not None else None, root)
                  for k, v in json.loads(call.arguments).items()}
        return ToolCall(call.name, json.dumps(values, ensure_ascii=False), call.raw, call.id)


class Glm4ToolParser(Qwen3CoderToolParser):
    """GLM-4.5 / 4.6 / 4.7's calls: Hermes's ``<tool_call>`` spans, each holding the function's name and
    then ``<arg_key>NAME</arg_key><arg_value>VALUE</arg_value>`` pairs, anywhere in the text, any number
    of them. GLM-4.5 and 4.6 put a newline after the name and after each tag; GLM-4.7 none: blanks
    between the elements are read either way.

    A span closes at the first ``</tool_call>``. A value is the text between its tags, typed by the tool's
    schema as qwen3_coder's are (`typed_value`). A span with anything else (no name, text between the
    pairs, an argument named twice) is invalid.
    """

    name = "glm45"
    _head = re.compile(r"\s*([^<\s]+)\s*")
    _argument = re.compile(r"<arg_key>([^<]+)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)

    def _parse_span(self, raw: str) -> list[ToolCall | str]:
        body = raw[len(self.OPEN):len(raw) - len(self.CLOSE)]
        head = self._head.match(body)
        if head is None:
            return [raw]
        pos, arguments = head.end(), {}
        while (a := self._argument.match(body, pos)) is not None:
            key = a.group(1).strip()
            if key in arguments:
                return [raw]
            arguments[key] = a.group(2)
            pos = a.end()
        if pos != len(body):
            return [raw]
        return [ToolCall(head.group(1), json.dumps(arguments, ensure_ascii=False), raw)]


class Glm47ToolParser(Glm4ToolParser):
    """The same format by vLLM's other name for it (``--tool-call-parser glm47``)."""

    name = "glm47"


class DeepSeekV31ToolParser(_MarkedSpansParser):
    """DeepSeek-V3.1's calls: a section ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` holding
    ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>`` per call (the markers are
    tokens of DeepSeek's vocabulary), anywhere in the text.

    A section closes at its ``<｜tool▁calls▁end｜>``. Its calls must follow one another, each a name
    without blanks and a JSON object; a section with anything else is invalid.
    """

    name = "deepseek_v31"
    OPEN, CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    openers = (OPEN,)
    _call = re.compile(r"\s*<｜tool▁call▁begin｜>([^\s<]+)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>\s*", re.S)

    def _parse_span(self, raw: str) -> list[ToolCall | str]:
        body, pos, calls = raw[len(self.OPEN):len(raw) - len(self.CLOSE)], 0, []
        while (m := self._call.match(body, pos)) is not None:
            ok, arguments = _try_loads(m.group(2).strip())
            if not ok or not isinstance(arguments, dict):
                return [raw]
            calls.append(ToolCall(m.group(1), json.dumps(arguments, ensure_ascii=False), m.group().strip()))
            pos = m.end()
        return calls if calls and pos == len(body) else [raw]


# -- registry ----------------------------------------------------------------------------------------

PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
                              Qwen3CoderToolParser, Glm4ToolParser, Glm47ToolParser, DeepSeekV31ToolParser)
}


# A family ``vllm:NAME`` is vLLM's tool parser NAME (``--tool-call-parser NAME``), which runs only where
# vLLM runs: on the vLLM backend, in its worker process (engine/vllm_backend/tool_calls.py).
VLLM_PREFIX = "vllm:"


def vllm_parser_name(family: str | None) -> str | None:
    """vLLM's name of the parser of a ``vllm:NAME`` family; None for ours (and for None)."""
    return family[len(VLLM_PREFIX):] if family is not None and family.startswith(VLLM_PREFIX) else None


class ParsedByVllm:
    """A turn's calls as vLLM's parser found them, in vLLM's process, once the turn ended.

    vLLM's parsers read a whole turn (``extract_tool_calls``), so such a turn is never done at a call
    (``turn_done`` is false: it ends where the model ends it, at its EOS or stop token); the calls arrive
    with the turn's last output (``take``), and ``parse`` answers with them whatever the text (before
    they arrive: no calls, the text as content). A call whose arguments are not a JSON object is no call:
    it stays in the content as text, as an invalid call span of ours does. One instance per turn."""

    openers: tuple[str, ...] = ()

    def __init__(self, name: str):
        self.name = name
        self.result: ParseResult | None = None

    def take(self, calls: list[tuple[str, str, str | None]], content: str | None) -> None:
        """vLLM's verdict: (name, arguments JSON, id) of each call, and the content outside them."""
        valid, invalid = [], []
        for name, arguments, call_id in calls:
            ok, value = _try_loads(arguments) if isinstance(arguments, str) else (False, None)
            if ok and isinstance(value, dict) and isinstance(name, str) and name:
                valid.append(ToolCall(name, json.dumps(value, ensure_ascii=False), "", call_id))
            else:
                invalid.append(f"{name}({arguments})")
        self.result = ParseResult("\n".join(filter(None, [(content or "").strip(), *invalid])), valid, invalid)

    def turn_done(self, text: str) -> bool:
        return False

    def parse(self, text: str, schemas: Mapping[str, Mapping] | None = None) -> ParseResult:
        return self.result if self.result is not None else ParseResult(text.strip(), [], [])


def get_tool_parser(name: str) -> ToolParser | ParsedByVllm:
    """A parser instance by registry name (``vllm:NAME``: vLLM's, `ParsedByVllm`); ValueError naming the
    known parsers otherwise."""
    if (vllm_name := vllm_parser_name(name)) is not None:
        return ParsedByVllm(vllm_name)
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


def parser_for_model(model_type: str, chat_template: str | None) -> str:
    """The parser name for a model, from its ``config.model_type`` and its chat template.

    First that applies: the template writes calls as ``<function=...>`` of ``<parameter=...>`` elements
    (Qwen3-Coder's) -> ``qwen3_coder``; as ``<arg_key>`` / ``<arg_value>`` pairs (GLM-4.5 to 4.7's) ->
    ``glm45``; as ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}`` without a JSON fence (DeepSeek-V3.1's) ->
    ``deepseek_v31``; it mentions ``<tool_call>`` -> ``hermes``; ``[TOOL_CALLS]`` ->
    ``mistral``; it asks for calls ``in the format of [func_name1(...)`` (the pythonic templates of
    Llama 3.2 and Llama 4) -> ``pythonic``; ``<|python_tag|>`` -> ``llama3_json``; a Llama model type
    whose template uses ``<|eot_id|>`` and a ``"parameters"`` JSON -> ``llama3_json``; otherwise
    (Qwen2/Qwen3, or a template without a tool section, for which the server supplies a Hermes-style tool
    prompt) -> ``hermes``.
    """
    template = chat_template or ""
    model_type = (model_type or "").lower()
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<arg_key>" in template and "<arg_value>" in template:
        return "glm45"
    if "<｜tool▁sep｜>" in template and "```json" not in template:  # (V3's calls wrap the JSON in a fence)
        return "deepseek_v31"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "[func_name1(" in template:
        return "pythonic"
    if "<|python_tag|>" in template:
        return "llama3_json"
    if model_type.startswith("llama") and "<|eot_id|>" in template and '"parameters"' in template:
        return "llama3_json"
    return "hermes"  # qwen2, qwen3, and every template without tools
