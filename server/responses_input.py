"""A Responses request as the turn layer takes it: its input items as chat messages, its function tools
as `ToolSpec`s, its `text.format` as the JSON its answer must follow, and `ResponseTurn`, one request
while it is served (its stream events numbered in order). Shared by the plain Responses front end
(serving_responses.py) and its MCP one (responses_mcp.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from infercept.engine.backend import ToolSpec

from .chat import Call, Message
from .conversations import Conversation
from .protocol import APIError
from .mcp_config import function_name
from .protocol_responses import (FunctionCallItem, FunctionCallOutputItem, FunctionTool, McpApprovalRequestItem,
                                 McpApprovalResponseItem, McpCallItem, MessageItem, ReasoningItem, ResponsesRequest,
                                 TextPart)
from .structured import check_without_calls, output_constraint
from .tool_mode import ToolMode
from .turns import PromptTruncation, Sampling, Turn

# -- input items -> chat messages -------------------------------------------------------------------


def _text(content: str | Sequence[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def input_messages(input: str | Sequence, other: Callable[[Any, list[Message]], None] | None = None) -> list[Message]:
    """Responses input -> chat messages. Consecutive `function_call` items are one assistant turn, with
    the assistant message just before them as its content: the shape of the turn that made them.
    `other(item, messages)` adds the messages of the items of other kinds (MCP items), `mcp_item_messages`
    where it is not given."""
    if isinstance(input, str):
        return [Message("user", input)]
    messages: list[Message] = []
    for item in input:
        if isinstance(item, FunctionCallItem):
            call = Call.make(item.call_id, item.name, item.arguments)
            if messages and messages[-1].role == "assistant":
                messages[-1] = replace(messages[-1], tool_calls=messages[-1].tool_calls + (call,))
            else:
                messages.append(Message("assistant", "", tool_calls=(call,)))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(Message("tool", _text(item.output), tool_call_id=item.call_id))
        elif isinstance(item, ReasoningItem):
            continue  # earlier thinking: not part of the conversation (chat templates drop it too)
        elif not isinstance(item, MessageItem):
            (other or mcp_item_messages)(item, messages)
        else:
            messages.append(Message("system" if item.role == "developer" else item.role, _text(item.content)))
    return messages


# Item ids follow the call's id, so an approval (or an mcp_call sent back) names its call.
def approval_id(call_id: str) -> str:
    return "mcpr_" + call_id.removeprefix("call_")


def mcp_call_id(call_id: str) -> str:
    return "mcp_" + call_id.removeprefix("call_")


def call_id_of(item_id: str, prefix: str) -> str:
    return "call_" + item_id.removeprefix(prefix)


def refusal(reason: str | None) -> str:
    """What the model reads as the result of a call the user did not approve."""
    return "error: the user did not approve this call" + (f": {reason}" if reason else "")


def mcp_item_messages(item, messages: list[Message]) -> None:
    """Add the messages of an MCP item of a finished exchange (a conversation's items, the input of a
    client keeping its own history): a call (asked for approval, or run) joins the assistant turn just
    before it, unless that turn asked for it already (the approval before its run); a run call brings its
    result as a tool message; a refused approval, the refusal; an approval, nothing (the `mcp_call` after
    it brings the result); a tool listing, nothing (the tools come from the request's `tools`)."""
    if isinstance(item, McpApprovalResponseItem):
        if not item.approve:
            messages.append(Message("tool", refusal(item.reason),
                                    tool_call_id=call_id_of(item.approval_request_id, "mcpr_")))
        return
    if not isinstance(item, (McpApprovalRequestItem, McpCallItem)):
        return
    prefix = "mcpr_" if isinstance(item, McpApprovalRequestItem) else "mcp_"
    call = Call.make(call_id_of(item.id, prefix), function_name(item.server_label, item.name), item.arguments)
    k = len(messages) - 1
    while k >= 0 and messages[k].role == "tool":  # (the results of the turn's earlier calls)
        k -= 1
    asked = k >= 0 and messages[k].role == "assistant" and any(c.id == call.id for c in messages[k].tool_calls)
    if not asked:
        if messages and messages[-1].role == "assistant":
            messages[-1] = replace(messages[-1], tool_calls=messages[-1].tool_calls + (call,))
        else:
            messages.append(Message("assistant", "", tool_calls=(call,)))
    if isinstance(item, McpCallItem):
        result = item.output if item.output is not None else f"error: {_error_text(item.error)}"
        messages.append(Message("tool", result, tool_call_id=call.id))


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error.get("content") or error)
    return str(error)


def tool_spec(tool: FunctionTool) -> ToolSpec:
    """A Responses function tool as the turn takes it (its definition as Chat Completions shows it)."""
    return ToolSpec(tool.name, tool.parameters,
                    {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)})


def request_fields(req: ResponsesRequest, mode: ToolMode) -> dict:
    """The TurnSpec fields a Responses request sets itself: how it samples, the regex or choice its whole
    output must match (`structured_outputs`; 400 if the turn, in `mode`, may call tools), the chat
    template's extra arguments, how the prompt is truncated and, for `text.format`, the JSON its answer
    must follow and the field errors name."""
    schema = req.text.answer_schema() if req.text is not None else None
    constraint = output_constraint(req)
    check_without_calls(constraint, mode.parse, "text.format" if schema is not None else None)
    # truncation auto: a conversation longer than the context is served with its last tokens that fit (as
    # vLLM truncates it), not refused
    truncation = PromptTruncation(-1, param="truncation") if req.truncation == "auto" else None
    fields = {"sampling": Sampling.of(req, req.max_output_tokens, req.logprobs()), "constraint": constraint,
              "template_kwargs": req.chat_template_kwargs, "truncation": truncation}
    return fields | ({"answer_schema": schema, "answer_param": "text.format"} if schema is not None else {})


@dataclass
class Continued:
    """What a Responses request continues (`ResponsesServing.continued`)."""

    request: ResponsesRequest  # the request, its input's item references replaced by the items they name
    history: tuple[Message, ...]  # the messages before its input's
    input_items: list[dict]  # the response's input items: the history's, then its input's
    previous: Conversation | None = None  # the stored response it chains onto
    in_conversation: Conversation | None = None  # the conversation (/v1/conversations) it is part of
    kept_items: list[dict] = field(default_factory=list)  # the input items it adds there when it ends


@dataclass
class ResponseTurn:
    """One Responses request while it is served."""

    request: ResponsesRequest
    model: str
    message_id: str  # of the output message, known before its text streams
    created_at: int
    conversation: tuple[Message, ...]  # the chain's input messages, this request's included
    turn: Turn
    sequence: int = 0  # of the next stream event
    reasoning_id: str = ""  # of the reasoning output item (a thinking model's), known before it streams
    in_conversation: Conversation | None = None  # the conversation (/v1/conversations) it is part of
    kept_items: list[dict] = field(default_factory=list)  # the input items it adds there when it ends
    input_items: list[dict] = field(default_factory=list)  # the chain's input items, this request's included

    @property
    def id(self) -> str:
        return self.turn.id

    def event(self, kind: str, **fields) -> dict:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": json.dumps(payload, ensure_ascii=False)}

    def error(self, e: APIError) -> dict:
        return self.event("error", code=e.code, message=e.message, param=e.param)
