"""Items as the server keeps and lists them: a Responses-API conversation's (OpenAI's Conversations API)
and a stored response's input items (GET /v1/responses/{id}/input_items), each with its id and status, in
the shapes the official SDK parses; the chat messages a conversation's items make (the history a response
in it continues); and a page of items, as both lists are paged.

Input items are kept as the Responses input takes them: messages (their text parts), function calls,
function call outputs and reasoning items, and the MCP items a response takes or makes (tool listings,
calls, approval requests and answers: responses_mcp.py). A client adds no MCP items to a conversation
itself: an approval is the input of the response that runs the call.
"""
from __future__ import annotations

from collections.abc import Sequence

from pydantic import TypeAdapter, ValidationError

from .chat import Message
from .protocol import bad_request, new_id
from .protocol_responses import (FunctionCallItem, FunctionCallOutputItem, InputItem, ItemReference,
                                 McpApprovalResponseItem, McpListToolsItem, MessageItem, OutputText, ReasoningItem,
                                 TextPart)
from .responses_input import input_messages

_ITEM = TypeAdapter(InputItem)
ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_", "reasoning": "rs_",
               "mcp_approval_response": "mcpa_", "mcp_list_tools": "mcpl_"}  # (the other MCP items come with one)
DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT = 20, 100  # OpenAI's


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


def kept_items(input: str | Sequence, taken: set[str], param: str = "input", mcp: bool = False) -> list[dict]:
    """The items a conversation keeps of `input` (a Responses input, or the items a client adds), each
    with an id: the one it came with unless the list has it already (`taken`, which grows). `mcp`: MCP
    items are kept too (a response's input), else refused (items a client adds)."""
    if isinstance(input, str):
        input = [MessageItem(role="user", content=input)]
    kept = []
    for i, item in enumerate(input):
        if isinstance(item, ItemReference):  # (a response's input has them replaced by what they name)
            raise bad_request(f"{param}[{i}]: an item_reference is taken as a response's input only",
                              param=f"{param}[{i}]")
        if not mcp and not isinstance(item, (MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem)):
            raise bad_request(f"{param}[{i}]: {item.type} items are added by the responses that make or take them "
                              "(an approval is the input of the response that runs its call)", param=f"{param}[{i}]")
        item_id = item.id if item.id and item.id not in taken else new_id(ID_PREFIXES[item.type])
        taken.add(item_id)
        kept.append({"id": item_id, **_fields(item)})
    return kept


def input_items_after(previous, input: str | Sequence) -> list[dict]:
    """A response's input items: those of the stored response it continues (`previous`, a record of the
    conversation store, or None) and that response's output, then `input`'s."""
    earlier = previous.items + previous.body["output"] if previous is not None else []
    return earlier + kept_items(input, {item["id"] for item in earlier}, mcp=True)


def _fields(item) -> dict:
    if isinstance(item, MessageItem):
        return {"type": "message", "role": item.role, "status": "completed", "content": _parts(item)}
    if isinstance(item, FunctionCallItem):
        return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments,
                "status": "completed"}
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else [p.model_dump() for p in item.output]
        return {"type": "function_call_output", "call_id": item.call_id, "output": output, "status": "completed"}
    if isinstance(item, McpApprovalResponseItem):
        return {"type": item.type, "approval_request_id": item.approval_request_id, "approve": item.approve,
                "reason": item.reason}
    if isinstance(item, McpListToolsItem):
        return {"type": item.type, "server_label": item.server_label, "tools": item.tools, "error": item.error}
    # reasoning: its summary and content as sent; mcp_call, mcp_approval_request: as sent
    return item.model_dump(exclude={"id"}, exclude_none=True)


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


def list_page(items: Sequence[dict], query, where: str) -> dict:
    """A page of `items` (oldest first) as a list request's `query` asks: newest first unless
    `order=asc`, after the item `after` (cursor paging), at most `limit`; `where` names the list in
    errors. (`include` asks for fields a kept item has already, or never has here: nothing to add.)"""
    limit = query.get("limit", str(DEFAULT_LIST_LIMIT))
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", param="order")
    items = list(items) if order == "asc" else list(items)[::-1]
    after = query.get("after")
    if after is not None:
        position = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            raise bad_request(f"after: no item {after!r} in {where}", param="after")
        items = items[position + 1:]
    page = items[:int(limit)]
    return page_of(page, has_more=len(items) > len(page))


def page_of(items: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}
