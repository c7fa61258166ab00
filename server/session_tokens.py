"""Token-level turns of a native session (`token_ids` messages): the session's context is token ids.

Where a chat session pauses at a parsed tool call, a token-level session pauses where the client says:
a message with `intercept` makes its turn's stop (EOS, a `stop` string, or `max_tokens` - with
`ignore_eos`, exactly that many tokens) an interception, so the generation stays paused in the engine,
and the session's next `token_ids` message (the interception's result) resumes it with only those
tokens to compute. This is
how a benchmark replays a trace through the session API, and how a client with its own prompt format
(its own tokenizer and template) uses sessions.

The session keeps its whole context (every token sent and generated); the paused generation is only
where its KV lives. A message whose paused generation is gone (evicted, expired, or the last post was
cut off) is served fresh from that context, with whatever the prefix cache kept of it.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from pydantic import ValidationError
from starlette.requests import Request

from infercept.engine.backend import RequestOutput

from .conversations import Conversation, Paused, State
from .protocol import CompletionRequest, bad_request, new_id
from .protocol_sessions import SessionMessageRequest
from .serving_base import BaseServing, EngineTurn, logger, pause_on_stops
from .tool_loop import Emit


class TokenTurns:
    def __init__(self, serving: BaseServing):
        self.serving = serving

    @staticmethod
    def check_kind(session: Conversation, req: SessionMessageRequest) -> None:
        """A session is chat-level or token-level for its whole life: 400 on the other kind's message."""
        chat_session = bool(session.spec.system or session.spec.tools or session.messages)
        if req.token_ids is not None and chat_session:
            raise bad_request("token_ids need a token-level session: this one has a system prompt, tools or chat "
                              "messages (post content or tool_results)", param="token_ids")
        if req.token_ids is None and session.token_ids:
            raise bad_request("this session is token-level: post token_ids", param="content")
        if req.token_ids is None and req.ignore_eos:
            raise bad_request("ignore_eos is for token-level messages (token_ids)", param="ignore_eos")

    async def open(self, session: Conversation, req: SessionMessageRequest,
                   raw: Request) -> tuple[EngineTurn, Callable[[], Awaitable[None]]]:
        """Start the message's turn, resuming the session's paused generation if it still has one.
        The returned cleanup must run once the turn is left (it aborts an unfinished turn)."""
        started = time.monotonic()
        serving = self.serving
        context = session.token_ids + req.token_ids
        serving.check_prompt(context, "token_ids")
        sampling = session.spec.turn_sampling(req.sampling())
        try:
            as_completion = CompletionRequest(model=session.spec.model, prompt=context, ignore_eos=req.ignore_eos,
                                              **sampling)
        except ValidationError as e:
            raise bad_request(f"invalid sampling fields: {e.errors()[0]['msg']}") from None
        params = serving.sampling_params(as_completion, len(context), as_completion.max_tokens, None)
        return await serving.admitted_turn(new_id("sess-tok-"), context, params, pause_on_stops(req.intercept),
                                           lambda: serving.conversations.take(session.paused), started, "explicit")

    async def converse(self, session: Conversation, turn: EngineTurn, emit: Emit) -> dict:
        """Serve the turn to its end, emitting `delta`s ({text, token_ids}) as it goes; the session takes
        the turn's tokens into its context and is paused (an interception) or idle."""
        sent_text, sent_tokens, last = "", 0, None
        async for out in turn.outputs():
            last = out
            if len(out.token_ids) > sent_tokens:
                text = out.text if out.text.startswith(sent_text) else sent_text  # never take text back
                emit("delta", {"text": text[len(sent_text):], "token_ids": list(out.token_ids[sent_tokens:])})
                sent_text, sent_tokens = text, len(out.token_ids)
            if out.turn_done:
                break
        finish = self._end(session, turn, last)
        generated = list(last.token_ids)
        session.token_ids = turn.prompt_ids + generated
        session.state = State.PAUSED if last.paused else State.IDLE
        if last.paused:
            emit("paused", {"context_tokens": len(session.token_ids)})
        usage = {"prompt_tokens": len(turn.prompt_ids), "completion_tokens": len(generated),
                 "total_tokens": len(turn.prompt_ids) + len(generated),
                 "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}}
        return {"session_id": session.id, "state": session.state, "text": last.text,
                "token_ids": generated, "finish_reason": finish, "usage": usage}

    def _end(self, session: Conversation, turn: EngineTurn, out: RequestOutput) -> str:
        """Keep a paused generation for the session; count and log the turn; its finish reason."""
        serving = self.serving
        if out.paused:
            serving.keep_paused(turn, Paused(turn.request_id, turn.prompt_ids + list(out.token_ids)), session)
        finish = serving.finish_reason(out)
        serving.metrics.observe_request("sessions", finish, len(turn.prompt_ids), turn.cached_tokens,
                                        len(out.token_ids))
        logger.info("session %s (engine %s%s): prompt %d tokens (%d cached), %d generated, finish %s%s",
                    session.id, turn.request_id, ", resumed" if turn.resumed else "", len(turn.prompt_ids),
                    turn.cached_tokens, len(out.token_ids), finish, ", paused" if out.paused else "")
        return finish
