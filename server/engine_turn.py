"""The engine side of a turn: admission (requests generating at once), starting or resuming a
generation through the `EngineBackend`, and the stream of its outputs with latency metrics.

`turns.Turns` is the only user: front ends never touch the backend's generate / resume.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from infercept.engine.backend import EngineBackend, InterceptParams, RequestOutput, SamplingParams

from .conversations import Paused
from .metrics import ServerMetrics
from .protocol import APIError, bad_request

logger = logging.getLogger("infercept.server")


class Admission:
    """Requests generating at once, across endpoints."""

    def __init__(self, backend: EngineBackend, limit: int):
        self.backend = backend
        self.limit = limit
        self.in_flight = 0

    def acquire(self) -> None:
        """Count a request in; 503 if the engine is down, 429 over the concurrency limit."""
        if not self.backend.is_running:
            raise APIError(503, "the engine is not running", headers={"Retry-After": "5"})
        if self.in_flight >= self.limit:
            raise APIError(429, f"too many concurrent requests (limit {self.limit})", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


@dataclass
class EngineTurn:
    """One engine turn being served: a fresh generation or a resumed one."""

    request_id: str  # the engine's request id (a resumed generation keeps its first one)
    prompt_ids: list[int]  # the whole context before this turn's output
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput
    abort: Callable[[str], None]  # the backend's: `close` lets a paused turn nobody kept go
    resumed: bool = False
    observe_gap: Callable[[float], None] | None = None  # inter-token latency, per output after the first
    last: RequestOutput | None = None  # the last output handed out
    kept: bool = False  # its pause was handed to the conversation store
    ended: bool = False  # its pause was aborted (`end`)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused, as the engine last reported them for this turn: a backend
        may learn it after the first token (the vLLM backend hears of a resumed turn's prefix-cache hit
        and host load from its scheduler, which may lag the first output)."""
        return (self.last or self.first).num_cached_tokens

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        self.last = self.first
        yield self.first
        if not self.first.turn_done:
            last, num_tokens = time.monotonic(), len(self.first.token_ids)
            try:
                async for out in self.stream:
                    now = time.monotonic()
                    if self.observe_gap is not None and len(out.token_ids) > num_tokens:
                        self.observe_gap((now - last) / (len(out.token_ids) - num_tokens))
                    last, num_tokens = now, len(out.token_ids)
                    self.last = out
                    yield out
            except RuntimeError as e:  # the engine is shutting down (or a step failed)
                raise APIError(503, str(e), headers={"Retry-After": "5"}) from None

    def end(self) -> None:
        """End a turn that ended paused but that nobody will resume (a structured answer), now: its blocks
        are freed as a finished request's are, before its client has the answer."""
        if self.last is not None and self.last.paused and not self.kept and not self.ended:
            self.ended = True
            self.abort(self.request_id)

    async def close(self) -> None:
        """Leave the stream: a turn that has not ended is aborted (frees its blocks), and so is one that
        ended paused but was left before the store kept it (its request cut off in between)."""
        with contextlib.suppress(Exception):
            await self.stream.aclose()
        self.end()


class EngineTurns:
    """Starts and resumes generations, timing their first token and the gaps between tokens."""

    def __init__(self, backend: EngineBackend, metrics: ServerMetrics):
        self.backend = backend
        self.metrics = metrics

    async def open(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                   intercept: InterceptParams | None, entry: Paused | None, started: float) -> EngineTurn:
        """Resume `entry` with the prompt's tokens after its paused context, or start a fresh request.

        A resume that the engine refuses (the generation was aborted meanwhile) falls back to fresh.
        """
        if entry is not None:
            appended = prompt_ids[len(entry.token_ids):]
            try:
                # The new turn's own interception rule (none: it finishes at its stop, not pauses again).
                stream = self.backend.resume(entry.request_id, appended, params, intercept or InterceptParams())
                first = await anext(stream)
            except (KeyError, ValueError) as e:
                logger.info("request %s: resume of %s failed (%s); serving it fresh", request_id, entry.request_id, e)
                self.metrics.resume_fallbacks.labels(self.metrics.model).inc()
                self.backend.abort(entry.request_id)
            else:
                self._observe_ttft(started)
                # Reused: the paused KV on the device or host, or what the prefix cache kept of a discarded one.
                return EngineTurn(entry.request_id, prompt_ids, stream, first, self.backend.abort,
                                  resumed=True, observe_gap=self._observe_gap)
        stream = self.backend.generate(prompt_ids, params, request_id, intercept)
        try:
            first = await anext(stream)
        except ValueError as e:
            raise bad_request(str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), headers={"Retry-After": "5"}) from None
        self._observe_ttft(started)
        return EngineTurn(request_id, prompt_ids, stream, first, self.backend.abort, observe_gap=self._observe_gap)

    def _observe_gap(self, seconds: float) -> None:
        self.metrics.inter_token.labels(self.metrics.model).observe(seconds)

    def _observe_ttft(self, started: float) -> None:
        """The engine reports a request once it has its first token: that is the time to first token."""
        self.metrics.ttft.labels(self.metrics.model).observe(max(time.monotonic() - started, 0.0))
