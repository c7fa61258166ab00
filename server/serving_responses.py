"""POST /v1/responses (OpenAI Responses API), GET and DELETE /v1/responses/{id}.

A Responses request is a chat turn in another shape: its input items become chat messages
(`function_call` items join the assistant message they follow, `function_call_output` items become
tool messages), `instructions` a leading system message, and the turn is served by `ChatServing.open`
/ `end_turn`, so rendering, tool-call parsing and pausing are the chat path's. A response that ends in
function calls leaves its generation paused; the request that brings the `function_call_output` items
(after `previous_response_id`, or repeating the items itself) repeats that conversation, so the chat
path's implicit resume continues the paused generation, and `usage.input_tokens_details.cached_tokens`
counts the input tokens whose KV was reused. A stored response is a record of the conversation store
(`Kind.RESPONSE`) and holds the generation it paused until a chained request resumes it.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.requests import Request

from infercept.engine.backend import RequestOutput

from .chat import Call, Message
from .chat_wire import chat_message
from .conversations import Conversation, ConversationStore
from .protocol import APIError, ChatCompletionRequest, bad_request, new_id, now
from .protocol_responses import (DeletedResponse, FunctionCallItem, FunctionCallOutputItem, IncompleteDetails,
                                 InputTokensDetails, OutputFunctionCall, OutputItem, OutputMessage, OutputText,
                                 ResponseObject, ResponsesRequest, ResponseUsage, TextPart)
from .serving_base import logger, respond
from .serving_chat import ChatContext, ChatServing, TurnResult

ARGUMENT_FRAGMENT_CHARS = 16  # a call's arguments stream in pieces of this size once the call is parsed

# -- input items -> chat messages -------------------------------------------------------------------


def _text(content: str | Sequence[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def input_messages(input: str | Sequence) -> list[Message]:
    """Responses input -> chat messages. Consecutive `function_call` items are one assistant turn, with
    the assistant message just before them as its content: the shape of the turn that made them."""
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
        else:
            messages.append(Message("system" if item.role == "developer" else item.role, _text(item.content)))
    return messages


def chat_request(req: ResponsesRequest, model: str, messages: Sequence[Message]) -> ChatCompletionRequest:
    tool_choice = req.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    tools = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
             for t in req.tools or ()]
    try:
        return ChatCompletionRequest.model_validate(dict(
            model=model, messages=[chat_message(m) for m in messages], tools=tools or None, tool_choice=tool_choice,
            parallel_tool_calls=req.parallel_tool_calls, max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p))
    except ValidationError as e:
        raise bad_request(f"the input does not form a valid conversation: {e.errors()[0]['msg']}") from None


# -- serving ----------------------------------------------------------------------------------------

@dataclass
class ResponseTurn:
    """One Responses request while it is served."""

    request: ResponsesRequest
    response_id: str
    message_id: str  # of the output message, known before its text streams
    created_at: int
    conversation: tuple[Message, ...]  # the chain's input messages, this request's included
    chat: ChatContext


class ResponsesServing:
    def __init__(self, chat: ChatServing, conversations: ConversationStore):
        self.chat = chat
        self.conversations = conversations

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        history: tuple[Message, ...] = ()
        if req.previous_response_id is not None:
            previous = self.conversations.response(req.previous_response_id)
            if previous is None:
                raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = previous.messages
        conversation = history + tuple(input_messages(req.input))
        if not conversation:
            raise bad_request("input must not be empty", param="input")
        system = (Message("system", req.instructions),) if req.instructions else ()
        model = req.model or self.chat.model_name
        ctx, cleanup = await self.chat.open(chat_request(req, model, system + conversation), raw)
        turn = ResponseTurn(req, new_id("resp_"), new_id("msg_"), now(), conversation, ctx)
        return await respond(raw, req.stream, lambda: self._events(turn), lambda: self._full(turn), cleanup,
                             {"X-Request-Id": turn.response_id})

    async def retrieve(self, response_id: str) -> Response:
        return JSONResponse(self._stored(response_id).body)

    async def delete(self, response_id: str) -> Response:
        # Its paused generation is released too, unless a later response of the chain resumed it.
        self.conversations.close(self._stored(response_id), reason=f"response {response_id} deleted")
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    def _stored(self, response_id: str) -> Conversation:
        stored = self.conversations.response(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
        return stored

    # -- building the response ---------------------------------------------------------------------
    def _output_items(self, turn: ResponseTurn, result: TurnResult, text_announced: bool) -> list[OutputItem]:
        items: list[OutputItem] = []
        if result.content or text_announced:
            status = "incomplete" if result.finish_reason == "length" else "completed"
            items.append(OutputMessage(id=turn.message_id, status=status,
                                       content=[OutputText(text=result.content or "")]))
        items += [OutputFunctionCall(id=new_id("fc_"), call_id=c.id, name=c.name, arguments=c.arguments,
                                     status="completed") for c in result.calls]
        return items

    def _response(self, turn: ResponseTurn, status: str, output: list[OutputItem] = (),
                  out: RequestOutput | None = None) -> ResponseObject:
        req = turn.request
        usage = None
        if out is not None:
            n_input, n_output = len(turn.chat.turn.prompt_ids), len(out.token_ids)
            usage = ResponseUsage(input_tokens=n_input, output_tokens=n_output, total_tokens=n_input + n_output,
                                  input_tokens_details=InputTokensDetails(cached_tokens=turn.chat.turn.cached_tokens))
        tool_choice = req.tool_choice.model_dump() if req.tool_choice is not None and not isinstance(
            req.tool_choice, str) else req.tool_choice or "auto"
        return ResponseObject(
            id=turn.response_id, created_at=turn.created_at, status=status, model=turn.chat.request.model,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, output=list(output),
            parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
            store=req.store is not False, temperature=req.temperature, top_p=req.top_p, tool_choice=tool_choice,
            tools=[t.model_dump(exclude_none=True) for t in req.tools or ()], usage=usage, user=req.user,
            metadata=req.metadata or {})

    def _finish(self, turn: ResponseTurn, result: TurnResult, out: RequestOutput,
                output: list[OutputItem]) -> dict:
        """The final response body; stored when the request asked for it."""
        status = "incomplete" if result.finish_reason == "length" else "completed"
        body = self._response(turn, status, output, out).model_dump(mode="json")
        if turn.request.store is not False:
            self.conversations.store_response(turn.response_id, body, turn.conversation + (result.message,),
                                         turn.chat.turn.request_id)
        return body

    # -- non-streaming -----------------------------------------------------------------------------
    async def _full(self, turn: ResponseTurn) -> dict:
        last = None
        async for out in turn.chat.turn.outputs():
            last = out
        result = self.chat.end_turn(turn.chat, last)
        return self._finish(turn, result, last, self._output_items(turn, result, text_announced=False))

    # -- streaming ---------------------------------------------------------------------------------
    async def _events(self, turn: ResponseTurn) -> AsyncIterator[dict]:
        """The official event sequence: created, in_progress, then per output item added ... done
        (text: content_part.added, output_text.delta*, output_text.done, content_part.done; a function
        call: function_call_arguments.delta*, .done), then completed (or incomplete)."""
        sequence = 0

        def event(kind: str, **fields) -> dict:
            nonlocal sequence
            payload = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return {"event": kind, "data": json.dumps(payload, ensure_ascii=False)}

        def text_item(status: str, text: str = "") -> dict:
            return OutputMessage(id=turn.message_id, status=status,
                                 content=[OutputText(text=text)] if status != "in_progress" else []).model_dump()

        part = {"item_id": turn.message_id, "output_index": 0, "content_index": 0}
        try:
            snapshot = self._response(turn, "in_progress").model_dump(mode="json")
            yield event("response.created", response=snapshot)
            yield event("response.in_progress", response=snapshot)
            streamed, announced, last = "", False, None
            async for out in turn.chat.turn.outputs():
                last = out
                if out.turn_done:
                    break
                visible = self.chat.streamable_text(turn.chat, out.text)
                if len(visible) > len(streamed) and visible.startswith(streamed):
                    if not announced:
                        announced = True
                        yield event("response.output_item.added", output_index=0, item=text_item("in_progress"))
                        yield event("response.content_part.added", **part, part=OutputText(text="").model_dump())
                    yield event("response.output_text.delta", **part, delta=visible[len(streamed):], logprobs=[])
                    streamed = visible
            result = self.chat.end_turn(turn.chat, last)
            output = self._output_items(turn, result, announced)
            for index, item in enumerate(output):
                if isinstance(item, OutputMessage):
                    text = item.content[0].text
                    if not announced:
                        yield event("response.output_item.added", output_index=0, item=text_item("in_progress"))
                        yield event("response.content_part.added", **part, part=OutputText(text="").model_dump())
                    if len(text) > len(streamed) and text.startswith(streamed):
                        yield event("response.output_text.delta", **part, delta=text[len(streamed):], logprobs=[])
                    yield event("response.output_text.done", **part, text=text, logprobs=[])
                    yield event("response.content_part.done", **part, part=item.content[0].model_dump())
                else:
                    yield event("response.output_item.added", output_index=index,
                                item=item.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump())
                    for k in range(0, len(item.arguments), ARGUMENT_FRAGMENT_CHARS):
                        yield event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                    delta=item.arguments[k:k + ARGUMENT_FRAGMENT_CHARS])
                    yield event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                name=item.name, arguments=item.arguments)
                yield event("response.output_item.done", output_index=index, item=item.model_dump())
            body = self._finish(turn, result, last, output)
            yield event("response.completed" if body["status"] == "completed" else "response.incomplete",
                        response=body)
        except APIError as e:
            yield event("error", code=e.code, message=e.message, param=e.param)
        except Exception as e:  # an engine failure mid-stream: report it in the stream, never hang
            logger.exception("response %s failed mid-stream", turn.response_id)
            yield event("error", code="server_error", message=f"internal error: {e}", param=None)
