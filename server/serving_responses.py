"""POST /v1/responses (OpenAI Responses API), GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items, and POST /v1/responses/{id}/cancel (for those run in the background:
responses_background.py).

A Responses request is a chat turn in another shape: its input items become chat messages
(`function_call` items join the assistant message they follow, `function_call_output` items become
tool messages), `instructions` a leading system message, and its `TurnSpec` (turns.py) is served like
any other, so rendering, tool-call parsing and pausing are the turn API's. A response that ends in
function calls leaves its generation paused; the request that brings the `function_call_output` items
(after `previous_response_id`, or repeating the items itself) repeats that conversation, so its turn
claims and resumes the paused generation, and `usage.input_tokens_details.cached_tokens` counts the
input tokens whose KV was reused. A stored response is a record of the conversation store
(`Kind.RESPONSE`) and holds the generation it paused until a chained request resumes it. A request
naming a `conversation` (/v1/conversations: serving_conversations.py) continues that conversation's
messages instead, and the conversation holds the generation its response paused at.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from .chat import Message
from .conversation_items import input_items_after, kept_items, list_page, parsed_items
from .conversations import Conversation, State
from .protocol import APIError, TokenLogprob, bad_request, new_id, now
from . import responses_mcp
from .protocol_responses import (DeletedResponse, IncompleteDetails, InputTokensDetails, ItemReference,
                                 OutputFunctionCall, OutputItem, OutputMessage, OutputReasoning, OutputText,
                                 OutputTokensDetails, ReasoningText, ResponseObject, ResponsesRequest, ResponseUsage)
from .responses_input import Continued, ResponseTurn, input_messages, request_fields, tool_spec
from .responses_mcp import ResponsesMcp
from .responses_background import BackgroundResponses
from .serving_base import Frontend, StreamResponse, respond
from .serving_conversations import ConversationsServing
from .tenants import owner_of
from .tool_mode import tool_mode
from .turns import ReasoningDelta, TextDelta, TurnFinished, TurnResult, TurnSpec

ARGUMENT_FRAGMENT_CHARS = 16  # a call's arguments stream in pieces of this size once the call is parsed

class ResponsesServing(Frontend):
    mcp: ResponsesMcp | None = None  # serves the requests with MCP tools or items (app.py sets it)
    background: BackgroundResponses  # the responses running in the background (app.py sets it)
    conversations_api: ConversationsServing  # the conversations (/v1/conversations) responses join (app.py sets it)

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        if req.background:
            BackgroundResponses.check(req.store, self.conversations.policy.max_stored_responses)
        owner = owner_of(raw)
        continued = self.continued(req, owner)
        req = continued.request
        if responses_mcp.wanted(req):
            if self.mcp is None:
                raise bad_request("mcp tools are not available on this server", param="tools")
            return await self.mcp.create(self, continued, raw)
        history, record = continued.history, continued.in_conversation
        conversation = history + tuple(input_messages(req.input))
        if not conversation:
            raise bad_request("input must not be empty", param="input")
        model = req.model or self.model_name
        self.check_model(model)
        choice = req.tool_choice if req.tool_choice is None or isinstance(req.tool_choice, str) else req.tool_choice.name
        mode = tool_mode([tool_spec(t) for t in req.tools] if req.tools else None, choice,
                         req.parallel_tool_calls is not False)
        system = (Message("system", req.instructions),) if req.instructions else ()
        spec = TurnSpec("chat", messages=system + conversation, mode=mode, id_prefix="resp_", param="input",
                        owner=owner, holder=record, **request_fields(req, mode))
        turn = await self.open(spec)  # (its conversation generating until the turn closes)
        rt = ResponseTurn(req, model, new_id("msg_"), now(), conversation, turn, reasoning_id=new_id("rs_"),
                          in_conversation=record, kept_items=continued.kept_items, input_items=continued.input_items)
        return await self.answer(raw, rt, lambda: self._events(rt), lambda: self._full(rt), lambda: self.close(turn))

    def continued(self, req: ResponsesRequest, owner: str | None) -> Continued:
        """What the request continues: its conversation's messages (the input items it adds there), or the
        stored response it chains onto (404 for an unknown one), or nothing; the response's input items; and
        the request with its `item_reference`s replaced by the items they name (`dereferenced`)."""
        if req.conversation is not None:
            if req.previous_response_id is not None:
                raise bad_request("previous_response_id cannot be used with conversation", param="conversation")
            record = self.conversations_api.of(req.conversation_id, owner, editing=True, param="conversation")
            req = self.dereferenced(req, owner, record.items)
            kept = kept_items(req.input, {item["id"] for item in record.items}, mcp=True)
            return Continued(req, record.messages, record.items + kept, in_conversation=record, kept_items=kept)
        if req.previous_response_id is None:
            return Continued(req := self.dereferenced(req, owner, []), (), input_items_after(None, req.input))
        previous = self.conversations.response(req.previous_response_id, owner)
        if previous is None:
            raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        req = self.dereferenced(req, owner, previous.items + previous.body["output"])
        return Continued(req, previous.messages, input_items_after(previous, req.input), previous=previous)

    def dereferenced(self, req: ResponsesRequest, owner: str | None, history: list[dict]) -> ResponsesRequest:
        """The request with each `item_reference` of its input replaced by the item it names, of the owner's
        stored responses and conversations: 400 for one that names none, or an item of `history` (the items
        of the conversation or chain it continues: a duplicate, as OpenAI's API says)."""
        if isinstance(req.input, str) or not any(isinstance(item, ItemReference) for item in req.input):
            return req
        had = {item["id"] for item in history}
        resolved = []
        for i, item in enumerate(req.input):
            if isinstance(item, ItemReference):
                if item.id in had:
                    raise bad_request(f"input[{i}]: Duplicate item found with id '{item.id}': the conversation or "
                                      "previous response continued has it already; remove it from the input",
                                      param=f"input[{i}]")
                named = self.conversations.item(item.id, owner)
                if named is None:
                    raise bad_request(f"input[{i}]: item_reference names no stored item '{item.id}'",
                                      param=f"input[{i}]")
                item = parsed_items([named], param=f"input[{i}]")[0]
            resolved.append(item)
        return req.model_copy(update={"input": resolved})

    def keep_in_conversation(self, rt: ResponseTurn, output: list[dict]) -> None:
        """A response in a conversation ends: its input and output items are the conversation's."""
        record = rt.in_conversation
        if record is not None and record.state is not State.CLOSED:
            self.conversations_api.keep(record, record.items + rt.kept_items + output)

    async def answer(self, raw: Request, rt: ResponseTurn, events: Callable[[], AsyncIterator[dict]],
                     body: Callable[[], Awaitable[dict]], cleanup: Callable[[], Awaitable[None]]) -> Response:
        """The response as the request asks: streamed, whole, or run in the background (answered at once,
        queued, or streamed while the turn goes on without the client)."""
        headers = {"X-Request-Id": rt.id}
        if not rt.request.background:
            return await respond(raw, bool(rt.request.stream), events, body, cleanup, headers, f"response {rt.id}",
                                 error=rt.error, done=None)
        try:
            entry = self.background.start(rt.id, rt.turn.spec.owner, events(), cleanup, rt.error, rt.input_items)
        except APIError:
            await cleanup()
            raise
        if rt.request.stream:
            return StreamResponse(entry.stream(), _nothing, headers)
        await entry.started()
        return JSONResponse(entry.body, headers=headers)

    async def retrieve(self, response_id: str, raw: Request) -> Response:
        """The response; `?stream=true` (a background response's): its events again, from the first or
        after `starting_after`, then the rest as its turn goes on."""
        entry = self.background.get(response_id, owner_of(raw))
        if raw.query_params.get("stream", "false").lower() in ("true", "1"):
            if entry is None:
                self._stored(response_id, raw)  # (404 for an unknown one)
                raise bad_request("only a background response can be streamed again", param="stream")
            after = raw.query_params.get("starting_after", "-1")
            if not after.lstrip("-").isdigit():
                raise bad_request("starting_after must be a sequence number", param="starting_after")
            return StreamResponse(entry.stream(max(int(after), -1)), _nothing, {"X-Request-Id": response_id})
        if entry is not None and (not entry.done or self.conversations.response(response_id, entry.owner) is None):
            return JSONResponse(entry.body)  # (running, or ended without being stored: failed, cancelled)
        return JSONResponse(self._stored(response_id, raw).body)

    async def input_items(self, response_id: str, raw: Request) -> Response:
        """A page of the response's input items (those of the chain it continues, its own input's after),
        as a conversation's items are paged."""
        stored = self.conversations.response(response_id, owner_of(raw))
        entry = self.background.get(response_id, owner_of(raw)) if stored is None else None
        if stored is None and entry is None:
            self._stored(response_id, raw)  # (404)
        items = stored.items if stored is not None else entry.input_items
        return JSONResponse(list_page(items, raw.query_params, f"response {response_id!r}"))

    async def cancel(self, response_id: str, raw: Request) -> Response:
        entry = self.background.get(response_id, owner_of(raw))
        if entry is None:
            self._stored(response_id, raw)
            raise bad_request("only a background response can be cancelled", param="response_id")
        await self.background.cancel(entry)
        return JSONResponse(entry.body)

    async def delete(self, response_id: str, raw: Request) -> Response:
        # Its paused generation is released too, unless a later response of the chain resumed it.
        owner = owner_of(raw)
        entry = self.background.get(response_id, owner)
        if entry is not None:
            await self.background.forget(entry)
        stored = self.conversations.response(response_id, owner)
        if stored is not None or entry is None:
            self.conversations.close(self._stored(response_id, raw), reason=f"response {response_id} deleted")
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    def _stored(self, response_id: str, raw: Request) -> Conversation:
        stored = self.conversations.response(response_id, owner_of(raw))
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
        return stored

    # -- building the response ---------------------------------------------------------------------
    def text_logprobs(self, rt: ResponseTurn, end: TurnFinished, start: int | None = None) -> list[TokenLogprob]:
        """The output text's logprobs, where the request includes them: of the turn's tokens after its
        thinking (or from `start`), those of its calls too, as vLLM reports them."""
        top = rt.request.logprobs()
        if top is None:
            return []
        start = (end.usage.reasoning_tokens or 0) if start is None else start
        return self.token_logprobs(end.output, start, len(end.output.token_ids), top)

    def _output_items(self, rt: ResponseTurn, result: TurnResult, text_announced: bool,
                      logprobs: Sequence[TokenLogprob] = ()) -> list[OutputItem]:
        items: list[OutputItem] = []
        if result.reasoning and rt.request.include_reasoning:
            items.append(OutputReasoning(id=rt.reasoning_id, content=[ReasoningText(text=result.reasoning)],
                                         status="completed"))
        if result.content or text_announced:
            status = "incomplete" if result.finish_reason == "length" else "completed"
            items.append(OutputMessage(id=rt.message_id, status=status,
                                       content=[OutputText(text=result.content or "", logprobs=list(logprobs))]))
        items += [OutputFunctionCall(id=new_id("fc_"), call_id=c.id, name=c.name, arguments=c.arguments,
                                     status="completed") for c in result.calls]
        return items

    def _response(self, rt: ResponseTurn, status: str, output: Sequence[OutputItem] = (),
                  end: TurnFinished | None = None) -> ResponseObject:
        req = rt.request
        usage = None
        if end is not None:
            u = end.usage
            usage = ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                                  total_tokens=u.prompt_tokens + u.completion_tokens,
                                  input_tokens_details=InputTokensDetails(cached_tokens=u.cached_tokens),
                                  output_tokens_details=OutputTokensDetails(reasoning_tokens=u.reasoning_tokens or 0))
        tool_choice = req.tool_choice.model_dump() if req.tool_choice is not None and not isinstance(
            req.tool_choice, str) else req.tool_choice or "auto"
        return ResponseObject(
            id=rt.id, created_at=rt.created_at, status=status, model=rt.model,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, output=list(output),
            parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
            store=req.store is not False, temperature=req.temperature, top_p=req.top_p, tool_choice=tool_choice,
            tools=[t.model_dump(exclude_none=True) for t in req.tools or ()], usage=usage, user=req.user,
            metadata=req.metadata or {}, background=req.background is True, truncation=req.truncation or "disabled",
            conversation={"id": rt.in_conversation.id} if rt.in_conversation is not None else None,
            text=req.text.echoed() if req.text is not None else {"format": {"type": "text"}})

    def _finish(self, rt: ResponseTurn, end: TurnFinished, output: list[OutputItem]) -> dict:
        """The final response body; stored when the request asked for it."""
        status = "incomplete" if end.result.finish_reason == "length" else "completed"
        body = self._response(rt, status, output, end).model_dump(mode="json")
        self.keep_in_conversation(rt, body["output"])
        if rt.request.store is not False:
            self.conversations.store_response(rt.id, body, rt.conversation + (end.result.message,),
                                              rt.turn.engine.request_id, rt.turn.spec.owner, rt.input_items)
        return body

    # -- non-streaming -----------------------------------------------------------------------------
    async def _full(self, rt: ResponseTurn) -> dict:
        end = await rt.turn.result()
        return self._finish(rt, end, self._output_items(rt, end.result, False, self.text_logprobs(rt, end)))

    # -- streaming ---------------------------------------------------------------------------------
    async def _events(self, rt: ResponseTurn) -> AsyncIterator[dict]:
        """The official event sequence: created, in_progress, then per output item added ... done
        (text: content_part.added, output_text.delta*, output_text.done, content_part.done; a function
        call: function_call_arguments.delta*, .done), then completed (or incomplete)."""
        event = rt.event

        def text_item(status: str, text: str = "") -> dict:
            return OutputMessage(id=rt.message_id, status=status,
                                 content=[OutputText(text=text)] if status != "in_progress" else []).model_dump()

        def announce() -> list[dict]:
            return [event("response.output_item.added", output_index=part["output_index"],
                          item=text_item("in_progress")),
                    event("response.content_part.added", **part, part=OutputText(text="").model_dump())]

        part = {"item_id": rt.message_id, "output_index": 0, "content_index": 0}
        snapshot = self._response(rt, "in_progress").model_dump(mode="json")
        yield event("response.created", response=snapshot)
        yield event("response.in_progress", response=snapshot)
        def reasoning_done(text: str) -> list[dict]:  # the thinking comes first (output 0), whole before the text
            item = OutputReasoning(id=rt.reasoning_id, content=[ReasoningText(text=text)], status="completed")
            return [event("response.reasoning_text.done", **thinking, text=text),
                    event("response.output_item.done", output_index=0, item=item.model_dump())]

        thinking = {"item_id": rt.reasoning_id, "output_index": 0, "content_index": 0}
        streamed, thought, end = "", None, None  # thought: the reasoning streamed, until its item is done
        top, shown = rt.request.logprobs(), None  # shown: the output tokens whose logprobs a delta carried
        async for e in rt.turn.events():
            if isinstance(e, ReasoningDelta):
                if not rt.request.include_reasoning:
                    continue
                if thought is None:
                    thought, part["output_index"] = "", 1
                    yield event("response.output_item.added", output_index=0, item=OutputReasoning(
                        id=rt.reasoning_id, content=[], status="in_progress").model_dump())
                yield event("response.reasoning_text.delta", **thinking, delta=e.text)
                thought += e.text
            elif isinstance(e, TextDelta):
                if thought:
                    for done in reasoning_done(thought):
                        yield done
                    thought = ""
                if not streamed:
                    for announcement in announce():
                        yield announcement
                lp = []
                if top is not None:
                    if shown is None:  # the text's first tokens follow the thinking's
                        shown = rt.turn.usage(e.output).reasoning_tokens or 0
                    upto = len(e.output.token_ids)
                    lp, shown = self.token_logprobs(e.output, shown, upto, top), upto
                yield event("response.output_text.delta", **part, delta=e.text, logprobs=_dumped(lp))
                streamed += e.text
            elif isinstance(e, TurnFinished):
                end = e
        logprobs = self.text_logprobs(rt, end)
        output = self._output_items(rt, end.result, bool(streamed), logprobs)
        for index, item in enumerate(output):
            if isinstance(item, OutputReasoning):
                if thought:  # (a turn's reasoning streams whole before its end: nothing is left to send)
                    for done in reasoning_done(thought):
                        yield done
                continue
            if isinstance(item, OutputMessage):
                text = item.content[0].text
                if not streamed:
                    for announcement in announce():
                        yield announcement
                if len(text) > len(streamed) and text.startswith(streamed):
                    rest = self.text_logprobs(rt, end, shown) if shown is not None else logprobs
                    yield event("response.output_text.delta", **part, delta=text[len(streamed):],
                                logprobs=_dumped(rest))
                yield event("response.output_text.done", **part, text=text, logprobs=_dumped(logprobs))
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
        body = self._finish(rt, end, output)
        yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)


async def _nothing() -> None:
    pass


def _dumped(logprobs: Sequence[TokenLogprob]) -> list[dict]:
    return [lp.model_dump() for lp in logprobs]
