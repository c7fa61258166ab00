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

`tool_choice` "none" keeps the tools in the prompt (as vLLM does), so an agent's last, answering step
renders the same prefix as its calling steps and resumes or reuses it; a grammar then keeps the turn
from opening a call (Hermes format; in other formats a call the model writes anyway stays content).

`response_format` json_object / json_schema constrains the answer (a turn without tool calls) to a
JSON object / to JSON that follows the schema: with no tools or tool_choice "none", the turn is that
JSON; with "auto" (Hermes format), it is either calls or that JSON, the model chooses; a forced turn is
calls only, so the format has nothing to constrain there.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from fastapi.responses import Response
from starlette.requests import Request

from infercept.engine.backend import GuidedDecodingParams, InterceptParams, RequestOutput, SamplingParams, ToolSpec

from .chat import AssistantTurn, Call, ChatRenderer, Message, normalize_messages, tool_specs, validate_tool_flow
from .conversations import Conversation, Kind, Paused, State
from .protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatMessage, ChoiceLogprobs, FunctionCall, PromptTokensDetails,
                       TokenLogprob, ToolCall, TopLogprob, Usage, bad_request, new_id, now)
from .serving_base import BaseServing, EngineTurn, logger, openai_sse, respond

SESSION_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass
class ToolMode:
    tools: list[ToolSpec] | None  # rendered into the prompt
    parse: bool  # turns may end in tool calls (with tools but not this: tool_choice "none")
    forced: bool = False  # a call is required (tool_choice "required" or named)
    forced_name: str | None = None  # named tool_choice
    parallel: bool = True


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
        mode = self._tool_mode(req)
        session_id = self._session_id(req, raw)
        messages = normalize_messages(req.messages, validate=False)
        session = None
        if session_id is not None:
            messages, session = self._session_messages(session_id, messages)
        validate_tool_flow(messages)

        prefill = self.format.forced_prefill(mode.forced_name) if mode.forced else ""
        try:
            prompt_ids = self.renderer.render(messages, mode.tools, self.registry.known_turn, prefill)
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
        params = self._with_grammar(params, mode, req.response_format.answer_schema() if req.response_format else None)
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

    # -- request pieces ----------------------------------------------------------------------------
    def _with_grammar(self, params: SamplingParams, mode: ToolMode, answer_schema: dict | None) -> SamplingParams:
        """The turn's params constrained by its grammar, if it has one (see `_turn_grammar`)."""
        grammar = self._turn_grammar(params, mode, answer_schema)
        if grammar is None:
            return params
        guided, param = grammar
        try:
            return replace(params, guided=guided)
        except ValueError as e:  # min_tokens / ignore_eos, which hold back the end a grammar decides
            raise bad_request(f"{param} asks for a grammar-constrained turn: {e}", param=param) from None

    def _turn_grammar(self, params: SamplingParams, mode: ToolMode,
                      answer_schema: dict | None) -> tuple[GuidedDecodingParams, str] | None:
        """The grammar of the turn and the request field that asks for it; None: the model writes freely.

        forced calls -> the calls grammar (an answer never comes, so response_format has no say);
        auto + JSON answer -> calls or that JSON; JSON answer alone (no tools, or tool_choice none)
        -> that JSON; tool_choice none -> text that never opens a call."""
        if mode.forced:
            lark, param = self.format.forced_grammar(mode.tools, mode.forced_name, mode.parallel), "tool_choice"
        elif mode.parse and answer_schema is not None:
            lark, param = self.format.answer_or_call_grammar(mode.tools, mode.parallel, answer_schema), "response_format"
            if lark is None:
                raise bad_request("response_format json_object/json_schema with tools and tool_choice auto needs the "
                                  f"Hermes tool-call format (this model's is {self.format.family}); send "
                                  "tool_choice none for a JSON answer", param="response_format")
        elif answer_schema is not None:
            return (self._compile("response_format", json_schema=self.format.json_grammar_schema(answer_schema)),
                    "response_format")
        elif mode.tools is not None and not mode.parse and not (params.min_tokens or params.ignore_eos):
            # tool_choice none; with vLLM's min_tokens / ignore_eos the turn must not end where it wants,
            # which a grammar cannot combine with, so there it stays unconstrained (a call is content).
            lark, param = self.format.no_call_grammar(), "tool_choice"
        else:
            return None
        return None if lark is None else (self._compile(param, lark=lark), param)

    @staticmethod
    def _compile(param: str, **grammar) -> GuidedDecodingParams:
        try:
            return GuidedDecodingParams(**grammar)
        except ValueError as e:  # a schema feature the grammar compiler does not support
            what = ("the response_format schema (or, with tool_choice auto, a tool's parameters)"
                    if param == "response_format" else "the tools' parameters")
            raise bad_request(f"{what} cannot be enforced: {e}",
                              param="tools" if param == "tool_choice" else param) from None

    @staticmethod
    def _tool_mode(req: ChatCompletionRequest) -> ToolMode:
        tools = req.tools or None
        choice = req.tool_choice
        parallel = req.parallel_tool_calls is not False
        if tools is None:
            if choice not in (None, "none", "auto"):
                raise bad_request("tool_choice requires tools", param="tool_choice")
            return ToolMode(None, False)
        if len({t.function.name for t in tools}) != len(tools):
            raise bad_request("tool names must be unique", param="tools")
        specs = tool_specs(tools)
        if choice == "none":  # still rendered: the prompt stays the one the other steps of the loop share
            return ToolMode(specs, False)
        if choice in (None, "auto"):
            return ToolMode(specs, True, parallel=parallel)
        if choice == "required":
            return ToolMode(specs, True, forced=True, parallel=parallel)
        if choice.function.name not in {t.name for t in specs}:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools",
                              param="tool_choice")
        return ToolMode(specs, True, forced=True, forced_name=choice.function.name, parallel=False)

    @staticmethod
    def _session_id(req: ChatCompletionRequest, raw: Request) -> str | None:
        header = raw.headers.get("x-session-id")
        if header is not None and req.session_id is not None and header != req.session_id:
            raise bad_request("session_id in the body and the X-Session-Id header differ", param="session_id")
        session_id = req.session_id or header
        if session_id is not None and not SESSION_ID.fullmatch(session_id):
            raise bad_request("session_id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", param="session_id")
        return session_id

    def _session_messages(self, session_id: str, messages: list[Message]):
        """Explicit continuation. Messages that start with tool results continue the session's stored
        conversation (which must be paused at tool calls); any other list is the whole conversation."""
        session = self.registry.named(Kind.CHAT, session_id)
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
        return messages, session or self.registry.open_named(Kind.CHAT, session_id)

    def _claim_paused(self, messages: list[Message], prompt_ids: list[int], session: Conversation | None):
        """The paused generation this request continues, if its rendering extends the paused tokens."""
        entry = self.registry.find_for_messages(messages, session)
        if entry is None:
            if session is not None:  # the session moved on: its paused generation is of no further use
                self.registry.release_paused(session, f"session {session.id} continued differently")
            return None
        n = len(entry.token_ids)
        if len(prompt_ids) > n and prompt_ids[:n] == entry.token_ids:
            return self.registry.take(entry)
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
        return self.registry.named(Kind.CHAT, ctx.session_id) if ctx.session_id is not None else None

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
        final = [StreamedCall(i, call.id, call.name, call.arguments) for i, call in enumerate(result.calls)]
        for delta in self._call_deltas(final, sent_calls):
            yield chunk({"tool_calls": [delta]})
        yield chunk({}, finish_reason=result.finish_reason,
                    logprobs=self._logprobs(ctx, last, sent_tokens, len(last.token_ids)),
                    token_ids=list(last.token_ids) if ctx.request.return_token_ids else None)
        if include_usage:
            usage = ChatCompletionChunk(id=ctx.response_id, created=created, model=ctx.request.model, choices=[],
                                        usage=self._usage(ctx, last))
            yield {"data": usage.model_dump_json()}
