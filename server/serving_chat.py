"""POST /v1/chat/completions: the request as a `TurnSpec` (turns.py), the turn's events as a chat
completion (JSON or SSE chunks).

A turn that ends in tool calls stays paused in the engine and is kept (`ConversationStore`): the
request that brings the tool results resumes it, with only the tokens a fresh rendering adds after the
paused context (the tool results and the next generation prompt) to compute.

Tool calls are never reported broken, and they are decided once, by the engine (its tool format,
engine/tool_format.py): a call counts when it parses, names a tool of the request and its arguments
validate against that tool's schema; anything else is content. The engine pauses only on calls that
all count; the turn renders its verdict (`RequestOutput.tool_calls` / `.content`). With
`tool_choice` "required" or a named function (Hermes format), the turn is grammar-constrained
(engine/guided_decoding.py): it can only be calls of the allowed tools whose arguments follow their
schemas, so streams send each call's arguments token by token as they are generated. With "auto" the
model writes freely, so auto-mode streams send calls only once the engine has judged them, whole.

With `--reasoning-parser`, a thinking model's `<think>...</think>` is `message.reasoning_content`
(`delta.reasoning_content` in streams, before the content) and calls are read after it only.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator

from fastapi.responses import Response
from starlette.requests import Request

from infercept.engine.backend import RequestOutput

from .chat import Message, Opening, normalize_messages, tool_specs
from .conversations import Conversation, Kind, State
from .protocol import (APIError, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatMessage, ChoiceLogprobs, CompletionTokensDetails, FunctionCall,
                       PromptTokensDetails, ToolCall, Usage, bad_request, new_id, now)
from .serving_base import Frontend, check_n, close_all, merged_events, named_id, once, respond, samples
from .structured import check_without_calls, output_constraint
from .tenants import owner_of
from .tool_mode import tool_mode
from .turns import (CallArguments, CallOpened, PromptTruncation, ReasoningDelta, Sampling, TextDelta, Turn,
                    TurnFinished, TurnResult, TurnSpec, TurnUsage)

SESSION_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def unmatched_ids(vocab_size: int, n: int = 16) -> list[int]:
    """n random token ids, a prompt that shares at most its first id with any other, by chance. Fresh
    each time: the router remembers the ids of the replica it sends a request to, an answer like this one
    too when no replica holds the session, and a fixed answer would then match there in full."""
    return random.sample(range(vocab_size), n)


class ChatServing(Frontend):
    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        spec = self.spec(req, raw)
        # A client's id names the response only: several requests may name one, and engine requests' ids differ
        named = named_id(raw, req.request_id, "chatcmpl-")
        if (req.n or 1) == 1:
            turn = await self.open(spec)
            response_id = named or turn.id
            turns, cleanup, names = [turn], lambda: self.close(turn), headers(turn, response_id)
        else:  # n samples of a turn that cannot pause (`spec` checked it): n turns admitted as one request
            response_id = named or new_id("chatcmpl-")
            turns, release = await self.turns.open_batch(samples(spec, req.n, new_id("chatcmpl-") if named
                                                                 else response_id))
            cleanup, names = once(lambda: close_all(turns, release)), {"X-Request-Id": response_id}
        return await respond(raw, req.stream, lambda: self._stream(req, response_id, turns),
                             lambda: self._full(req, response_id, turns), cleanup, names, f"request {response_id}")

    def render(self, req: ChatCompletionRequest, raw: Request) -> dict:
        """vLLM's render answer (`POST /v1/chat/completions/render`): the prompt token ids `req` would be
        served with (its session's conversation first, for a `session_id` request that continues one),
        nothing run or stored. A router that routes by token prefix (vllm-router's cache_aware) sends a
        resume to the replica that served the turn it extends.

        Tool results for a session this replica does not hold render to `unmatched_ids`, not to the 404
        the request itself gets: vllm-router drops the prefix match of a request when any replica's
        render fails (or has no ids) and balances it by load, so the continuation would find the replica
        that holds its session only by chance. Ids that match nothing here let that replica's rendering,
        which extends the paused turn's, win the match."""
        try:
            spec = self.spec(req, raw, peek=True)
        except APIError as e:
            if e.code != "session_not_found":
                raise
            return {"request_id": new_id("chatcmpl-"), "token_ids": unmatched_ids(len(self.tokenizer))}
        return {"request_id": new_id("chatcmpl-"), "token_ids": self.turns.render_prompt(spec)}

    def spec(self, req: ChatCompletionRequest, raw: Request, peek: bool = False) -> TurnSpec:
        """The turn `req` asks for (400 / 404 / 409 on bad requests); with a `session_id`, its session's.
        peek: only to render its prompt: a named session is read, not opened or checked for a turn."""
        self.check_model(req.model)
        choice = req.tool_choice if req.tool_choice is None or isinstance(req.tool_choice, str) \
            else req.tool_choice.function.name
        mode = tool_mode(tool_specs(req.tools) if req.tools else None, choice, req.parallel_tool_calls is not False)
        constraint = output_constraint(req)
        check_without_calls(constraint, mode.parse, "response_format" if req.response_format is not None
                            and req.response_format.type != "text" else None)
        session_id = session_id_of(req, raw)
        check_n(req.n, "this one may end in tool calls and pause there (send tool_choice none, or no tools)"
                if mode.parse else "a session keeps one conversation" if session_id is not None else None)
        owner = owner_of(raw)
        messages = normalize_messages(req.messages, validate=False)
        session = None
        if session_id is not None:
            messages, session = self._session_messages(session_id, messages, owner, peek)
        if not req.tools and choice in (None, "none"):
            kept = self.conversations.tools_to_resume(messages, session, owner)
            if kept:  # (--resume-without-tools) the paused prompt's tools, none of them callable
                mode = tool_mode(list(kept), "none")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        opening = (Opening.CONTINUE if req.continue_final_message else
                   Opening.GENERATION_PROMPT if req.add_generation_prompt else Opening.NONE)
        if opening is not Opening.GENERATION_PROMPT and session_id is not None:
            raise bad_request("a session's turns open with the generation prompt: send add_generation_prompt "
                              "and continue_final_message without session_id", param="session_id")
        return TurnSpec("chat", Sampling.of(req, req.max_completion_tokens or req.max_tokens, logprobs,
                                            req.prompt_logprobs),
                        tuple(messages), mode=mode, intercept=req.intercept, holder=session, owner=owner,
                        answer_schema=req.response_format.answer_schema() if req.response_format else None,
                        constraint=constraint, template_kwargs=req.chat_template_kwargs or None, opening=opening,
                        truncation=PromptTruncation.of(req.truncate_prompt_tokens, req.truncation_side))

    def _session_messages(self, session_id: str, messages: list[Message], owner: str | None,
                          peek: bool = False) -> tuple[list[Message], Conversation | None]:
        """Explicit continuation. Messages that start with tool results continue the session's stored
        conversation (which must be paused at tool calls); any other list is the whole conversation.
        peek: the messages only (no session opened, none returned, its state not checked)."""
        session = self.conversations.named(Kind.CHAT, session_id, owner)
        if not peek and session is not None and session.state is State.GENERATING:
            raise APIError(409, f"session {session_id!r} has a request in flight", param="session_id",
                           code="session_busy")
        if messages[0].role == "tool":
            if session is None:
                raise APIError(404, f"unknown session {session_id!r}", param="session_id", code="session_not_found")
            if not peek and session.paused is None:
                raise APIError(409, f"session {session_id!r} is not paused at a tool call", param="session_id",
                               code="session_not_paused")
            messages = list(session.messages) + messages
        if peek:
            return messages, None
        return messages, session or self.conversations.open_named(Kind.CHAT, session_id, owner)

    @staticmethod
    def remember(turn: Turn, messages: tuple[Message, ...]) -> None:
        """A chat session's conversation, once its turn ended."""
        if turn.spec.holder is not None:
            turn.spec.holder.messages = messages

    def choice_logprobs(self, req: ChatCompletionRequest, out, start: int, end: int) -> ChoiceLogprobs | None:
        """Logprobs of this turn's tokens [start, end) (the engine keeps every turn's; ours are the tail)."""
        if not req.logprobs or out.logprobs is None or start >= end:
            return None
        return ChoiceLogprobs(content=self.token_logprobs(out, start, end, req.top_logprobs or 0,
                                                          req.return_tokens_as_token_ids))

    # -- non-streaming -----------------------------------------------------------------------------
    async def _full(self, req: ChatCompletionRequest, response_id: str, turns: list[Turn]) -> dict:
        ends = await asyncio.gather(*(turn.result() for turn in turns))
        first = turns[0]
        response = ChatCompletionResponse(
            id=response_id, model=req.model, choices=[], usage=usage_of([end.usage for end in ends]),
            prompt_token_ids=list(first.prompt_ids) if req.return_token_ids else None, session_id=session_of(first))
        body = response.model_dump(mode="json")
        for key in ("prompt_token_ids", "session_id"):
            if body[key] is None:
                del body[key]
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(ends[0].output)
        body["choices"] = [self._choice(req, turn, end, i) for i, (turn, end) in enumerate(zip(turns, ends))]
        return body

    def _choice(self, req: ChatCompletionRequest, turn: Turn, end: TurnFinished, index: int) -> dict:
        result, last = end.result, end.output
        self.remember(turn, turn.spec.messages + (result.message,))
        message = ChatMessage(content=result.content, tool_calls=tool_calls(result.calls),
                              reasoning_content=result.reasoning if req.include_reasoning else None)
        choice = ChatChoice(index=index, message=message,
                            logprobs=self.choice_logprobs(req, last, 0, len(last.token_ids)),
                            finish_reason=result.finish_reason, stop_reason=self._stop_reason(result, last),
                            token_ids=list(last.token_ids) if req.return_token_ids else None)
        body = choice.model_dump(mode="json")
        if body["token_ids"] is None:
            del body["token_ids"]
        if message.reasoning_content is None:
            del body["message"]["reasoning_content"]
        return body

    def _stop_reason(self, result: TurnResult, last: RequestOutput) -> str | int | None:
        """A choice's `stop_reason`: a turn that ended in tool calls names none."""
        return None if result.finish_reason == "tool_calls" else self.stop_reason(last)

    # -- streaming ---------------------------------------------------------------------------------
    async def _stream(self, req: ChatCompletionRequest, response_id: str, turns: list[Turn]) -> AsyncIterator[dict]:
        """Each turn's chunks carry its choice index; with n > 1 the samples' chunks interleave as they are
        generated (as OpenAI's do), and the usage chunk, if asked for, counts all of them, after the last."""
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None, token_ids=None,
                  stop_reason=None) -> dict:
            c = ChatCompletionChunk(id=response_id, created=created, model=req.model,
                                    choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                             finish_reason=finish_reason, stop_reason=stop_reason,
                                                             token_ids=token_ids)])
            body = c.model_dump(mode="json", exclude={"usage"} if not include_usage else None)
            if token_ids is None:
                del body["choices"][0]["token_ids"]
            if finish_reason is None:  # (only the chunk that ends a choice has vLLM's stop_reason)
                del body["choices"][0]["stop_reason"]
            return {"data": json.dumps(body, ensure_ascii=False)}

        sent_tokens = [0] * len(turns)  # of each turn: tokens whose logprobs were sent
        ends: list[TurnUsage] = []
        for i in range(len(turns)):
            yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
        async for i, event in merged_events(turns):
            if isinstance(event, ReasoningDelta):
                if req.include_reasoning:
                    yield chunk(i, {"reasoning_content": event.text})
            elif isinstance(event, TextDelta):
                out = event.output
                lp = self.choice_logprobs(req, out, sent_tokens[i], len(out.token_ids))
                sent_tokens[i] = len(out.token_ids)
                yield chunk(i, {"content": event.text}, logprobs=lp)
            elif isinstance(event, CallOpened | CallArguments):
                yield chunk(i, {"tool_calls": [call_delta(event)]})
            elif isinstance(event, TurnFinished):
                last = event.output
                self.remember(turns[i], turns[i].spec.messages + (event.result.message,))
                ends.append(event.usage)
                yield chunk(i, {}, finish_reason=event.result.finish_reason,
                            stop_reason=self._stop_reason(event.result, last),
                            logprobs=self.choice_logprobs(req, last, sent_tokens[i], len(last.token_ids)),
                            token_ids=list(last.token_ids) if req.return_token_ids else None)
        if include_usage:
            yield {"data": ChatCompletionChunk(id=response_id, created=created, model=req.model, choices=[],
                                               usage=usage_of(ends)).model_dump_json()}


# -- wire pieces (the server-tool front end shares them) ---------------------------------------------

def headers(turn: Turn, response_id: str | None = None) -> dict[str, str]:
    """The response headers that name the request (`response_id`, else the turn's id) and its session."""
    session = session_of(turn)
    return {"X-Request-Id": response_id or turn.id} | ({"X-Session-Id": session} if session else {})


def session_of(turn: Turn) -> str | None:
    return turn.spec.holder.id if turn.spec.holder is not None else None


def tool_calls(calls) -> list[ToolCall] | None:
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None


def call_delta(event: CallOpened | CallArguments) -> dict:
    """An OpenAI tool-call delta: a call's first has its id, type, name and empty arguments; the next add arguments."""
    if isinstance(event, CallOpened):
        return {"index": event.index, "id": event.id, "type": "function",
                "function": {"name": event.name, "arguments": ""}}
    return {"index": event.index, "function": {"arguments": event.delta}}


def usage_of(samples: list[TurnUsage]) -> Usage:
    """The usage of n samples of one prompt: the prompt counted once (as OpenAI does), every sample's
    completion tokens."""
    first = samples[0]
    thinking = [u.reasoning_tokens for u in samples if u.reasoning_tokens is not None]
    return usage(TurnUsage(first.prompt_tokens, first.cached_tokens, sum(u.completion_tokens for u in samples),
                           sum(thinking) if thinking else None))


def usage(u: TurnUsage) -> Usage:
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                 total_tokens=u.prompt_tokens + u.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
                 completion_tokens_details=None if u.reasoning_tokens is None else
                 CompletionTokensDetails(reasoning_tokens=u.reasoning_tokens))


def session_id_of(req: ChatCompletionRequest, raw: Request) -> str | None:
    """The session the request names (body `session_id` or the X-Session-Id header), checked."""
    header = raw.headers.get("x-session-id")
    if header is not None and req.session_id is not None and header != req.session_id:
        raise bad_request("session_id in the body and the X-Session-Id header differ", param="session_id")
    session_id = req.session_id or header
    if session_id is not None and not SESSION_ID.fullmatch(session_id):
        raise bad_request("session_id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", param="session_id")
    return session_id
