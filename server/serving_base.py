"""What both generation endpoints share: admission, sampling parameters, starting or resuming an engine
turn, disconnect handling and logprob formatting."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.requests import Request

from infercept.engine.backend import EngineBackend, InterceptParams, RequestOutput, SamplingParams

from .conversations import Conversation, ConversationStore, Paused
from .metrics import ServerMetrics
from .protocol import APIError, InterceptOptions, SamplingFields, bad_request
from .settings import ServerSettings

logger = logging.getLogger("infercept.server")

# On SIGTERM a turn in flight may finish for this long; then it ends with a 503 in its own stream or
# response (app.py). The SSE library's own cut comes later (STREAM_CUT_S) and uvicorn's graceful
# shutdown timeout, set by `infercept serve`, later still.
SHUTDOWN_GRACE_S = 6.0
STREAM_CUT_S = SHUTDOWN_GRACE_S + 2.0


@dataclass
class EngineTurn:
    """One engine turn being served: a fresh generation or a resumed one."""

    request_id: str  # the engine's request id (a resumed generation keeps its first one)
    prompt_ids: list[int]  # the whole context before this turn's output
    stream: AsyncIterator[RequestOutput]
    first: RequestOutput
    abort: Callable[[str], None]  # the backend's: `close` lets a paused turn nobody kept go
    cached_tokens: int = 0  # prompt tokens whose KV was reused
    resumed: bool = False
    started: float = 0.0  # monotonic time the request arrived
    observe_gap: Callable[[float], None] | None = None  # inter-token latency, per output after the first
    last: RequestOutput | None = None  # the last output handed out
    kept: bool = False  # its pause was handed to the conversation store (`BaseServing.keep_paused`)

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

    async def close(self) -> None:
        """Leave the stream: a turn that has not ended is aborted (frees its blocks), and so is one that
        ended paused but was left before the store kept it (its request cut off in between)."""
        with contextlib.suppress(Exception):
            await self.stream.aclose()
        if self.last is not None and self.last.paused and not self.kept:
            self.abort(self.request_id)


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


class BaseServing:
    endpoint = "base"

    def __init__(self, backend: EngineBackend, settings: ServerSettings, conversations: ConversationStore,
                 metrics: ServerMetrics, model_name: str, admission: Admission, tokenizer):
        self.backend = backend
        info = backend.info
        self.settings = settings
        self.conversations = conversations
        self.metrics = metrics
        self.model_name = model_name
        self.model_aliases = {model_name, info.model, info.model_name}
        self.tokenizer = tokenizer  # the server's own instance: the engine thread decodes with the engine's
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.admission = admission
        self.acquire, self.release = admission.acquire, admission.release

    # -- admission ---------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.model_aliases:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    @staticmethod
    def check_unsupported(req: SamplingFields) -> None:
        if req.n not in (None, 1):
            raise bad_request("only n=1 is supported", param="n")
        if req.frequency_penalty or req.presence_penalty:
            raise bad_request("frequency_penalty and presence_penalty are not supported", param="frequency_penalty")
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")

    def check_prompt(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size})", param=param)
        if len(ids) >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                              f"{len(ids)} tokens.", param=param, code="context_length_exceeded")

    def sampling_params(self, req: SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                        logprobs: int | None, skip_special_tokens: bool = True) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is not None and max_tokens > room:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                              f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                              f"{max_tokens} for the completion).", param="max_tokens",
                              code="context_length_exceeded")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=max(req.top_k or 0, 0), seed=req.seed,
                max_tokens=room if max_tokens is None else max_tokens, min_tokens=req.min_tokens,
                stop=stop, ignore_eos=req.ignore_eos, logprobs=logprobs,
                skip_special_tokens=skip_special_tokens)
        except ValueError as e:
            raise bad_request(str(e)) from None

    # -- engine turns ------------------------------------------------------------------------------
    async def admitted_turn(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                            intercept: InterceptParams | None, claim: Callable[[], Paused | None],
                            started: float, resumed_how: str, release: Callable[[], None] | None = None,
                            ) -> tuple[EngineTurn, Callable[[], Awaitable[None]]]:
        """Admission, then the turn: count the request in (429 / 503 refuse here, before anything is
        claimed), `claim` the paused generation it continues, resume it or start fresh (`open_turn`).
        Returns the turn and its cleanup, which closes the turn (aborting it if unfinished) and then
        calls `release` (default: admission's); `release` also runs if the turn never opens."""
        release = release or self.release
        self.acquire()  # last check that can refuse: from here on a claimed paused generation is resumed
        try:
            turn = await self.open_turn(request_id, prompt_ids, params, intercept, claim(), started)
        except BaseException:
            release()
            raise
        if turn.resumed:
            self.metrics.resumes.labels(self.model_name, resumed_how).inc()

        async def cleanup() -> None:
            await turn.close()
            release()
        return turn, cleanup

    async def open_turn(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                        intercept: InterceptParams | None, entry: Paused | None,
                        started: float) -> EngineTurn:
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
                self.metrics.resume_fallbacks.labels(self.model_name).inc()
                self.backend.abort(entry.request_id)
            else:
                self._observe_ttft(started)
                # Reused: the paused KV on the device or host, or what the prefix cache kept of a discarded one.
                return EngineTurn(entry.request_id, prompt_ids, stream, first, self.backend.abort,
                                  cached_tokens=first.num_cached_tokens, resumed=True, started=started,
                                  observe_gap=self._observe_gap)
        stream = self.backend.generate(prompt_ids, params, request_id, intercept)
        try:
            first = await anext(stream)
        except ValueError as e:
            raise bad_request(str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), headers={"Retry-After": "5"}) from None
        self._observe_ttft(started)
        return EngineTurn(request_id, prompt_ids, stream, first, self.backend.abort,
                          cached_tokens=first.num_cached_tokens, started=started, observe_gap=self._observe_gap)

    def keep_paused(self, turn: EngineTurn, handle: Paused, holder: Conversation | None = None) -> None:
        """The store keeps `turn`'s paused generation (for `holder`, or a new implicit record)."""
        turn.kept = True
        self.conversations.pause(handle, holder)

    def _observe_gap(self, seconds: float) -> None:
        self.metrics.inter_token.labels(self.model_name).observe(seconds)

    def _observe_ttft(self, started: float) -> None:
        """The engine reports a request once it has its first token: that is the time to first token."""
        self.metrics.ttft.labels(self.model_name).observe(max(time.monotonic() - started, 0.0))

    @staticmethod
    def finish_reason(out: RequestOutput) -> str:
        """OpenAI finish reason of a turn that ended without tool calls (a pause on a stop included)."""
        if out.paused:
            return "stop" if out.stop_reason is not None else "length"
        if out.finish_reason == "abort":
            raise APIError(503, "the request was aborted (the server is shutting down)")
        return out.finish_reason or "stop"

    # -- logprobs ----------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def pause_on_stops(options: InterceptOptions | None) -> InterceptParams | None:
    """A token-level request's `intercept` extension: every stop of its turn pauses the generation."""
    if options is None:
        return None
    return InterceptParams(pause_on_stop=True, expected_s=options.expected_s, kind=options.kind)


async def respond(raw: Request, stream: bool, events: Callable[[], AsyncIterator[dict]],
                  body: Callable[[], Awaitable[dict]], cleanup: Callable[[], Awaitable[None]],
                  headers: dict[str, str]) -> Response:
    """How every generation endpoint answers: an SSE stream of `events()` (cleanup once it ends, however
    it ends), or the JSON `body()`, cancelled if the client disconnects first (499), cleanup after."""
    if stream:
        return StreamResponse(events(), cleanup, headers)
    try:
        result = await run_until_disconnect(raw, body())
    finally:
        await cleanup()
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result, headers=headers)


async def openai_sse(chunks: AsyncIterator[dict], what: str) -> AsyncIterator[dict]:
    """An OpenAI-style stream: the chunks, then `[DONE]`; a failure mid-stream becomes one error chunk
    before it (a client never sees a hung or silently cut stream). Closing this closes `chunks`."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:
            yield {"data": json.dumps(e.body())}
        except Exception as e:  # an engine failure mid-stream
            logger.exception("%s failed mid-stream", what)
            yield {"data": json.dumps(APIError(500, f"internal error: {e}").body())}
    yield {"data": "[DONE]"}


async def run_until_disconnect(raw: Request, work: Awaitable):
    """Run `work`; if the client disconnects first, cancel it (its engine stream aborts) and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


class StreamResponse(EventSourceResponse):
    """SSE in OpenAI's framing (`data: ...` lines separated by blank lines), pings every 15 s, and a
    cleanup that runs exactly once when the response ends however it ends: normally, by a client
    disconnect, or cancelled before the stream ever started (the body generator's own `finally` would
    not run then)."""

    def __init__(self, content: AsyncIterator[dict], cleanup: Callable[[], Awaitable[None]], headers: dict):
        super().__init__(content, headers=headers, sep="\n", ping=15, shutdown_grace_period=STREAM_CUT_S)
        self._cleanup = once(cleanup)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def once(fn: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    done = False

    async def run() -> None:
        nonlocal done
        if not done:
            done = True
            await fn()
    return run
