"""A Responses-API conversation's items (OpenAI's Conversations API): each item as the conversation keeps
and lists it, with its id and status, in the shapes the official SDK parses, and the chat messages the
items make (the history a response in the conversation continues).

Input items are kept as the Responses input takes them: messages (their text parts), function calls,
function call outputs and reasoning items. MCP items are not kept: the server's MCP tools run within one
response, which a conversation does not serve (responses_mcp.py).
"""
from __future__ import annotations

from collections.abc import Sequence

from pydantic import TypeAdapter, ValidationError

from .chat import Message
from .protocol import bad_request, new_id
from .protocol_responses import (FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, OutputText,
                                 ReasoningItem, TextPart)
from .responses_input import input_messages

_ITEM = TypeAdapter(InputItem)
ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_"}


def parsed_items(raw: Sequence[dict], param: str = "items") -> list:
    """Wire items -> input item models (400 naming the item that is not one)."""
    items = []
    for i, item in enumerate(raw):
        try:
            items.append(_ITEM.validate_python(item))
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(part) for part in error["loc"][1:])
            raise bad_request(f"{param}[{i}]{'.' + where if where else ''}: {error['msg']}",
                              param=f"{param}[{i}]") from None
    return items


def kept_items(input: str | Sequence, taken: set[str], param: str = "input") -> list[dict]:
    """The items a conversation keeps of `input` (a Responses input, or the items a client adds), each
    with an id: the one it came with unless the conversation has it already (`taken`, which grows)."""
    if isinstance(input, str):
        input = [MessageItem(role="user", content=input)]
    kept = []
    for i, item in enumerate(input):
        if not isinstance(item, (MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem)):
            raise bad_request(f"{param}[{i}]: a conversation keeps no {item.type} items (MCP tools run within one "
                              "response: send them without a conversation)", param=f"{param}[{i}]")
        item_id = item.id if item.id and item.id not in taken else new_id(ID_PREFIXES[item.type])
        taken.add(item_id)
        kept.append({"id": item_id, **_fields(item)})
    return kept


def _fields(item) -> dict:
    if isinstance(item, MessageItem):
        return {"type": "message", "role": item.role, "status": "completed", "content": _parts(item)}
    if isinstance(item, FunctionCallItem):
        return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments,
                "status": "completed"}
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else [p.model_dump() for p in item.output]
        return {"type": "function_call_output", "call_id": item.call_id, "output": output, "status": "completed"}
    return item.model_dump(exclude={"id"}, exclude_none=True)  # reasoning: its summary and content as sent


def _parts(item: MessageItem) -> list[dict]:
    """A message's content as text parts: output_text for the assistant's (with the keys the SDK's output
    text has), input_text for the others'."""
    kind = "output_text" if item.role == "assistant" else "input_text"
    parts = [TextPart(type=kind, text=item.content)] if isinstance(item.content, str) else item.content
    return [OutputText(text=p.text).model_dump() if kind == "output_text" else {"type": kind, "text": p.text}
            for p in parts]


def messages_of(items: Sequence[dict]) -> tuple[Message, ...]:
    """The chat messages a conversation's items make: what a response in it continues."""
    return tuple(input_messages(parsed_items(items)))
