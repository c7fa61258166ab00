"""A Messages request (Anthropic's API) as the turn layer takes it: its system prompt and messages as
chat messages, its tools as `ToolSpec`s, its `tool_choice` as a tool mode.

- `system` (text or text blocks) is a leading system message (less Claude Code's attribution block).
- A user message's `tool_result` blocks become tool messages (content: the result's text), followed by
  a user message with the rest of its text, if any: the shape of the conversation a chat template renders.
- An assistant message's `tool_use` blocks are its tool calls (`input` as the arguments' JSON), its text
  blocks its content; its `thinking` blocks are left out, as chat templates leave earlier thinking out
  (the paused turn it resumes kept its own tokens: chat.py).
- Tools are rendered as Chat Completions' function tools, so the same conversation renders the same
  prompt through either API.
- `tool_choice` auto / any / tool / none are Chat Completions' auto / required / the named function /
  none; `disable_parallel_tool_use` is `parallel_tool_calls: false`.
- Consecutive messages of one role are one turn, as Anthropic combines them (an assistant turn's texts
  joined as they are, a user turn's with newlines).
- A conversation that ends with an assistant message of text is Anthropic's prefill: the prompt ends
  inside that message and the answer continues it (its content is the continuation only, as
  Anthropic's is). As Anthropic does, a prefill may not end in whitespace.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

from infercept.engine.backend import ToolSpec

from .chat import Call, Message, ends_in_assistant_text
from .protocol import bad_request
from .protocol_messages import Block, CountTokensRequest, TextBlock, Tool
from .tool_mode import ToolMode, tool_mode

ATTRIBUTION = "x-anthropic-billing-header:"  # Claude Code's first system block
TEXT_ONLY = "only text, tool_use and tool_result content blocks are supported (this server serves a text model)"


def system_messages(system: str | Sequence[TextBlock] | None) -> list[Message]:
    """The system prompt, without Claude Code's attribution block: it is not an instruction, and it carries
    a hash of the conversation's first message, so left in, no two conversations would share the KV of
    their (otherwise identical, ~20k-token) system prompt and tools."""
    blocks = [system] if isinstance(system, str) else [block.text for block in system or ()]
    text = "\n".join(b for b in blocks if not b.startswith(ATTRIBUTION))
    return [Message("system", text)] if text else []


def _text(blocks: Sequence[Block], where: str) -> str:
    """The text of a tool result's blocks (only text blocks are taken)."""
    parts = []
    for i, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise bad_request(f"{where}[{i}]: a tool result's content takes text blocks only (got {block.type!r})",
                              param=f"{where}[{i}]")
        parts.append(block.text)
    return "\n".join(parts)


def chat_messages(req: CountTokensRequest) -> list[Message]:
    """The request's system prompt and messages as chat messages (400 on blocks the server cannot take;
    the tool results' flow is checked where every chat turn's is, when the turn renders)."""
    if not req.messages:
        raise bad_request("messages: at least one message is required", param="messages")
    out = system_messages(req.system)
    for role, first, blocks in _turns(req):
        where = f"messages[{first}]"
        texts, calls = [], []
        for at, block in blocks:
            if block.type == "text" and block.text is not None:
                texts.append(block.text)
            elif block.type in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            elif block.type == "tool_use" and role == "assistant":
                if not block.id or not block.name:
                    raise bad_request(f"{at}: a tool_use block needs an id and a name", param=at)
                calls.append(Call.make(block.id, block.name, json.dumps(block.input or {}, ensure_ascii=False)))
            elif block.type == "tool_result" and role == "user":
                if not block.tool_use_id:
                    raise bad_request(f"{at}: a tool_result block needs tool_use_id", param=at)
                content = block.content if isinstance(block.content, str) else _text(block.content or (), f"{at}.content")
                out.append(Message("tool", content, tool_call_id=block.tool_use_id))
            else:
                raise bad_request(f"{at}: {block.type!r} blocks cannot be sent in a {role} message here; "
                                  + TEXT_ONLY, param=at)
        if role == "assistant":
            if len({c.id for c in calls}) != len(calls):
                raise bad_request(f"{where}: duplicate tool_use ids", param=f"{where}.content")
            out.append(Message("assistant", "".join(texts), tool_calls=tuple(calls)))
        elif texts or not any(b.type == "tool_result" for _, b in blocks):
            out.append(Message("user", "\n".join(texts)))
    return out


def _turns(req: CountTokensRequest) -> list[tuple[str, int, list[tuple[str, Block]]]]:
    """The request's turns: consecutive messages of one role combined into one, as Anthropic combines
    them (an agent that sends a prefill's answer back as a message of its own after the prefill sends
    one assistant turn). Each: its role, the index of its first message, and its blocks with where
    each is in the request."""
    turns: list[tuple[str, int, list[tuple[str, Block]]]] = []
    for i, m in enumerate(req.messages):
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        located = [(f"messages[{i}].content[{j}]", b) for j, b in enumerate(blocks)]
        if turns and turns[-1][0] == m.role:
            turns[-1][2].extend(located)
        else:
            turns.append((m.role, i, located))
    return turns


def is_prefill(messages: Sequence[Message]) -> bool:
    """The conversation ends with an assistant message of text, which the answer continues (400 where
    that text ends in whitespace, as Anthropic's API answers)."""
    if not ends_in_assistant_text(messages):
        return False
    if messages[-1].content != messages[-1].content.rstrip():
        raise bad_request("messages: final assistant content cannot end with trailing whitespace", param="messages")
    return True


def tool_specs(tools: Sequence[Tool]) -> list[ToolSpec]:
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise bad_request(f"tools[{i}]: {tool.type!r} is one of Anthropic's hosted tools, which run on "
                              "Anthropic's side; give client tools (name, description, input_schema)",
                              param=f"tools[{i}].type")
    return [ToolSpec.function(t.name, t.input_schema, t.description) for t in tools]


def messages_tool_mode(req: CountTokensRequest) -> ToolMode:
    choice = req.tool_choice
    name = None if choice is None else {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, choice.name)
    parallel = choice is None or not choice.disable_parallel_tool_use
    return tool_mode(tool_specs(req.tools) if req.tools else None, name, parallel)
