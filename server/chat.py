"""Chat messages -> prompt token ids, with the model's chat template.

Three jobs:

* **Normalize and validate** OpenAI messages into `Message` values (plain, hashable, comparable: the
  conversation store compares conversations by equality; tool-call arguments compare as JSON).
* **Tools.** A template with a tool section (Qwen2.5, Llama 3.1, Mistral...) gets `tools=` and the
  tool calls as structured data. A template without one (SmolLM2) gets the tool format's prompt
  (engine/tool_format.py: a Hermes-style tool system prompt and two example exchanges built from the
  first tool), assistant tool calls written as the model writes them and tool results as ``tool`` turns.
  Tools are the engine's `ToolSpec`s; forced-call prefills and grammars are the tool format's.
* **Exact turns.** An assistant tool-call turn this server generated is rendered as the very tokens the
  model generated (`AssistantTurn.token_ids`), not re-rendered from the message. The prompt is then
  the concatenation of text segments (each tokenized on its own) and those token runs::

      tokens(text before turn 1) + turn 1 ids + tokens(rest of turn 1's end + text before turn 2) + ...

  so the rendering of a conversation extends, token for token, the context of the generation that
  produced its last tool call: the tokens appended on an implicit resume are exactly what a fresh
  rendering of the whole conversation adds after the paused tokens. A thinking model's
  turn keeps its thinking that way, although the client's message has none and thinking templates
  (Qwen3's) drop it, or render the turn apart when it is the last message (`_turn_end_in`).
"""
from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from infercept.engine.backend import ToolFormat, ToolSpec

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

    def wire(self) -> dict:
        """The message in Chat Completions wire form (how the sessions API shows a conversation)."""
        d: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


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


def ends_in_assistant_text(messages: Sequence[Message]) -> bool:
    """The conversation's last message is an assistant message of text (no tool calls): one an answer can
    continue."""
    return bool(messages) and messages[-1].role == "assistant" and not messages[-1].tool_calls


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


def tool_specs(tools: Sequence[ToolParam]) -> list[ToolSpec]:
    """The request's tools as the engine's tool format takes them."""
    return [ToolSpec(t.function.name, t.function.parameters, t.model_dump(exclude_none=True)) for t in tools]


# -- assistant turns the server generated ------------------------------------------------------------

@dataclass(frozen=True)
class AssistantTurn:
    """An assistant tool-call turn as this server returned it and as the model generated it."""

    message: Message
    token_ids: tuple[int, ...]  # the turn's tokens: server prefill + generated (EOS included)
    # The chat template's extra arguments (`chat_template_kwargs`) its prompt was rendered with: a later
    # rendering of the conversation renders the turn's prompt with them again, whatever that request asks.
    template_kwargs: Mapping[str, Any] | None = None


TurnLookup = Callable[[Message], "AssistantTurn | None"]


class Opening(Enum):
    """How a chat prompt ends."""

    GENERATION_PROMPT = "generation_prompt"  # the template's opening of the next assistant turn
    NONE = "none"  # the conversation alone, as the template renders it for history
    # Inside the final assistant message, left open (its turn end cut off, as transformers'
    # `continue_final_message` cuts it): the answer continues that text (Anthropic's prefill)
    CONTINUE = "continue"


# -- the renderer -----------------------------------------------------------------------------------

_SENTINEL = "\x00INFERCEPT-SENTINEL\x00"


class ChatRenderer:
    """Renders conversations for one tokenizer (thread-safe: holds no per-request state)."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int], tool_format: ToolFormat):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.tool_format = tool_format
        template = tokenizer.chat_template or ""
        if not template:
            raise ValueError("the model has no chat template; /v1/chat/completions needs one")
        self.native_tools = re.search(r"\btools\b", template) is not None
        # Text the template puts after an assistant message's content (ChatML: "<|im_end|>\n").
        probe = self._apply([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}], False)
        self.turn_end = probe[probe.rfind(_SENTINEL) + len(_SENTINEL):] if _SENTINEL in probe else ""

    # -- public ------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None,
               known_turn: TurnLookup | None = None, prefill: str = "",
               template_kwargs: Mapping[str, Any] | None = None,
               opening: Opening = Opening.GENERATION_PROMPT) -> list[int]:
        """Prompt token ids for `messages` + the generation prompt (+ `prefill`), with every assistant
        turn `known_turn` recognizes rendered as its exact generated tokens. `template_kwargs`: extra
        arguments of the chat template (`chat_template_kwargs`); a known turn's prompt is rendered with
        its own (`AssistantTurn.template_kwargs`), as when it was generated. `opening`: how the prompt
        ends, by default in the generation prompt."""
        self.check_template_kwargs(template_kwargs)
        prepared, index = self._prepare(messages, tools)
        full = self._apply(prepared, opening is Opening.GENERATION_PROMPT, tools, template_kwargs,
                           continue_final=opening is Opening.CONTINUE)
        ids: list[int] = []
        pos = 0
        for i, m in enumerate(messages):
            turn = known_turn(m) if known_turn is not None and m.role == "assistant" and m.tool_calls else None
            if turn is None or index[i] == 0:
                continue
            kwargs = turn.template_kwargs
            head = self._apply(prepared[:index[i]], False, tools, kwargs)  # the conversation before the turn
            before = self._apply(prepared[:index[i]], True, tools, kwargs)  # + the generation prompt: its prompt
            upto = self._apply(prepared[:index[i] + 1], False, tools, kwargs)  # the turn as the last message
            end = self._turn_end_in(full, head, before, upto) if len(head) >= pos else None
            if end is None:
                return self.encode(full) + self.encode(prefill)  # a template that is not prefix-stable
            ids += self.encode(before[pos:])
            ids += turn.token_ids
            pos = self._after_turn(full, end, turn.token_ids)
        return ids + self.encode(full[pos:]) + self.encode(prefill)

    # -- internals ---------------------------------------------------------------------------------
    def _turn_end_in(self, full: str, head: str, before: str, upto: str) -> int | None:
        """Where, in `full` (the whole conversation), an assistant turn ends, given `head` (the
        conversation before it), `before` (that + the generation prompt the turn was generated after) and
        `upto` (the conversation up to it as its last message); None if `full` renders the conversation
        before it differently, or the turn in a way not recognized below.

        A prefix-stable template renders `upto` as the start of `full`. Thinking templates do not: Qwen3's
        renders the last assistant turn with a thinking block (empty without `reasoning_content`) and
        drops it once more messages follow, and templates of thinking-only models open the thinking in
        the generation prompt, which the turn rendered as history lacks. The turn is then found in `full`
        after `head` up to a turn end, as `upto`'s rendering of it with one piece cut out (the thinking
        block). The resume appends only what follows it, after the paused generation's own tokens (its
        generation prompt, and its thinking, included)."""
        if not (full.startswith(head) and before.startswith(head) and upto.startswith(head)
                and upto.endswith(self.turn_end)):
            return None
        if upto.startswith(before) and full.startswith(upto):
            return len(upto)
        if not self.turn_end:
            return None
        last, rest = upto[len(head):], full[len(head):]
        common = len(os.path.commonprefix([last, rest]))
        at = 0
        while 0 <= (at := rest.find(self.turn_end, at)) and at + len(self.turn_end) <= len(last):
            at += len(self.turn_end)
            if at == len(last) if at <= common else last.endswith(rest[common:at]):
                return len(head) + at
        return None

    def _after_turn(self, full: str, end: int, token_ids: Sequence[int]) -> int:
        """Where the text after a known turn's tokens starts in `full`, the turn rendered as history ending
        at `end`: the template's turn end, but the part the model generated itself, follows the tokens
        (after a generated EOS that the turn end starts with, ChatML's "<|im_end|>", only the rest, "\\n");
        a generated EOS that the turn end does not start with but the next message does (GLM's turn has
        no end: its EOS, "<|observation|>", is the role of the tool message after it) is that message's."""
        if token_ids and token_ids[-1] in self.eos_token_ids:
            eos_text = self.tokenizer.decode([token_ids[-1]], skip_special_tokens=False)
            if eos_text and self.turn_end.startswith(eos_text):
                return end - len(self.turn_end) + len(eos_text)
            if eos_text and not self.turn_end and full.startswith(eos_text, end):
                return end + len(eos_text)
        return end - len(self.turn_end)

    def check_template_kwargs(self, template_kwargs: Mapping[str, Any] | None) -> None:
        """400 for `chat_template_kwargs` that name an argument of `apply_chat_template` itself (the
        server decides the template, the tools, the generation prompt and the output) or its messages."""
        if not template_kwargs:
            return
        taken = sorted(set(template_kwargs) & self._reserved_kwargs())
        if taken:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets these",
                              param="chat_template_kwargs")

    def _reserved_kwargs(self) -> set[str]:
        params = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        return {p.name for p in params if p.kind is not p.VAR_KEYWORD} | {"messages", "conversation", "self"}

    def _apply(self, prepared: list[dict], add_generation_prompt: bool, tools=None,
               template_kwargs: Mapping[str, Any] | None = None, continue_final: bool = False) -> str:
        kwargs = dict(template_kwargs or {})
        if tools and self.native_tools:
            kwargs["tools"] = [dict(t.definition) for t in tools]
        return self.tokenizer.apply_chat_template(prepared, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final, **kwargs)

    def _prepare(self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None) -> tuple[list[dict], list[int]]:
        """Template-ready dicts, and for each message its index among them. Depends on a message and the
        tools only, never on later messages, so a conversation's prefix prepares to a prefix."""
        prepared: list[dict] = []
        index: list[int] = []
        start = 0
        if tools and not self.native_tools:
            system, examples = self.tool_format.prompt_messages(tools)
            if messages and messages[0].role == "system":
                system = messages[0].content + "\n\n" + system
                index.append(0)
                start = 1
            prepared.append({"role": "system", "content": system})
            prepared += examples
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
                calls = "\n".join(self.tool_format.call_text(c.name, c.arguments_value()) for c in m.tool_calls)
                d["content"] = (m.content + "\n" + calls) if m.content else calls
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        return d
