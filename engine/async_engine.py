"""Asyncio front of the engine, for the server.

The engine runs in one dedicated thread that loops on `Engine.step()`; the forward pass releases the
GIL inside torch, so the event loop stays responsive. Callers never touch the engine directly: they
post commands to the engine thread (add, abort), which runs them between steps, and outputs flow
back to per-request asyncio queues through `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from .engine import Engine
from .outputs import RequestOutput
from .request import InterceptParams
from .sampling_params import SamplingParams

logger = logging.getLogger("infercept.engine")

IDLE_POLL_S = 1.0  # the longest the idle engine thread sleeps without a command


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        # Touched by both threads (the event loop registers and aborts, the engine thread delivers and
        # retires), so every access holds the lock: an abort between the engine thread's lookup and its
        # removal of a stream must not crash the engine thread.
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self._running = False
        self._died: BaseException | None = None  # what killed the engine thread, if anything did
        self._thread = threading.Thread(target=self._loop, name="infercept-engine", daemon=True)

    @classmethod
    def from_args(cls, model: str | None = None, **engine_kwargs) -> "AsyncEngine":
        return cls(Engine(model, **engine_kwargs))

    @property
    def is_running(self) -> bool:
        return self._running and self._died is None

    @property
    def failed(self) -> bool:
        """The engine thread died of an error (not a shutdown): nothing will be served any more."""
        return self._died is not None

    def start(self) -> None:
        if not self._running:
            self._running = True
            self._thread.start()

    def shutdown(self) -> None:
        """Abort everything in flight and stop the engine thread."""
        if not self._running:
            return
        self._call(self._abort_all)
        self._running = False
        self._wake.set()
        self._thread.join(timeout=30)

    # -- public API (event-loop side) -------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None,
                       intercept: InterceptParams | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request until its turn ends (finished, or paused at an
        interception). Leaving the iteration early (a client disconnect, a cancelled task) aborts the
        request and frees its blocks."""
        request_id = request_id or f"areq-{next(self._ids)}"
        params = params or SamplingParams()
        async for out in self._stream(request_id, lambda: self.engine.add_request(
                prompt, params, request_id, intercept=intercept)):
            yield out

    async def resume(self, request_id: str, appended: str | list[int], params: SamplingParams | None = None,
                     intercept: InterceptParams | None = None) -> AsyncIterator[RequestOutput]:
        """Continue a paused request with its interception's result; streams the next turn. The result's
        arrival is timed here, not when the engine thread gets to it after its step in flight."""
        result_at = self.engine.scheduler.clock()
        async for out in self._stream(request_id,
                                      lambda: self.engine.resume(request_id, appended, params, intercept, result_at)):
            yield out

    async def _stream(self, request_id: str, command: Callable[[], object]) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:  # the same lock the dying engine thread takes: no stream is left behind
            if not self.is_running:
                raise RuntimeError("the engine is not running")
            self._streams[request_id] = stream

        def run_command() -> None:
            try:
                command()
            except Exception as e:  # bad input: report to the caller, not the engine thread
                self._retire(request_id)
                stream.put(e)

        self._call(run_command)
        turn_done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    turn_done = True
                    raise item
                turn_done = item.turn_done
                yield item
                if turn_done:
                    return
        finally:
            if not turn_done:
                self.abort(request_id)

    def call(self, function: Callable[[], object]) -> "asyncio.Future":
        """Run `function` on the engine thread between steps (e.g. to read kv_location safely)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = function()
            except Exception as e:
                loop.call_soon_threadsafe(future.set_exception, e)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._call(run)
        return future

    def abort(self, request_id: str) -> None:
        self._retire(request_id)
        self._call(lambda: self.engine.abort(request_id))

    def cancel_in_flight(self, reason: str) -> None:
        """End every stream in flight with RuntimeError(reason) (aborting its request); paused
        requests, which have no stream, stay."""
        self._call(lambda: self._fail_all(RuntimeError(reason)))

    def _retire(self, request_id: str) -> "_Stream | None":
        """Stop delivering outputs of `request_id`; returns its stream if it had one."""
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        """Abort every request in flight and hand `error` to its caller."""
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.engine.abort(request_id)
            stream.put(error)

    # -- engine thread ----------------------------------------------------------------------------
    def _call(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _abort_all(self) -> None:
        self._fail_all(RuntimeError("the server is shutting down"))

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug outside a step: the engine is gone, say so (is_running, failed)
            logger.critical("the engine thread died", exc_info=True)
            with self._streams_lock:
                self._died = e
                streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.put(RuntimeError("the engine stopped after an internal error"))

    def _serve(self) -> None:
        while self._running:
            while not self._commands.empty():
                self._commands.get()()
            if not self.engine.has_unfinished_requests():
                # Sleep until a command, or until a paused request's host KV may be due back.
                wake = self.engine.idle_wake_s()
                self._wake.wait(timeout=IDLE_POLL_S if wake is None else min(wake, IDLE_POLL_S))
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug must not take the server down: fail what was in flight
                logger.exception("engine step failed; aborting in-flight requests")
                self._fail_all(e)
                continue
            for out in outputs:
                with self._streams_lock:
                    stream = self._streams.pop(out.request_id, None) if out.turn_done else \
                        self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
