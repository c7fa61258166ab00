"""POST /v1/chat/completions: render, start or resume the generation, answer (JSON or SSE).

A turn that ends in tool calls stays paused in the engine and is kept (`ConversationStore`): the
request that brings the tool results resumes it, with only the tokens a fresh rendering adds after the
paused context (the tool results and the next generation prompt) to compute.

Tool calls are never reported broken, and they are decided once, by the engine (its tool format,
engine/tool_format.py): a call counts when it parses, names a tool of the request and its arguments
validate against that tool's schema; anything else is content. The engine pauses only on calls that
all count; this module renders its verdict (`RequestOutput.tool_calls` / `.content`). With
`tool_choice` "required" or a named function (Hermes format), the turn is grammar-constrained
(engine/guided_decoding.py): it can only be calls of the allowed tools whose arguments follow their
schemas, so streams send each call's arguments token by token as they are generated. With "auto" the
model writes freely, so auto-mode streams send calls only once the engine has judged them, whole.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi.responses import Response
from starlette.requests import Request

from infercept.engine.backend import InterceptParams, RequestOutput

from .chat import AssistantTurn, Call, ChatRenderer, Message, normalize_messages, validate_tool_flow
from .chat_request import ToolMode, session_id_of, tool_mode, with_grammar
from .conversations import Conversation, Kind, Paused, State
from .protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatMessage, ChoiceLogprobs, FunctionCall, PromptTokensDetails,
                       TokenLogprob, ToolCall, TopLogprob, Usage, bad_request, new_id, now)
from .serving_base import BaseServing, EngineTurn, logger, openai_sse, respond

@dataclass
class TurnResult:
    content: str | None
    calls: list[Call]
    finish_reason: str
    message: Message


@dataclass
class ChatContext:
    """One chat request while it is served."""

    response_id: str
    request: ChatCompletionRequest
    messages: list[Message]
    mode: ToolMode
    prefill: str
    turn: EngineTurn
    session_id: str | None
    guided_calls: bool = False  # grammar-constrained calls: any call the turn writes has valid arguments
    call_ids: list[str] = field(default_factory=list)  # ids of this turn's calls, by index

    @property
    def headers(self) -> dict[str, str]:
        """The response headers that name this request (and its session)."""
        return {"X-Request-Id": self.response_id} | ({"X-Session-Id": self.session_id} if self.session_id else {})


@dataclass(frozen=True)
class StreamedCall:
    """A tool call as far as a stream may show it."""

    index: int
    id: str
    name: str
    arguments: str  # JSON text so far


class ChatServing(BaseServing):
    endpoint = "chat"

    def __init__(self, *args, renderer: ChatRenderer, **kwargs):
        super().__init__(*args, **kwargs)
        self.renderer = renderer
        self.format = renderer.tool_format

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        ctx, cleanup = await self.open(req, raw)
        return await respond(raw, req.stream, lambda: openai_sse(self._stream(ctx), f"request {ctx.response_id}"),
                             lambda: self._full(ctx), cleanup, ctx.headers)

    async def open(self, req: ChatCompletionRequest, raw: Request) -> tuple[ChatContext, Callable[[], Awaitable[None]]]:
        """Validate and render `req`, then start its engine turn or resume the paused one it continues.
        `cleanup` must run once the turn is left (it aborts an unfinished turn and releases admission).
        The Responses and sessions front ends serve their turns through this too."""
        started = time.monotonic()
        self.check_model(req.model)
        self.check_unsupported(req)
        mode = tool_mode(req)
        session_id = session_id_of(req, raw)
        messages = normalize_messages(req.messages, validate=False)
        session = None
        if session_id is not None:
            messages, session = self._session_messages(session_id, messages)
        validate_tool_flow(messages)

        prefill = self.format.forced_prefill(mode.forced_name) if mode.forced else ""
        try:
            prompt_ids = self.renderer.render(messages, mode.tools, self.conversations.known_turn, prefill)
        except APIError:
            raise
        except Exception as e:  # the template (jinja) or the tokenizer refused the input
            raise bad_request(f"the conversation could not be rendered with the model's chat template: {e}",
                              param="messages") from None
        self.check_prompt(prompt_ids, "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, len(prompt_ids), max_tokens, logprobs,
                                      skip_special_tokens=not (mode.parse and self.format.keeps_special_tokens))
        params = with_grammar(self.format, params, mode, req.response_format.answer_schema() if req.response_format else None)
        intercept = None
        if mode.parse:
            hint = req.intercept
            intercept = InterceptParams(tool_parser=self.format.family, tools=tuple(mode.tools), parallel_calls=mode.parallel,
                                        text_prefix=prefill, expected_s=hint.expected_s if hint else None,
                                        kind=hint.kind if hint else "tool")
        response_id = new_id("chatcmpl-")

        def claim() -> Paused | None:
            entry = self._claim_paused(messages, prompt_ids, session)
            if session is not None:
                session.state = State.GENERATING
            return entry

        turn, cleanup = await self.admitted_turn(response_id, prompt_ids, params, intercept, claim, started,
                                                 "explicit" if session_id else "implicit",
                                                 release=lambda: self._release(session))
        ctx = ChatContext(response_id, req, messages, mode, prefill, turn, session_id,
                          guided_calls=mode.parse and params.guided is not None)
        return ctx, cleanup

    def streamable_text(self, ctx: ChatContext, text: str) -> str:
        """The part of a turn's text so far that is surely content, never part of a tool call."""
        if ctx.mode.forced:
            return ""
        return self.format.safe_content(text) if ctx.mode.parse else text

    def streamable_calls(self, ctx: ChatContext, text: str) -> list[StreamedCall]:
        """The tool calls of a turn's text so far that a stream may show while they are written: in a
        grammar-constrained turn, every call whose name is complete, with its arguments so far (the
        grammar guarantees they end valid); otherwise none (calls count only once validated)."""
        if not ctx.guided_calls:
            return []
        return [StreamedCall(i, self._call_id(ctx, i), c.name, c.arguments)
                for i, c in enumerate(self.format.partial_calls(ctx.prefill + text))]

    def end_turn(self, ctx: ChatContext, out: RequestOutput) -> TurnResult:
        """End a turn opened with `open` from its last output: pause or finish it, and record it."""
        result = self._end_turn(ctx, out)
        self._log(ctx, out, result)
        return result

    def _session_messages(self, session_id: str, messages: list[Message]):
        """Explicit continuation. Messages that start with tool results continue the session's stored
        conversation (which must be paused at tool calls); any other list is the whole conversation."""
        session = self.conversations.named(Kind.CHAT, session_id)
        if session is not None and session.state is State.GENERATING:
            raise APIError(409, f"session {session_id!r} has a request in flight", param="session_id",
                           code="session_busy")
        if messages[0].role == "tool":
            if session is None:
                raise APIError(404, f"unknown session {session_id!r}", param="session_id", code="session_not_found")
            if session.paused is None:
                raise APIError(409, f"session {session_id!r} is not paused at a tool call", param="session_id",
                               code="session_not_paused")
            messages = list(session.messages) + messages
        return messages, session or self.conversations.open_named(Kind.CHAT, session_id)

    def _claim_paused(self, messages: list[Message], prompt_ids: list[int], session: Conversation | None):
        """The paused generation this request continues, if its rendering extends the paused tokens."""
        entry = self.conversations.find_for_messages(messages, session)
        if entry is None:
            if session is not None:  # the session moved on: its paused generation is of no further use
                self.conversations.release_paused(session, f"session {session.id} continued differently")
            return None
        n = len(entry.token_ids)
        if len(prompt_ids) > n and prompt_ids[:n] == entry.token_ids:
            return self.conversations.take(entry)
        logger.info("conversation matches paused %s but its rendering does not extend the paused tokens; "
                    "serving it fresh", entry.request_id)
        self.metrics.resume_fallbacks.labels(self.model_name).inc()
        return None

    def _release(self, session: Conversation | None) -> None:
        self.release()
        if session is not None:
            session.state = State.PAUSED if session.paused is not None else State.IDLE

    # -- the end of a turn -------------------------------------------------------------------------
    def _end_turn(self, ctx: ChatContext, out: RequestOutput) -> TurnResult:
        """The engine's verdict on the turn, rendered. Tool calls that all count keep the generation
        paused: register it for the request that brings their results (calls of which some did not
        count end it: the paused context would show calls that never get results)."""
        turn = ctx.turn
        if out.tool_calls:
            issued = [Call.make(self._call_id(ctx, i), c.name, c.arguments) for i, c in enumerate(out.tool_calls)]
            message = Message("assistant", out.content or "", None, tuple(issued))
            if out.paused:
                turn_ids = tuple(turn.prompt_ids[len(turn.prompt_ids) - len(self.renderer.encode(ctx.prefill)):]
                                 + out.token_ids) if ctx.prefill else tuple(out.token_ids)
                self.keep_paused(turn, Paused(turn.request_id, turn.prompt_ids + list(out.token_ids),
                                              AssistantTurn(message, turn_ids), tuple(ctx.messages)),
                                 self._session(ctx))
            self._remember_session(ctx, message)
            return TurnResult(out.content or None, issued, "tool_calls", message)
        text = ctx.prefill + out.text
        message = Message("assistant", text)
        self._remember_session(ctx, message)
        return TurnResult(text, [], self.finish_reason(out), message)

    def _call_id(self, ctx: ChatContext, index: int) -> str:
        """The id of the turn's call `index`, the same for stream deltas and the final message."""
        while len(ctx.call_ids) <= index:
            ctx.call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return ctx.call_ids[index]

    def _session(self, ctx: ChatContext) -> Conversation | None:
        return self.conversations.named(Kind.CHAT, ctx.session_id) if ctx.session_id is not None else None

    def _remember_session(self, ctx: ChatContext, message: Message) -> None:
        session = self._session(ctx)
        if session is not None:
            session.messages = tuple(ctx.messages) + (message,)

    def _usage(self, ctx: ChatContext, out: RequestOutput) -> Usage:
        n_prompt, n_out = len(ctx.turn.prompt_ids), len(out.token_ids)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=ctx.turn.cached_tokens))

    def _log(self, ctx: ChatContext, out: RequestOutput, result: TurnResult) -> None:
        usage = self._usage(ctx, out)
        self.metrics.observe_request(self.endpoint, result.finish_reason, usage.prompt_tokens,
                                     ctx.turn.cached_tokens, usage.completion_tokens)
        logger.info("request %s (engine %s%s): prompt %d tokens (%d cached), %d generated, finish %s",
                    ctx.response_id, ctx.turn.request_id, ", resumed" if ctx.turn.resumed else "",
                    usage.prompt_tokens, ctx.turn.cached_tokens, usage.completion_tokens, result.finish_reason)

    def _logprobs(self, ctx: ChatContext, out: RequestOutput, start: int, end: int) -> ChoiceLogprobs | None:
        """Logprobs of this turn's tokens [start, end) (the engine keeps every turn's; ours are the tail)."""
        if not ctx.request.logprobs or out.logprobs is None or start >= end:
            return None
        offset = len(out.logprobs) - len(out.token_ids)
        entries = []
        for sampled in out.logprobs[offset + start:offset + end]:
            text = self.token_text(sampled.token_id)
            top = [TopLogprob(token=self.token_text(t), logprob=lp, bytes=list(self.token_text(t).encode()))
                   for t, lp in (sampled.top_logprobs or {}).items()][:ctx.request.top_logprobs or 0]
            entries.append(TokenLogprob(token=text, logprob=sampled.logprob if sampled.logprob is not None else 0.0,
                                        bytes=list(text.encode()), top_logprobs=top))
        return ChoiceLogprobs(content=entries)

    # -- non-streaming -----------------------------------------------------------------------------
    async def _full(self, ctx: ChatContext) -> dict:
        last = None
        async for out in ctx.turn.outputs():
            last = out
        result = self._end_turn(ctx, last)
        self._log(ctx, last, result)
        tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in result.calls] or None
        choice = ChatChoice(message=ChatMessage(content=result.content, tool_calls=tool_calls),
                            logprobs=self._logprobs(ctx, last, 0, len(last.token_ids)),
                            finish_reason=result.finish_reason,
                            token_ids=list(last.token_ids) if ctx.request.return_token_ids else None)
        response = ChatCompletionResponse(
            id=ctx.response_id, model=ctx.request.model, choices=[choice], usage=self._usage(ctx, last),
            prompt_token_ids=list(ctx.turn.prompt_ids) if ctx.request.return_token_ids else None,
            session_id=ctx.session_id)
        body = response.model_dump(mode="json")
        for key in ("prompt_token_ids", "session_id"):
            if body[key] is None:
                del body[key]
        if body["choices"][0]["token_ids"] is None:
            del body["choices"][0]["token_ids"]
        return body

    # -- streaming ---------------------------------------------------------------------------------
    @staticmethod
    def _call_deltas(calls: list[StreamedCall], sent: dict[int, str]) -> list[dict]:
        """OpenAI tool-call deltas that take a client from `sent` (index -> arguments sent) to `calls`:
        a call's first delta has its id, type, name and empty arguments; the next ones add arguments."""
        deltas = []
        for call in calls:
            if call.index not in sent:
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                sent[call.index] = ""
            done = sent[call.index]
            if len(call.arguments) > len(done) and call.arguments.startswith(done):
                deltas.append({"index": call.index, "function": {"arguments": call.arguments[len(done):]}})
                sent[call.index] = call.arguments
        return deltas

    async def _stream(self, ctx: ChatContext) -> AsyncIterator[dict]:
        created = now()
        include_usage = bool(ctx.request.stream_options and ctx.request.stream_options.include_usage)

        def chunk(delta: dict, finish_reason: str | None = None, logprobs=None, token_ids=None) -> dict:
            c = ChatCompletionChunk(id=ctx.response_id, created=created, model=ctx.request.model,
                                    choices=[ChatChunkChoice(delta=delta, logprobs=logprobs,
                                                             finish_reason=finish_reason, token_ids=token_ids)])
            body = c.model_dump(mode="json", exclude={"usage"} if not include_usage else None)
            if token_ids is None:
                del body["choices"][0]["token_ids"]
            return {"data": json.dumps(body, ensure_ascii=False)}

        streamed = ""  # content sent so far
        sent_tokens = 0  # tokens whose logprobs were sent
        sent_calls: dict[int, str] = {}  # index -> arguments sent so far, for each call announced
        yield chunk({"role": "assistant", "content": "", "refusal": None})
        last = None
        async for out in ctx.turn.outputs():
            last = out
            if out.turn_done:
                break
            for delta in self._call_deltas(self.streamable_calls(ctx, out.text), sent_calls):
                yield chunk({"tool_calls": [delta]})
            visible = self.streamable_text(ctx, out.text)
            if len(visible) > len(streamed) and visible.startswith(streamed):
                lp = self._logprobs(ctx, out, sent_tokens, len(out.token_ids))
                sent_tokens = len(out.token_ids)
                yield chunk({"content": visible[len(streamed):]}, logprobs=lp)
                streamed = visible
        result = self._end_turn(ctx, last)
        self._log(ctx, last, result)
        content = result.content or ""
        # Once calls were shown, a turn that ends as text (a guided call cut by max_tokens) is that
        # call's text: the client already has it as a call, and the finish reason says "length".
        if not sent_calls and len(content) > len(streamed) and content.startswith(streamed):
            lp = self._logprobs(ctx, last, sent_tokens, len(last.token_ids))
            sent_tokens = len(last.token_ids)
            yield chunk({"content": content[len(streamed):]}, logprobs=lp)
        # A guided turn's calls were streamed as written: finish them so (the engine's calls are normalized,
        # JSON-equal but maybe not byte-equal, and the client joins the deltas it got).
        final = self.streamable_calls(ctx, last.text) if result.calls and ctx.guided_calls else \
            [StreamedCall(i, call.id, call.name, call.arguments) for i, call in enumerate(result.calls)]
        for delta in self._call_deltas(final, sent_calls):
            yield chunk({"tool_calls": [delta]})
        yield chunk({}, finish_reason=result.finish_reason,
                    logprobs=self._logprobs(ctx, last, sent_tokens, len(last.token_ids)),
                    token_ids=list(last.token_ids) if ctx.request.return_token_ids else None)
        if include_usage:
            usage = ChatCompletionChunk(id=ctx.response_id, created=created, model=ctx.request.model, choices=[],
                                        usage=self._usage(ctx, last))
            yield {"data": usage.model_dump_json()}
