"""Responses run in the background (`background: true`, as OpenAI's and vLLM's Responses APIs take it).

The request is answered at once, with the response `queued`, and its turn goes on without the client:

- `GET /v1/responses/{id}` answers where it stands: `queued`, `in_progress`, then `completed`,
  `incomplete`, `failed` (with its `error`) or `cancelled`; once it ends it is also a stored response
  like any other (a chained request resumes the generation it paused at its calls);
- `GET /v1/responses/{id}?stream=true` streams its events from the first (`&starting_after=N`: after
  sequence number N), those sent already and then the rest as they come, so a client whose stream broke
  takes it up again;
- `POST /v1/responses/{id}/cancel` stops its turn (status `cancelled`); DELETE stops and forgets it;
- a request with `stream: true` too streams it as it runs, and the client leaving does not stop it.

The events are those of a streamed response (serving_responses.py, responses_mcp.py), each kept for the
streams that come later. Kept: every running background response (at most `max_stored_responses`; past
that a new one is a 429) and the last FINISHED_KEPT finished ones (their events and, for those that failed
or were cancelled, which the store does not keep, their last state).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from .protocol import APIError, bad_request

logger = logging.getLogger("infercept.server")

FINISHED_KEPT = 64
RESPONSE_EVENTS = {"response.created", "response.in_progress", "response.completed", "response.incomplete"}


@dataclass
class BackgroundResponse:
    id: str
    owner: str | None
    body: dict = field(default_factory=dict)  # where it stands: the last response object its events carried
    events: list[dict] = field(default_factory=list)  # as streamed: {"event": kind, "data": JSON}
    done: bool = False
    task: asyncio.Task | None = None
    input_items: list[dict] = field(default_factory=list)  # (listed while it runs: it is stored when it ends)
    _grown: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) at each event and the end

    def add(self, event: dict) -> None:
        if event["event"] in RESPONSE_EVENTS:  # (those that carry the response object: where it stands)
            data = json.loads(event["data"])
            if event["event"] == "response.created":  # (a background response is queued before it runs)
                data["response"]["status"] = "queued"
                event = {**event, "data": json.dumps(data, ensure_ascii=False)}
            self.body = data["response"]
        self.events.append(event)
        self._wake()

    def end(self, status: str | None = None, error: dict | None = None) -> None:
        """The turn ended; `status`: how, where its events did not say it (failed, cancelled)."""
        if status is not None and self.body.get("status") not in ("completed", "incomplete"):
            self.body = {**self.body, "status": status, "error": error}
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()

    async def started(self) -> None:
        """Wait for its first event (the response, queued)."""
        while not self.events and not self.done:
            await self._grown.wait()

    async def stream(self, after: int = -1) -> AsyncIterator[dict]:
        """Its events after sequence number `after`, then each new one, until it ends."""
        i = after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await self._grown.wait()


class BackgroundResponses:
    def __init__(self, limit: int):
        self.limit = limit  # running at once (the store's max_stored_responses: each will be stored)
        self._kept: OrderedDict[str, BackgroundResponse] = OrderedDict()  # oldest first

    @staticmethod
    def check(store: bool | None, max_stored: int) -> None:
        if store is False:
            raise bad_request("background responses are stored: send store true (or leave it out)",
                              param="background")
        if max_stored == 0:
            raise bad_request("this server stores no responses (--max-stored-responses 0), so it runs none in "
                              "the background", param="background")

    def start(self, response_id: str, owner: str | None, events: AsyncIterator[dict],
              cleanup: Callable[[], Awaitable[None]], error: Callable[[APIError], dict],
              input_items: list[dict]) -> BackgroundResponse:
        """Run the response's `events` to their end in a task of its own (cleanup after, however it ends)."""
        if sum(not r.done for r in self._kept.values()) >= self.limit:
            raise APIError(429, f"too many background responses running (limit {self.limit})",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        entry = self._kept[response_id] = BackgroundResponse(response_id, owner, input_items=input_items)
        entry.task = asyncio.create_task(self._run(entry, events, cleanup, error))
        return entry

    async def _run(self, entry: BackgroundResponse, events: AsyncIterator[dict],
                   cleanup: Callable[[], Awaitable[None]], error: Callable[[APIError], dict]) -> None:
        status = failure = None
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    entry.add(event)
        except asyncio.CancelledError:
            status = "cancelled"
        except Exception as e:
            if not isinstance(e, APIError):
                logger.exception("background response %s failed", entry.id)
                e = APIError(500, f"internal error: {e}")
            entry.add(error(e))
            status, failure = "failed", {"code": e.code or "server_error", "message": e.message}
        finally:
            await cleanup()
            entry.end(status, failure)
            self._forget_finished()

    def _forget_finished(self) -> None:
        finished = [k for k, r in self._kept.items() if r.done]
        for key in finished[:max(0, len(finished) - FINISHED_KEPT)]:
            del self._kept[key]

    def get(self, response_id: str, owner: str | None) -> BackgroundResponse | None:
        entry = self._kept.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def holds(self, response_id: str) -> bool:
        """Whether any tenant's background response of that id is kept here, running or not (replica
        forwarding: one that failed or was cancelled is nowhere else)."""
        return response_id in self._kept

    async def cancel(self, entry: BackgroundResponse) -> None:
        if entry.task is not None and not entry.done:
            entry.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await entry.task

    async def forget(self, entry: BackgroundResponse) -> None:
        await self.cancel(entry)
        self._kept.pop(entry.id, None)

    async def stop(self) -> None:
        """Server shutdown: every running one cancelled (its turn closed, its generation released)."""
        for entry in list(self._kept.values()):
            await self.cancel(entry)
