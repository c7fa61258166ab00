"""POST /v1/messages (Anthropic's Messages API) and POST /v1/messages/count_tokens.

A Messages request is a chat turn in another shape (messages_input.py turns it into chat messages), so
rendering, tool-call parsing and pausing are the turn API's: a response that ends in `tool_use` blocks
leaves its generation paused, and the request that repeats the conversation with the `tool_result`
blocks resumes it, as Anthropic's clients and agents (the `anthropic` SDK, Claude Code) send every
turn. `usage.cache_read_input_tokens` counts the input tokens whose KV was reused, `input_tokens` the
rest, as Anthropic counts them.

The answer is a message: its `content` the turn's thinking (a model with a reasoning parser; no
signature), text and `tool_use` blocks, in that order; `stop_reason` `tool_use`, `max_tokens`,
`stop_sequence` (with the sequence) or `end_turn`. Streamed, it is Anthropic's event sequence:
`message_start`, per content block `content_block_start`, its deltas (`thinking_delta`, `text_delta`,
`input_json_delta`: a call's arguments as they are written) and `content_block_stop`, then
`message_delta` (the stop reason and the final usage) and `message_stop`; an error mid-stream is one
`error` event. Errors are Anthropic's JSON (`{"type": "error", "error": {...}}`, app.py).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from .chat import Opening
from .protocol import APIError
from .protocol_messages import CountTokensRequest, MessagesRequest, error_body
from .messages_input import chat_messages, is_prefill, messages_tool_mode
from .serving_base import Frontend, respond
from .tenants import owner_of
from .turns import CallArguments, CallOpened, ReasoningDelta, Sampling, TextDelta, Turn, TurnFinished, TurnSpec

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


class MessagesServing(Frontend):
    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        turn = await self.turns.open(self._spec(req, raw))
        return await respond(raw, req.stream, lambda: self._events(req, turn), lambda: self._full(req, turn),
                             turn.close, {"X-Request-Id": turn.id}, f"message {turn.id}", error=_error_event,
                             done=None)

    async def count_tokens(self, req: CountTokensRequest, raw: Request) -> Response:
        return JSONResponse({"input_tokens": len(self.turns.render_prompt(self._spec(req, raw)))})

    def _spec(self, req: CountTokensRequest, raw: Request) -> TurnSpec:
        self.check_model(req.model)
        mode = messages_tool_mode(req)
        sampling = Sampling()
        if isinstance(req, MessagesRequest):
            sampling = Sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k or None,
                                max_tokens=req.max_tokens, stop=req.stop_sequences or None, cache_salt=req.cache_salt,
                                thinking_token_budget=self._thinking_budget(req))
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.thinking is not None and req.thinking.type == "disabled":
            # thinking off, where the chat template takes the switch (Qwen3's); other templates ignore it
            template_kwargs["enable_thinking"] = False
        answer = req.output_config.format if req.output_config is not None else None
        messages = chat_messages(req)
        opening = Opening.CONTINUE if is_prefill(messages) else Opening.GENERATION_PROMPT
        return TurnSpec("messages", sampling, tuple(messages), mode=mode, owner=owner_of(raw), opening=opening,
                        id_prefix="msg_", template_kwargs=template_kwargs or None,
                        answer_schema=answer.schema_ if answer is not None else None,
                        answer_param="output_config.format")

    def _thinking_budget(self, req: MessagesRequest) -> int | None:
        """Anthropic's `thinking.budget_tokens`, as vLLM maps it: the turn's `thinking_token_budget`. A
        model the server does not read as thinking (no --reasoning-parser) has none to keep to: Anthropic's
        clients send a budget whatever the model, so it is ignored there rather than refused."""
        thinking = req.thinking
        if thinking is None or thinking.type != "enabled" or self.turns.reasoning is None:
            return None
        return thinking.budget_tokens

    # -- the message -------------------------------------------------------------------------------
    def _message(self, req: MessagesRequest, turn: Turn, content: list[dict], end: TurnFinished | None) -> dict:
        stop_reason, stop_sequence = _stop(end) if end is not None else (None, None)
        return {"id": turn.id, "type": "message", "role": "assistant", "model": req.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(turn, end)}

    async def _full(self, req: MessagesRequest, turn: Turn) -> dict:
        end = await turn.result()
        result = end.result
        content = [{"type": "thinking", "thinking": result.reasoning, "signature": ""}] if result.reasoning else []
        if result.content:
            content.append({"type": "text", "text": result.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments_value()}
                    for c in result.calls]
        return self._message(req, turn, content, end)

    # -- streaming ---------------------------------------------------------------------------------
    async def _events(self, req: MessagesRequest, turn: Turn) -> AsyncIterator[dict]:
        blocks = _Blocks()
        yield _event("message_start", message=self._message(req, turn, [], None))
        end = None
        async for e in turn.events():
            if isinstance(e, ReasoningDelta):
                for event in blocks.delta("thinking", {"type": "thinking_delta", "thinking": e.text}):
                    yield event
            elif isinstance(e, TextDelta):
                for event in blocks.delta("text", {"type": "text_delta", "text": e.text}):
                    yield event
            elif isinstance(e, CallOpened):
                for event in blocks.open({"type": "tool_use", "id": e.id, "name": e.name, "input": {}}):
                    yield event
            elif isinstance(e, CallArguments):
                for event in blocks.delta("tool_use", {"type": "input_json_delta", "partial_json": e.delta}):
                    yield event
            elif isinstance(e, TurnFinished):
                end = e
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = _stop(end)
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage=_usage(turn, end))
        yield _event("message_stop")


@dataclass
class _Blocks:
    """The content blocks of a streamed message: the one open, and how many were opened."""

    count: int = 0
    open_kind: str | None = None

    def open(self, block: dict) -> list[dict]:
        events = self.close()
        self.open_kind = block["type"]
        events.append(_event("content_block_start", index=self.count, content_block=block))
        self.count += 1
        return events

    def delta(self, kind: str, delta: dict) -> list[dict]:
        """A delta of a block of `kind`: into the open one, or into a new one (thinking, then text)."""
        events = []
        if self.open_kind != kind:
            start = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""}}[kind]
            events = self.open(start)
        events.append(_event("content_block_delta", index=self.count - 1, delta=delta))
        return events

    def close(self) -> list[dict]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [_event("content_block_stop", index=self.count - 1)]


def _stop(end: TurnFinished) -> tuple[str, str | None]:
    """Anthropic's stop reason of the turn, and the stop sequence that ended it."""
    reason = STOP_REASONS.get(end.result.finish_reason)
    if reason is not None:
        return reason, None
    matched = end.output.stop_reason
    return ("stop_sequence", matched) if isinstance(matched, str) else ("end_turn", None)


def _usage(turn: Turn, end: TurnFinished | None) -> dict:
    """Anthropic's usage: `input_tokens` the prompt tokens computed, `cache_read_input_tokens` those whose
    KV was reused (before the turn ends: the whole prompt as input, none read yet)."""
    if end is None:
        return {"input_tokens": len(turn.prompt_ids), "output_tokens": 0, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0}
    u = end.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def _event(kind: str, **fields) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}


def _error_event(e: APIError) -> dict:
    return {"event": "error", "data": json.dumps(error_body(e))}
