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

from .conversations import Conversation, State
from .protocol import bad_request
from .protocol_sessions import SessionMessageRequest
from .tool_loop import Emit
from .turns import Sampling, TextDelta, Turn, TurnFinished, TurnSpec


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


def token_turn(session: Conversation, req: SessionMessageRequest) -> TurnSpec:
    """The message's turn: the session's context and the message's tokens; it resumes the session's paused
    generation if it still has one."""
    sampling = Sampling(**session.spec.turn_sampling(req.sampling()), ignore_eos=req.ignore_eos)
    return TurnSpec("sessions", sampling, prompt_ids=(*session.token_ids, *req.token_ids), intercept=req.intercept,
                    holder=session, owner=session.owner, id_prefix="sess-tok-", param="token_ids")


async def converse(session: Conversation, turn: Turn, emit: Emit) -> dict:
    """Serve the turn to its end, emitting `delta`s ({text, token_ids}) as it goes; the session takes the
    turn's tokens into its context and is paused (an interception) or idle."""
    sent_tokens, end = 0, None
    async for event in turn.events():
        if isinstance(event, TextDelta):
            emit("delta", {"text": event.text, "token_ids": list(event.output.token_ids[sent_tokens:])})
            sent_tokens = len(event.output.token_ids)
        elif isinstance(event, TurnFinished):
            end = event
    last = end.output
    generated = list(last.token_ids)
    session.token_ids = turn.prompt_ids + generated
    session.state = State.PAUSED if last.paused else State.IDLE
    if last.paused:
        emit("paused", {"context_tokens": len(session.token_ids)})
    u = end.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "total_tokens": u.prompt_tokens + u.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    return {"session_id": session.id, "state": session.state, "text": last.text,
            "token_ids": generated, "finish_reason": end.result.finish_reason, "usage": usage}
