"""A normalized `Message` back in Chat Completions wire form: how the Responses front end hands its
conversation to the chat path, and how the sessions API shows a conversation."""
from __future__ import annotations

from .chat import Message


def chat_message(m: Message) -> dict:
    d: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d
