"""Native sessions under /v1/sessions: create, post a message or tool results, inspect, delete.

A session is a record of the conversation store (`Kind.SESSION`) served turn by turn through the turn
API (turns.py) as the holder of its turns: a turn that ends in tool calls stays paused in the engine,
kept for the session, and the post that brings the results resumes it. Calls of *server tools* (named
at creation, run by the server itself through the `infercept.tools` interface) never leave the server:
when a turn calls only those, the server runs them while the generation waits paused, resumes it with
the results and goes on (`tool_loop.serve_turns`). A session that is sent `token_ids` instead is
token-level: the client decides where it pauses (serving_session_tokens.py).

Errors: 404 for an unknown session, 409 for tool results to a session that is not paused,
or any message while it generates, or a user message while it waits for tool results.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from .chat import Message, tool_specs
from .conversations import Conversation, Kind, SessionSpec, State
from .protocol import APIError, bad_request, new_id, now
from .protocol_sessions import SessionCreateRequest, SessionMessageRequest
from .serving_base import Frontend, respond
from .tenants import owner_of
from .serving_session_tokens import check_kind, converse, token_turn
from .tool_loop import Emit, call_view, events_then_result, resolve_server_tools, serve_turns, wire
from .tool_mode import tool_mode
from .turns import Sampling, Turn, TurnSpec


class SessionServing(Frontend):
    def __init__(self, *args, tool_lookup: Callable[[str], Any], backend, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool_lookup = tool_lookup
        self.backend = backend  # for where a session's KV lives

    # -- create, inspect, delete -------------------------------------------------------------------
    async def create(self, req: SessionCreateRequest, raw: Request) -> Response:
        model = req.model or self.model_name
        self.check_model(model)
        tools = list(req.tools or ())
        if len({t.function.name for t in tools}) != len(tools):
            raise bad_request("tool names must be unique", param="tools")
        server_tools, definitions = resolve_server_tools(req.server_tools, self.tool_lookup, tools, "server_tools")
        tools += definitions
        spec = SessionSpec(model, req.system, tuple(tools), server_tools, req.sampling(), created_at=now())
        session = self.conversations.open_named(Kind.SESSION, new_id("sess_"), owner_of(raw), spec=spec)
        return JSONResponse(self._view(session, kv=None))

    async def retrieve(self, session_id: str, raw: Request) -> Response:
        session = self._get(session_id, raw)
        request_id = session.request_id or (session.paused.request_id if session.paused else None)
        return JSONResponse(self._view(session, kv=await self._kv_location(request_id)))

    async def delete(self, session_id: str, raw: Request) -> Response:
        session = self._get(session_id, raw)
        self.conversations.close(session, reason=f"session {session_id} deleted")  # releases its paused generation
        if session.task is not None and not session.task.done():
            session.task.cancel()  # its turn's cleanup aborts the generation
            await asyncio.wait([session.task])
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})

    async def _kv_location(self, request_id: str | None) -> dict[str, int]:
        if request_id is not None:
            with contextlib.suppress(KeyError):  # the generation ended (or was aborted) meanwhile
                return (await self.backend.kv_location(request_id)).as_dict()
        return {"device": 0, "host": 0, "discarded": 0}

    def _get(self, session_id: str, raw: Request) -> Conversation:
        session = self.conversations.named(Kind.SESSION, session_id, owner_of(raw))
        if session is None:
            raise self._not_found(session_id)
        return session

    @staticmethod
    def _not_found(session_id: str) -> APIError:
        return APIError(404, f"unknown session {session_id!r}", param="session_id", code="session_not_found")

    @staticmethod
    def _view(session: Conversation, kv: dict[str, int] | None) -> dict:
        spec = session.spec
        view = {"id": session.id, "object": "session", "created_at": spec.created_at, "model": spec.model,
                "state": session.state.value, "system": spec.system,
                "tools": [t.function.name for t in spec.tools if t.function.name not in spec.server_tools],
                "server_tools": list(spec.server_tools), "defaults": spec.defaults,
                "messages": [m.wire() for m in session.messages],
                "pending_calls": [call_view(c, spec.server_tools) for c in session.pending_calls]}
        if session.token_ids:
            view["context_tokens"] = len(session.token_ids)  # a token-level session's context so far
        if kv is not None:
            view["kv"] = kv  # context tokens of the session's generation by where their KV lives
        return view

    # -- posting a message -------------------------------------------------------------------------
    async def post(self, session_id: str, req: SessionMessageRequest, raw: Request) -> Response:
        session = self._get(session_id, raw)
        if sum(x is not None for x in (req.content, req.tool_results, req.token_ids)) != 1:
            raise bad_request("give exactly one of content (a user message), tool_results (for a paused session) "
                              "or token_ids (a token-level session)")
        check_kind(session, req)
        if session.state is State.GENERATING:
            raise APIError(409, f"session {session_id!r} is generating a turn", code="session_busy")
        new = None if req.token_ids is not None else self._new_messages(session, req)

        before = session.state
        session.state = State.GENERATING
        try:
            turn = await self.turns.open(token_turn(session, req) if new is None else self._chat_turn(session, new, req))
        except BaseException:
            session.state = before
            raise
        session.request_id = turn.engine.request_id
        events: asyncio.Queue[tuple[str, dict]] = asyncio.Queue()
        emit: Emit = (lambda kind, data: events.put_nowait((kind, data))) if req.stream else (lambda *_: None)
        work = converse(session, turn, emit) if new is None else self._converse(session, turn, emit)
        task = session.task = asyncio.create_task(work)

        async def settle() -> None:
            """The post is over, however it ended: a turn still running (its client is gone) is cancelled,
            which aborts it; a session whose turn did not complete is as it was."""
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
            await turn.close()  # also when the task never got to start (the loop closes the later turns)
            if session.state is State.GENERATING:
                session.state = before
            session.task = session.request_id = None
            self.conversations.touch(session)

        return await respond(raw, req.stream, lambda: self._sse(session, task, events),
                             lambda: self._outcome(session, task), settle, {"X-Session-Id": session_id},
                             f"session {session_id}", error=lambda e: {"event": "error", "data": json.dumps(e.body())},
                             done=None)

    def _new_messages(self, session: Conversation, req: SessionMessageRequest) -> list[Message]:
        """The chat messages a post adds: its tool results (409 unless paused) or its user message (409
        while paused)."""
        if req.tool_results is not None:
            if session.state is not State.PAUSED:
                raise APIError(409, f"session {session.id!r} is not paused at tool calls",
                               param="tool_results", code="session_not_paused")
            self._check_results(session, req)
            return [Message("tool", r.content, tool_call_id=r.tool_call_id) for r in req.tool_results]
        if session.state is State.PAUSED:
            raise APIError(409, f"session {session.id!r} waits for the results of its tool calls "
                           f"({', '.join(c.id for c in session.pending_calls)})", code="session_paused")
        return [Message("user", req.content)]

    @staticmethod
    def _check_results(session: Conversation, req: SessionMessageRequest) -> None:
        """Each result answers a call the session waits for, once (400 naming the result, not the
        rendered conversation's message index)."""
        pending = {c.id for c in session.pending_calls}
        answered: set[str] = set()
        for i, result in enumerate(req.tool_results):
            if result.tool_call_id not in pending or result.tool_call_id in answered:
                raise bad_request(f"tool_results[{i}]: {result.tool_call_id!r} is not a call this session waits for "
                                  f"(or it was answered already); pending: {', '.join(sorted(pending))}",
                                  param=f"tool_results[{i}].tool_call_id")
            answered.add(result.tool_call_id)

    @staticmethod
    def _chat_turn(session: Conversation, new: list[Message], req: SessionMessageRequest) -> TurnSpec:
        """The post's turn: the session's system prompt, conversation and new messages, with its tools."""
        spec = session.spec
        system = (Message("system", spec.system),) if spec.system else ()
        return TurnSpec("chat", Sampling(**spec.turn_sampling(req.sampling())),
                        (*system, *session.messages, *new), mode=tool_mode(tool_specs(spec.tools) or None, None),
                        intercept=req.intercept, holder=session, owner=session.owner, id_prefix="sess-")

    async def _converse(self, session: Conversation, turn: Turn, emit: Emit) -> dict:
        """Serve the post's turns (server-tool rounds included); the session moves on once all are done."""
        def on_turn(opened: Turn) -> None:
            session.request_id = opened.engine.request_id

        server_tools = session.spec.server_tools
        outcome = await serve_turns(self.turns, turn, server_tools, emit, on_turn)
        result = outcome.result
        session.messages = tuple(outcome.messages[1 if session.spec.system else 0:])
        session.state = State.PAUSED if result.calls else State.IDLE
        pending = [call_view(c, server_tools) for c in result.calls]
        if pending:
            emit("paused", {"pending_calls": pending})
        return {"session_id": session.id, "state": session.state.value, "message": result.message.wire(),
                "finish_reason": result.finish_reason, "pending_calls": pending,
                "steps": [asdict(s) for s in outcome.steps], "usage": outcome.usage()}

    # -- answering ---------------------------------------------------------------------------------
    async def _outcome(self, session: Conversation, task: asyncio.Task) -> dict:
        try:
            return await task
        except asyncio.CancelledError:
            if task.cancelled() and session.state is State.CLOSED:
                raise APIError(409, f"session {session.id!r} was deleted while generating",
                               code="session_deleted") from None
            raise

    async def _sse(self, session: Conversation, task: asyncio.Task,
                   events: asyncio.Queue) -> AsyncIterator[dict]:
        """Events as the turns produce them, then `done` with the outcome."""
        async for kind, data in events_then_result(self._outcome(session, task), events):
            yield {"event": kind, "data": json.dumps(wire(data), ensure_ascii=False)}
