"""Chat messages -> prompt token ids, with the model's chat template.

Four jobs:

* **Normalize and validate** OpenAI messages into `Message` values (plain, hashable, comparable: the
  session registry compares conversations by equality; tool-call arguments compare as JSON).
* **Tools.** A template with a tool section (Qwen2.5, Llama 3.1, Mistral...) gets `tools=` and the
  tool calls as structured data. A template without one (SmolLM2) gets a Hermes-style tool system
  prompt, two example exchanges built from the first tool, assistant tool calls rendered as
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` and tool results as ``tool`` turns.
* **Forced calls** (``tool_choice`` required or named, Hermes format): the turn starts with a prefill of
  the call's fixed opening, and a grammar (`hermes_calls_grammar`, enforced by the engine) takes it from
  there: names of the allowed tools only, arguments that follow each tool's schema, written as
  ``json.dumps`` writes them, so `hermes_partial_calls` can follow them while they stream. An auto
  turn under a JSON ``response_format`` gets the same call grammar or a JSON answer
  (`answer_or_call_grammar`); a ``tool_choice`` "none" turn still sees the tools (the prompt is the
  same as the other steps', so its prefix is reused) and gets text that never opens a call
  (`no_call_grammar`).
* **Exact turns.** An assistant tool-call turn this server generated is rendered as the very tokens the
  model generated (`AssistantTurn.token_ids`), not re-rendered from the message. The prompt is then
  the concatenation of text segments (each tokenized on its own) and those token runs::

      tokens(text before turn 1) + turn 1 ids + tokens(rest of turn 1's end + text before turn 2) + ...

  so the rendering of a conversation extends, token for token, the context of the generation that
  produced its last tool call: the tokens appended on an implicit resume are exactly what a fresh
  rendering of the whole conversation adds after the paused tokens (DESIGN §3).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .protocol import ChatMessageParam, ToolParam, bad_request

# -- normalized messages ----------------------------------------------------------------------------


def canonical_json(text: str) -> str:
    """JSON-equality key of an arguments string: sorted keys; unparsable text compares as itself."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, RecursionError):
        return "\x00raw:" + text


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str = field(compare=False)  # JSON text as given
    canonical: str = field(default="", repr=False)  # what equality compares

    @classmethod
    def make(cls, id: str, name: str, arguments: str) -> "Call":
        return cls(id, name, arguments, canonical_json(arguments))

    def arguments_value(self) -> Any:
        try:
            return json.loads(self.arguments)
        except (ValueError, RecursionError):
            return self.arguments


@dataclass(frozen=True)
class Message:
    role: str  # system, user, assistant, tool
    content: str = ""
    name: str | None = None
    tool_calls: tuple[Call, ...] = ()
    tool_call_id: str | None = None


def _content_text(m: ChatMessageParam, i: int) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.type not in ("text", "input_text") or part.text is None:
            raise bad_request(f"messages[{i}]: only text content parts are supported (got {part.type!r})",
                              param=f"messages[{i}].content")
        parts.append(part.text)
    return "\n".join(parts)


def normalize_messages(params: Sequence[ChatMessageParam], validate: bool = True) -> list[Message]:
    """OpenAI messages -> `Message`s, checked the way OpenAI checks them (400 on violations).
    `validate=False` leaves the tool-call flow to check later (a session continuation starts with tool
    results and is checked once prepended with the session's conversation)."""
    if not params:
        raise bad_request("messages must not be empty", param="messages")
    out: list[Message] = []
    for i, m in enumerate(params):
        content = _content_text(m, i)
        if m.role == "assistant":
            calls = []
            for c in m.tool_calls or ():
                args = c.function.arguments
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                calls.append(Call.make(c.id, c.function.name, args))
            if len({c.id for c in calls}) != len(calls):
                raise bad_request(f"messages[{i}]: duplicate tool_call ids", param=f"messages[{i}].tool_calls")
            if m.content is None and not calls:
                raise bad_request(f"messages[{i}]: an assistant message needs content or tool_calls",
                                  param=f"messages[{i}].content")
            out.append(Message("assistant", content, m.name, tuple(calls)))
        elif m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"messages[{i}]: a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id")
            out.append(Message("tool", content, m.name, tool_call_id=m.tool_call_id))
        else:
            if m.tool_calls or m.tool_call_id:
                raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", param=f"messages[{i}]")
            if m.content is None:
                raise bad_request(f"messages[{i}]: content is required for role {m.role!r}", param=f"messages[{i}].content")
            out.append(Message("system" if m.role == "developer" else m.role, content, m.name))
    if validate:
        validate_tool_flow(out)
    return out


def validate_tool_flow(messages: Sequence[Message]) -> None:
    """Every tool message answers a call of the assistant message just before the run of tool messages
    it belongs to, once; every call made is answered before the conversation moves on."""
    open_calls: set[str] | None = None  # ids of the last assistant tool calls not answered yet
    for i, m in enumerate(messages):
        if m.role == "tool":
            if open_calls is None or m.tool_call_id not in open_calls:
                raise bad_request(f"messages[{i}]: tool message answers tool_call_id {m.tool_call_id!r}, which the "
                                  "preceding assistant message did not call (or which was answered already)",
                                  param=f"messages[{i}].tool_call_id")
            open_calls.discard(m.tool_call_id)
            continue
        if open_calls:
            raise bad_request(f"messages[{i}]: an assistant message with tool_calls must be followed by tool messages "
                              f"answering each call; missing: {', '.join(sorted(open_calls))}", param="messages")
        open_calls = {c.id for c in m.tool_calls} if m.role == "assistant" and m.tool_calls else None
    if open_calls:
        raise bad_request("the last assistant message has tool_calls without tool results: "
                          + ", ".join(sorted(open_calls)), param="messages")


# -- assistant turns the server generated ------------------------------------------------------------

@dataclass(frozen=True)
class AssistantTurn:
    """An assistant tool-call turn as this server returned it and as the model generated it."""

    message: Message
    token_ids: tuple[int, ...]  # the turn's tokens: server prefill + generated (EOS included)


TurnLookup = Callable[[Message], "AssistantTurn | None"]


# -- tool prompt for templates without a tool section ----------------------------------------------

HERMES_OPENER = "<tool_call>"
HERMES_CALL = HERMES_OPENER + "\n{body}\n</tool_call>"
HERMES_CALL_HEAD = HERMES_OPENER + '\n{"name": '  # json.dumps of {"name": ..., "arguments": ...} starts so
HERMES_CALL_TAIL = "}\n</tool_call>"


def hermes_call_text(name: str, arguments: Any) -> str:
    return HERMES_CALL.format(body=json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False))


def hermes_call_start(name: str) -> str:
    """A Hermes call's text up to its arguments (which follow, then `HERMES_CALL_TAIL`)."""
    return HERMES_CALL_HEAD + json.dumps(name, ensure_ascii=False) + ', "arguments": '


# -- tool-call grammars and schemas ------------------------------------------------------------------

# The arguments' JSON is written as json.dumps writes it, as in the tool prompt's examples; flexible
# whitespace would also let a small model wander into endless blank lines.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def arguments_schema(tool: ToolParam) -> dict:
    """The tool's parameters schema (a call's arguments are always an object)."""
    return {"type": "object", **(tool.function.parameters or {})}


def json_grammar_schema(schema: dict) -> dict:
    """`schema` with llguidance's JSON style of the tool prompt (see `JSON_STYLE`)."""
    return schema | {"x-guidance": JSON_STYLE}


def hermes_calls_grammar(tools: Sequence[ToolParam], prefill: str, parallel: bool,
                         answer_schema: dict | None = None) -> str:
    """Lark grammar (llguidance) of what a turn generates after `prefill`: the rest of a call of one of
    the `tools` whose call text starts with `prefill`, then, with `parallel`, more calls, one per line.
    Each call's arguments follow its tool's parameters schema. With `answer_schema` (a turn that may
    answer instead of calling, under a JSON response_format), the turn may also be a JSON answer that
    follows it."""
    def call(i: int, before_arguments: str) -> str:  # a JSON string literal is a Lark one too
        return " ".join(([json.dumps(before_arguments)] if before_arguments else [])
                        + [f"args{i}", json.dumps(HERMES_CALL_TAIL)])

    starts = [hermes_call_start(tool.function.name) for tool in tools]
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
        lines.append(f"args{i}: %json {json.dumps(json_grammar_schema(arguments_schema(tools[i])))}")
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


@dataclass(frozen=True)
class PartialCall:
    """A Hermes call as far as it is written: its name is complete, its arguments maybe not."""

    name: str
    arguments: str  # JSON text written so far
    complete: bool  # the arguments object is closed


_CALL_HEAD = re.compile(re.escape(HERMES_CALL_HEAD) + r'("(?:[^"\\]|\\.)*"), "arguments": ')
_JSON = json.JSONDecoder()


def hermes_partial_calls(text: str) -> list[PartialCall]:
    """The calls in `text` written in exactly the form `hermes_calls_grammar` allows, in order: those
    whose name is complete, the last one possibly still being written."""
    calls: list[PartialCall] = []
    pos = 0
    while (head := _CALL_HEAD.search(text, pos)) is not None:
        name = json.loads(head.group(1))
        try:
            _, end = _JSON.raw_decode(text, head.end())
        except ValueError:  # still open: everything after the head is arguments so far
            calls.append(PartialCall(name, text[head.end():], False))
            break
        calls.append(PartialCall(name, text[head.end():end], True))
        pos = end
    return calls


def tool_validators(tools: Sequence[ToolParam]) -> dict[str, Callable[[Any], bool]]:
    """For each tool name, whether given arguments validate against its parameters schema.

    A schema that is not a valid JSON schema cannot judge arguments: its tool still serves (an odd
    schema is not a reason to refuse a request; a forced call of it is refused by the grammar compiler
    instead), and its calls need only be objects, which the parser already ensures."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    validators = {}
    for tool in tools:
        schema = arguments_schema(tool)
        cls = validator_for(schema)
        try:
            cls.check_schema(schema)
        except SchemaError:
            validators[tool.function.name] = lambda arguments: isinstance(arguments, dict)
        else:
            validators[tool.function.name] = cls(schema).is_valid
    return validators


def hermes_tool_prompt(tools: Sequence[ToolParam]) -> str:
    signatures = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
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


def example_exchanges(tool: ToolParam) -> list[dict]:
    """Two user questions, each answered by a call of `tool`, arguments built from its schema.

    Small models follow a demonstration far better than an instruction: with these, SmolLM2-135M
    answers "What is the weather in Paris?" with a well-formed get_weather call. (Examples that also
    show a tool result and an answer make it imitate the tool result instead, so there are none.)
    """
    fn = tool.function
    params = fn.parameters or {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = [p for p in params.get("required") or [] if p in props] or list(props)[:1]
    subject = _VERB_PREFIX.sub("", fn.name).replace("_", " ").replace("-", " ").strip() or fn.name
    prep = "in" if any(w in p.lower() for p in required for w in _LOCATION_WORDS) else "for"
    messages = []
    for k in range(2):
        args = {p: _sample_value(props[p] if isinstance(props[p], dict) else {}, k) for p in required}
        shown = [v for v in args.values() if isinstance(v, (str, int, float)) and not isinstance(v, bool)]
        question = f"What is the {subject}" + (f" {prep} {' and '.join(map(str, shown))}" if shown else "") + "?"
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": hermes_call_text(fn.name, args)}]
    return messages


# -- the renderer -----------------------------------------------------------------------------------

_SENTINEL = "\x00INFERCEPT-SENTINEL\x00"


class ChatRenderer:
    """Renders conversations for one tokenizer (thread-safe: holds no per-request state)."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int], tool_parser: str):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.tool_parser = tool_parser
        template = tokenizer.chat_template or ""
        if not template:
            raise ValueError("the model has no chat template; /v1/chat/completions needs one")
        self.native_tools = re.search(r"\btools\b", template) is not None
        # Text the template puts after an assistant message's content (ChatML: "<|im_end|>\n").
        probe = self._apply([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}], False)
        self.turn_end = probe[probe.rfind(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in probe else ""

    # -- public ------------------------------------------------------------------------------------
    def forced_prefill(self, tool_name: str | None) -> str:
        """Text that starts the assistant turn when a call is required (`tool_name` None: any tool).

        Only for the Hermes format; other formats get no prefill (best effort by prompting).
        """
        if self.tool_parser != "hermes":
            return ""
        return HERMES_CALL_HEAD + '"' if tool_name is None else hermes_call_start(tool_name)

    def forced_grammar(self, tools: Sequence[ToolParam], tool_name: str | None, parallel: bool) -> str | None:
        """Lark grammar of the rest of a forced turn after `forced_prefill(tool_name)`: calls of the
        allowed tools with arguments that follow their schemas. Only for the Hermes format (None: other
        formats are forced by prompting alone)."""
        if self.tool_parser != "hermes":
            return None
        allowed = [t for t in tools if tool_name is None or t.function.name == tool_name]
        return hermes_calls_grammar(allowed, self.forced_prefill(tool_name), parallel)

    def answer_or_call_grammar(self, tools: Sequence[ToolParam], parallel: bool, answer_schema: dict) -> str | None:
        """Lark grammar of an auto-mode turn under a JSON response_format: calls of the tools (arguments
        per schema) or a JSON answer that follows `answer_schema`. Only for the Hermes format (None:
        the other formats' calls are not written by a grammar here)."""
        if self.tool_parser != "hermes":
            return None
        return hermes_calls_grammar(tools, "", parallel, answer_schema)

    def no_call_grammar(self) -> str | None:
        """Lark grammar of a turn that sees the tools but may not call them (tool_choice "none"): text
        that never opens a call. Only for the Hermes format (None: other formats' openers, such as
        llama3_json's bare "{", are also ordinary text, so a call written there stays content)."""
        if self.tool_parser != "hermes":
            return None
        return text_without_grammar(HERMES_OPENER)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def render(self, messages: Sequence[Message], tools: Sequence[ToolParam] | None,
               known_turn: TurnLookup | None = None, prefill: str = "") -> list[int]:
        """Prompt token ids for `messages` + the generation prompt (+ `prefill`), with every assistant
        turn `known_turn` recognizes rendered as its exact generated tokens."""
        prepared, index = self._prepare(messages, tools)
        full = self._apply(prepared, True, tools)
        ids: list[int] = []
        pos = 0
        for i, m in enumerate(messages):
            turn = known_turn(m) if known_turn is not None and m.role == "assistant" and m.tool_calls else None
            if turn is None or index[i] == 0:
                continue
            before = self._apply(prepared[:index[i]], True, tools)
            upto = self._apply(prepared[:index[i] + 1], False, tools)
            if not (len(before) >= pos and upto.startswith(before) and full.startswith(upto)
                    and upto.endswith(self.turn_end)):
                return self.encode(full) + self.encode(prefill)  # a template that is not prefix-stable
            ids += self.encode(full[pos:len(before)])
            ids += turn.token_ids
            pos = len(upto) - len(self._turn_end_left(turn.token_ids))
        return ids + self.encode(full[pos:]) + self.encode(prefill)

    # -- internals ---------------------------------------------------------------------------------
    def _turn_end_left(self, token_ids: Sequence[int]) -> str:
        """The part of the template's turn end the model did not generate itself: after a generated
        EOS that the turn end starts with (ChatML: "<|im_end|>"), only the rest ("\\n")."""
        if token_ids and token_ids[-1] in self.eos_token_ids:
            eos_text = self.tokenizer.decode([token_ids[-1]], skip_special_tokens=False)
            if eos_text and self.turn_end.startswith(eos_text):
                return self.turn_end[len(eos_text):]
        return self.turn_end

    def _apply(self, prepared: list[dict], add_generation_prompt: bool, tools=None) -> str:
        kwargs = {}
        if tools and self.native_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        return self.tokenizer.apply_chat_template(prepared, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)

    def _prepare(self, messages: Sequence[Message], tools: Sequence[ToolParam] | None) -> tuple[list[dict], list[int]]:
        """Template-ready dicts, and for each message its index among them. Depends on a message and the
        tools only, never on later messages, so a conversation's prefix prepares to a prefix."""
        prepared: list[dict] = []
        index: list[int] = []
        start = 0
        if tools and not self.native_tools:
            system = hermes_tool_prompt(tools)
            if messages and messages[0].role == "system":
                system = messages[0].content + "\n\n" + system
                index.append(0)
                start = 1
            prepared.append({"role": "system", "content": system})
            prepared += example_exchanges(tools[0])
        for m in messages[start:]:
            index.append(len(prepared))
            prepared.append(self._message_dict(m))
        return prepared, index

    def _message_dict(self, m: Message) -> dict:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name and m.role in ("user", "system"):
            d["name"] = m.name
        if m.role == "assistant" and m.tool_calls:
            if self.native_tools:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments_value()}}
                                   for c in m.tool_calls]
            else:
                calls = "\n".join(hermes_call_text(c.name, c.arguments_value()) for c in m.tool_calls)
                d["content"] = (m.content + "\n" + calls) if m.content else calls
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        return d
