"""Stored responses (`store: true`), for `previous_response_id` and `GET /v1/responses/{id}`.

A stored response keeps its JSON body and the conversation it closes (every input message of the chain
so far plus its own assistant turn), so a chained request continues it without resending anything.
Bounded in count (the oldest goes first) and in age (a TTL counted from creation). Pure bookkeeping on
the event loop: the generation a response paused is owned by the `SessionRegistry`, not by this store.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .chat import Message


@dataclass
class StoredResponse:
    body: dict  # the response object as returned
    conversation: tuple[Message, ...]  # input messages of the whole chain + this response's turn
    request_id: str | None = None  # the engine request paused at this response's function calls
    call_ids: tuple[str, ...] = ()  # those calls (a later response of the chain may re-pause the request)
    created: float = field(default_factory=time.monotonic)


class ResponseStore:
    def __init__(self, ttl: float, max_responses: int, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.max_responses = max_responses
        self.clock = clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._responses)

    def add(self, response_id: str, stored: StoredResponse) -> None:
        stored.created = self.clock()
        self._responses[response_id] = stored
        self.expire()
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self.expire()
        return self._responses.get(response_id)

    def pop(self, response_id: str) -> StoredResponse | None:
        self.expire()
        return self._responses.pop(response_id, None)

    def expire(self) -> None:
        """Forget responses older than the TTL (insertion order is age order)."""
        now = self.clock()
        while self._responses:
            oldest = next(iter(self._responses.values()))
            if now - oldest.created <= self.ttl:
                break
            self._responses.popitem(last=False)
