"""POST /v1/chat/completions with `server_tools` (our extension): tools the server runs itself.

The request's tools are its own plus the named server tools. Each turn is served by the chat path;
while the model calls only server tools, they run here and the paused generation resumes with their
results (`tool_loop.serve_turns`), so one HTTP request covers the whole exchange. The answer is the
last turn, in the usual shape (its client-tool calls as `tool_calls`); `usage` adds up every turn, so
`cached_tokens` counts what each resumed turn reused. The server-tool turns are not in the answer:
to continue after client-tool calls, name a session (`session_id`), which holds the whole conversation.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                       ChatMessage, PromptTokensDetails, Usage, bad_request, now)
from .serving_base import named_id, once, respond
from .serving_chat import ChatServing, headers, session_of, tool_calls
from .tool_loop import LoopOutcome, events_then_result, resolve_server_tools, serve_turns
from .turns import Turn


class ChatServerTools:
    def __init__(self, chat: ChatServing, tool_lookup: Callable[[str], Any]):
        self.chat = chat
        self.tool_lookup = tool_lookup

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        if req.tool_choice not in (None, "auto"):
            # a forced call every turn would call server tools round after round
            raise bad_request("server_tools need tool_choice auto", param="tool_choice")
        if req.prompt_logprobs is not None:  # (each turn would be its own prompt, computed whole: none resumed)
            raise bad_request("prompt_logprobs are not available with server_tools", param="prompt_logprobs")
        client_tools = list(req.tools or ())
        server_tools, definitions = resolve_server_tools(req.server_tools, self.tool_lookup, client_tools,
                                                         "server_tools")
        chat = self.chat
        turn = await chat.open(chat.spec(req.model_copy(update={"tools": client_tools + definitions}), raw))
        current = turn

        def on_turn(opened: Turn) -> None:
            nonlocal current
            current = opened

        async def cleanup() -> None:  # whichever turn the loop is in when the request ends; then the session
            await current.close()
            await chat.close(turn)

        events: asyncio.Queue[tuple[str, dict]] = asyncio.Queue()
        emit = (lambda kind, data: events.put_nowait((kind, data))) if req.stream else (lambda *_: None)

        async def work() -> LoopOutcome:
            outcome = await serve_turns(chat.turns, turn, server_tools, emit, on_turn)
            chat.remember(turn, tuple(outcome.messages))
            return outcome

        loop = work()
        response_id = named_id(raw, req.request_id, "chatcmpl-") or turn.id
        return await respond(raw, req.stream, lambda: self._stream(req, response_id, turn, loop, events),
                             lambda: self._full(req, response_id, turn, loop), once(cleanup),
                             headers(turn, response_id), f"request {response_id}")

    async def _full(self, req: ChatCompletionRequest, response_id: str, turn: Turn, work) -> dict:
        outcome = await work
        result, last = outcome.result, outcome.last
        response = ChatCompletionResponse(
            id=response_id, model=req.model, usage=_usage(outcome), session_id=session_of(turn),
            choices=[ChatChoice(message=ChatMessage(content=result.content, tool_calls=tool_calls(result.calls),
                                                    reasoning_content=result.reasoning),
                                logprobs=self.chat.choice_logprobs(req, last, 0, len(last.token_ids)),
                                finish_reason=result.finish_reason)])
        choice = {"token_ids": True} | ({"message": {"reasoning_content"}} if result.reasoning is None else {})
        exclude = {"prompt_token_ids": True, "choices": {0: choice}} | (
            {"session_id": True} if session_of(turn) is None else {})
        return response.model_dump(mode="json", exclude=exclude)

    async def _stream(self, req: ChatCompletionRequest, response_id: str, turn: Turn, work,
                      events: asyncio.Queue) -> AsyncIterator[dict]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: dict, finish_reason: str | None = None, logprobs=None) -> dict:
            c = ChatCompletionChunk(id=response_id, created=created, model=req.model,
                                    choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                                             logprobs=logprobs)])
            return {"data": c.model_dump_json(exclude={"usage": True, "choices": {0: {"token_ids"}}})}

        yield chunk({"role": "assistant", "content": "", "refusal": None})
        outcome: LoopOutcome | None = None
        async for kind, data in events_then_result(work, events):
            if kind == "delta":  # (with its tokens' logprobs, where asked for: those of the text it carries)
                yield chunk({"content": data["content"]},
                            logprobs=self.chat.choice_logprobs(req, *data["tokens"]))
            elif kind == "done":
                outcome = data
        for i, call in enumerate(outcome.result.calls):
            yield chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": call.arguments}}]})
        yield chunk({}, finish_reason=outcome.result.finish_reason)
        if include_usage:
            usage = ChatCompletionChunk(id=response_id, created=created, model=req.model, choices=[],
                                        usage=_usage(outcome))
            yield {"data": usage.model_dump_json()}


def _usage(outcome: LoopOutcome) -> Usage:
    u = outcome.usage()
    return Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                 total_tokens=u["total_tokens"],
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=u["prompt_tokens_details"]["cached_tokens"]))
