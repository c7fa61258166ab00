"""The native sessions' state (`/v1/sessions`): one record per session, bounded in count and idle time.

A session holds its conversation and whether it is idle, generating a turn, or paused at tool calls
waiting for their results. The paused generation itself is the `SessionRegistry`'s (found by the session
id, as explicit chat continuations are); this store only keeps the conversation. Pure bookkeeping on
the event loop: expiring or evicting returns the sessions and the caller releases their generations.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .chat import Call, Message
from .protocol import APIError, ToolParam

SessionState = Literal["idle", "generating", "paused"]


@dataclass
class NativeSession:
    session_id: str
    model: str
    system: str | None
    tools: tuple[ToolParam, ...]  # rendered into every prompt: the client's tools and the server's
    server_tools: dict[str, Any]  # name -> the tool object the server runs (infercept.tools interface)
    defaults: dict[str, Any]  # sampling defaults (protocol_sessions.SamplingDefaults)
    created_at: int
    messages: list[Message] = field(default_factory=list)  # the conversation after the system prompt
    token_ids: list[int] = field(default_factory=list)  # a token-level session's whole context
    state: SessionState = "idle"
    request_id: str | None = None  # the engine request generating now
    task: asyncio.Task | None = None  # the turn in flight (deleting the session cancels it)
    last_used: float = field(default_factory=time.monotonic)

    def turn_sampling(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """A turn's sampling fields: the session's defaults, overridden by the message's (None = unset)."""
        merged = {k: v for k, v in self.defaults.items() if v is not None}
        merged.update({k: v for k, v in overrides.items() if v is not None})
        return merged

    @property
    def pending_calls(self) -> tuple[Call, ...]:
        """The calls a paused chat session waits for."""
        if self.state != "paused" or not self.messages:
            return ()
        return self.messages[-1].tool_calls


class NativeSessionStore:
    def __init__(self, ttl: float, max_sessions: int, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: OrderedDict[str, NativeSession] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def add(self, session: NativeSession) -> list[NativeSession]:
        """Keep `session`; returns the sessions evicted to make room (least recently used, never one
        that is generating). 429 when every session is generating."""
        evicted = []
        while len(self._sessions) >= self.max_sessions:
            victim = next((s for s in self._sessions.values() if s.state != "generating"), None)
            if victim is None:
                raise APIError(429, f"too many sessions generating (limit {self.max_sessions})",
                               code="rate_limit_exceeded", headers={"Retry-After": "1"})
            evicted.append(self._sessions.pop(victim.session_id))
        session.last_used = self.clock()
        self._sessions[session.session_id] = session
        return evicted

    def get(self, session_id: str) -> NativeSession | None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.last_used = self.clock()
            self._sessions.move_to_end(session_id)
        return session

    def pop(self, session_id: str) -> NativeSession | None:
        return self._sessions.pop(session_id, None)

    def expire(self) -> list[NativeSession]:
        """Forget sessions unused for longer than the TTL (not while generating); returns them."""
        now = self.clock()
        expired = [s for s in self._sessions.values() if s.state != "generating" and now - s.last_used > self.ttl]
        for s in expired:
            del self._sessions[s.session_id]
        return expired
