"""What every front end shares: its wire checks (`Frontend`), and how it answers (`respond`: an SSE
stream with one error tail, or JSON cancelled on a client disconnect)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace

from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.requests import Request

from infercept.engine.backend import RequestOutput

from .conversations import State
from .protocol import APIError, TokenLogprob, TopLogprob, bad_request
from .turns import Turn, TurnEvent, Turns, TurnSpec

logger = logging.getLogger("infercept.server")

# On SIGTERM a turn in flight may finish for this long; then it ends with a 503 in its own stream or
# response (app.py). The SSE library's own cut comes later (STREAM_CUT_S) and uvicorn's graceful
# shutdown timeout, set by `infercept serve`, later still.
SHUTDOWN_GRACE_S = 6.0
STREAM_CUT_S = SHUTDOWN_GRACE_S + 2.0


class Frontend:
    """What every front end checks of its wire request before it builds a turn."""

    def __init__(self, turns: Turns, model_name: str, model_aliases: set[str], tokenizer,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.turns = turns
        self.conversations = turns.conversations
        self.model_name = model_name
        self.model_aliases = model_aliases
        self.tokenizer = tokenizer  # the server's own instance: the engine thread decodes with the engine's
        self.eos_token_ids = eos_token_ids  # a stop at one of these reports no stop_reason

    async def open(self, spec: TurnSpec) -> Turn:
        """Open the turn; the named record it continues (a chat session, a conversation), if any, is
        generating until `close`: one request at a time in it."""
        held = spec.holder
        if held is not None:
            held.state = State.GENERATING
        try:
            return await self.turns.open(spec)
        except BaseException:
            self.conversations.settle(held)
            raise

    async def close(self, turn: Turn) -> None:
        await turn.close()
        self.conversations.settle(turn.spec.holder)

    def check_model(self, name: str) -> None:
        if name not in self.model_aliases:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def stop_reason(self, out: RequestOutput) -> str | int | None:
        """vLLM's `stop_reason`: the stop string or stop token that ended the output; None at EOS or the
        length limit."""
        return None if isinstance(out.stop_reason, int) and out.stop_reason in self.eos_token_ids else out.stop_reason

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_label(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs name it: its text, or with vLLM's `return_tokens_as_token_ids` "token_id:<id>"
        (which names exactly a token whose text alone is not valid UTF-8, or is another token's too)."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def token_logprobs(self, out: RequestOutput, start: int, end: int, top: int,
                       as_ids: bool = False) -> list[TokenLogprob]:
        """Logprobs of the turn's output tokens [start, end), each with its `top` most likely alternatives
        (the engine keeps every turn's of a resumed generation: this turn's are the tail); `as_ids`: each
        token named by its id (`token_label`)."""
        if out.logprobs is None:
            return []
        def alternative(token_id: int, logprob: float) -> TopLogprob:
            text = self.token_label(token_id, as_ids)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        offset = len(out.logprobs) - len(out.token_ids)
        entries = []
        for sampled in out.logprobs[offset + start:offset + end]:
            text = self.token_label(sampled.token_id, as_ids)
            alternatives = [alternative(t, lp) for t, lp in list((sampled.top_logprobs or {}).items())[:top]]
            entries.append(TokenLogprob(token=text, logprob=sampled.logprob if sampled.logprob is not None else 0.0,
                                        bytes=list(text.encode()), top_logprobs=alternatives))
        return entries

    def prompt_logprobs(self, out: RequestOutput) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs`: for each prompt token, None (the first: nothing precedes it) or
        {token id: {logprob, rank, decoded_token}} of the token itself and then the top k, -inf as -9999."""
        if out.prompt_logprobs is None:
            return None

        def entry(token_id: int, logprob: float, rank: int | None) -> dict:
            return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": self.token_text(token_id)}

        positions: list[dict | None] = []
        for scored in out.prompt_logprobs:
            if scored is None:
                positions.append(None)
                continue
            by_id = {str(scored.token_id): entry(scored.token_id, scored.logprob, scored.rank)}
            for rank, (token_id, logprob) in enumerate((scored.top_logprobs or {}).items(), start=1):
                by_id.setdefault(str(token_id), entry(token_id, logprob, rank))
            positions.append(by_id)
        return positions

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids (400 for a text the tokenizer cannot encode)."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (UnicodeError, TypeError, ValueError) as e:  # e.g. a lone surrogate the tokenizer cannot encode
            raise bad_request(f"the prompt could not be tokenized: {e}", param="prompt") from None


def check_n(n: int | None, pauses: str | None) -> None:
    """n > 1 serves n independent samples, each its own turn. A turn that may pause cannot be one of
    them: each sample would pause a generation of its own, and the request that resumes brings one
    conversation. `pauses`: why this request's turn may pause (None: it cannot)."""
    if (n or 1) > 1 and pauses is not None:
        raise bad_request(f"n > 1 needs a turn that cannot pause, and {pauses}; send n=1", param="n")


def named_id(raw: Request, named: str | None, prefix: str) -> str | None:
    """The response id a request names, as vLLM takes it: its X-Request-Id header, else its `request_id`
    field, after `prefix`; None where it names none (the server makes one)."""
    named = raw.headers.get("x-request-id") or named
    return None if named is None else prefix + named


def samples(spec: TurnSpec, n: int, request_id: str, first: int = 0) -> list[TurnSpec]:
    """`spec` as n sample turns with their own request ids. A seed is offset per sample (as vLLM does),
    so seeded samples differ from each other and each is still reproducible."""
    seed = spec.sampling.seed
    return [replace(spec, request_id=f"{request_id}-{first + i}",
                    sampling=replace(spec.sampling, seed=None if seed is None else seed + i)) for i in range(n)]


async def close_all(turns: Sequence[Turn], release: Callable[[], None]) -> None:
    """Close the turns admitted as one request, then release its admission."""
    for turn in turns:
        await turn.close()
    release()


async def merged_events(turns: Sequence[Turn]) -> AsyncIterator[tuple[int, TurnEvent]]:
    """The events of all `turns`, as they come, each with its turn's index (n samples stream together)."""
    if len(turns) == 1:
        async for event in turns[0].events():
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, turn: Turn) -> None:
        try:
            async for event in turn.events():
                await queue.put((i, event))
        except Exception as e:  # re-raised by the consumer, which ends the whole stream with it
            await queue.put((i, e))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(turns)]
    try:
        done = 0
        while done < len(turns):
            i, event = await queue.get()
            if event is None:
                done += 1
            elif isinstance(event, Exception):
                raise event
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


ErrorEvent = Callable[[APIError], dict]  # a stream's rendering of an error


def openai_error(e: APIError) -> dict:
    return {"data": json.dumps(e.body())}


OPENAI_DONE = {"data": "[DONE]"}


async def respond(raw: Request, stream: bool, events: Callable[[], AsyncIterator[dict]],
                  body: Callable[[], Awaitable[dict]], cleanup: Callable[[], Awaitable[None]],
                  headers: dict[str, str], what: str, error: ErrorEvent = openai_error,
                  done: dict | None = OPENAI_DONE) -> Response:
    """How every generation endpoint answers: an SSE stream of `events()` (cleanup once it ends, however
    it ends; a failure mid-stream becomes one `error` event, then `done`, so a client never sees a hung
    or silently cut stream), or the JSON `body()`, cancelled if the client disconnects first (499),
    cleanup after. `what` names the request in logs."""
    if stream:
        return StreamResponse(_error_tail(events(), what, error, done), cleanup, headers)
    try:
        result = await run_until_disconnect(raw, body())
    finally:
        await cleanup()
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result, headers=headers)


async def _error_tail(chunks: AsyncIterator[dict], what: str, error: ErrorEvent,
                      done: dict | None) -> AsyncIterator[dict]:
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:
            yield error(e)
        except Exception as e:  # an engine failure mid-stream
            logger.exception("%s failed mid-stream", what)
            yield error(APIError(500, f"internal error: {e}"))
    if done is not None:
        yield done


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
