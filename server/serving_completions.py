"""POST /v1/completions: text or token-id prompts (one or a batch), JSON or SSE.

Token-level implicit resume: a prompt whose token ids strictly extend a paused generation's whole
token sequence resumes it; only the extension is computed. The `intercept` extension makes this
request's stops (EOS, stop strings, max_tokens) interceptions: the generation pauses instead of
finishing, and the client resumes it by sending the prompt + generated tokens + what comes next
(`return_token_ids` gives the exact tokens to extend).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import Response
from starlette.requests import Request

from infercept.engine.backend import RequestOutput

from .conversations import Paused
from .protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                       PromptTokensDetails, Usage, bad_request, new_id, now)
from .serving_base import BaseServing, EngineTurn, logger, once, openai_sse, pause_on_stops, respond


class CompletionServing(BaseServing):
    endpoint = "completions"

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        started = time.monotonic()
        self.check_model(req.model)
        self.check_unsupported(req)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported", param="best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs (prompt logprobs) is not supported", param="echo")
        prompts = self._prompts(req.prompt)
        for ids in prompts:
            self.check_prompt(ids, "prompt")
        intercept = pause_on_stops(req.intercept)
        params = [self.sampling_params(req, len(ids), req.max_tokens, req.logprobs) for ids in prompts]
        response_id = new_id("cmpl-")
        self.acquire()
        turns: list[EngineTurn] = []
        try:
            for i, ids in enumerate(prompts):
                entry = self.conversations.take(self.conversations.find_for_tokens(ids))
                turn = await self.open_turn(f"{response_id}-{i}", ids, params[i], intercept, entry, started)
                if turn.resumed:
                    self.metrics.resumes.labels(self.model_name, "tokens").inc()
                turns.append(turn)
        except BaseException:
            await self._close(turns)
            raise
        echoes = [self._echo_text(req, ids, text) for ids, text in zip(prompts, self._prompt_texts(req.prompt))]
        return await respond(
            raw, req.stream, lambda: openai_sse(self._stream(response_id, req, turns, echoes), f"request {response_id}"),
            lambda: self._full(response_id, req, turns, echoes), once(lambda: self._close(turns)),
            {"X-Request-Id": response_id})

    # -- pieces ------------------------------------------------------------------------------------
    def _prompts(self, prompt) -> list[list[int]]:
        try:
            return self._tokenize(prompt)
        except (UnicodeError, TypeError, ValueError) as e:  # e.g. a lone surrogate the tokenizer cannot encode
            raise bad_request(f"the prompt could not be tokenized: {e}", param="prompt") from None

    def _tokenize(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt, add_special_tokens=True)]
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p) for p in prompt]

    @staticmethod
    def _prompt_texts(prompt) -> list[str | None]:
        """Each prompt's text as given (None for token ids)."""
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [None]
        return [p if isinstance(p, str) else None for p in prompt]

    def _echo_text(self, req: CompletionRequest, ids: list[int], text: str | None) -> str:
        if not req.echo:
            return ""
        return text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)

    async def _close(self, turns: list[EngineTurn]) -> None:
        for turn in turns:
            await turn.close()
        self.release()

    def _end_turn(self, turn: EngineTurn, out: RequestOutput) -> str:
        """A paused generation stays paused and registered (token-level resume); returns the finish reason."""
        if out.paused:
            self.keep_paused(turn, Paused(turn.request_id, turn.prompt_ids + list(out.token_ids)))
        return self.finish_reason(out)

    def _stop_reason(self, out: RequestOutput) -> str | int | None:
        eos = self.backend.info.eos_token_ids
        return None if isinstance(out.stop_reason, int) and out.stop_reason in eos else out.stop_reason

    def _logprobs(self, req: CompletionRequest, out: RequestOutput, start: int, end: int,
                  offset: int) -> CompletionLogprobs | None:
        if req.logprobs is None or out.logprobs is None:
            return None
        first = len(out.logprobs) - len(out.token_ids)  # the engine keeps every turn's; ours are the tail
        lp = CompletionLogprobs()
        for sampled in out.logprobs[first + start:first + end]:
            text = self.token_text(sampled.token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(sampled.logprob)
            lp.top_logprobs.append({self.token_text(t): v for t, v in (sampled.top_logprobs or {}).items()}
                                   if req.logprobs else None)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def _usage(self, turns: list[EngineTurn], outs: list[RequestOutput]) -> Usage:
        n_prompt = sum(len(t.prompt_ids) for t in turns)
        n_out = sum(len(o.token_ids) for o in outs)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(t.cached_tokens for t in turns)))

    def _log(self, response_id: str, turn: EngineTurn, out: RequestOutput, finish: str) -> None:
        self.metrics.observe_request(self.endpoint, finish, len(turn.prompt_ids), turn.cached_tokens,
                                     len(out.token_ids))
        logger.info("request %s (engine %s%s): prompt %d tokens (%d cached), %d generated, finish %s%s",
                    response_id, turn.request_id, ", resumed" if turn.resumed else "", len(turn.prompt_ids),
                    turn.cached_tokens, len(out.token_ids), finish, ", paused" if out.paused else "")

    def _choice_extras(self, req: CompletionRequest, choice: dict, turn: EngineTurn, out: RequestOutput) -> dict:
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(turn.prompt_ids)
            choice["token_ids"] = list(out.token_ids)
        else:
            choice.pop("prompt_token_ids", None)
            choice.pop("token_ids", None)
        return choice

    # -- non-streaming -----------------------------------------------------------------------------
    async def _full(self, response_id: str, req: CompletionRequest, turns: list[EngineTurn],
                    echoes: list[str]) -> dict:
        async def last_of(turn: EngineTurn) -> RequestOutput:
            last = None
            async for out in turn.outputs():
                last = out
            return last

        outs = await asyncio.gather(*(last_of(t) for t in turns))
        choices = []
        for i, (turn, out) in enumerate(zip(turns, outs)):
            finish = self._end_turn(turn, out)
            self._log(response_id, turn, out, finish)
            choice = CompletionChoice(index=i, text=echoes[i] + out.text, finish_reason=finish,
                                      stop_reason=self._stop_reason(out),
                                      logprobs=self._logprobs(req, out, 0, len(out.token_ids), len(echoes[i])))
            choices.append(self._choice_extras(req, choice.model_dump(mode="json"), turn, out))
        body = CompletionResponse(id=response_id, model=req.model, choices=[], usage=self._usage(turns, outs))
        return body.model_dump(mode="json") | {"choices": choices}

    # -- streaming ---------------------------------------------------------------------------------
    async def _stream(self, response_id: str, req: CompletionRequest, turns: list[EngineTurn],
                      echoes: list[str]) -> AsyncIterator[dict]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice: dict) -> dict:
            body = {"id": response_id, "object": "text_completion", "created": created, "model": req.model,
                    "system_fingerprint": None, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return {"data": json.dumps(body, ensure_ascii=False)}

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, turn: EngineTurn) -> None:
            try:
                async for out in turn.outputs():
                    await queue.put((i, out))
            except Exception as e:
                await queue.put((i, e))
            await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(turns)]
        sent_text = [""] * len(turns)
        sent_tokens = [0] * len(turns)
        last: list[RequestOutput | None] = [None] * len(turns)
        try:
            for i, echo in enumerate(echoes):
                if echo:
                    yield chunk({"index": i, "text": echo, "logprobs": None, "finish_reason": None})
            done = 0
            while done < len(turns):
                i, item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, Exception):
                    raise item
                out = item
                last[i] = out
                finish = stop_reason = None
                if out.turn_done:
                    finish = self._end_turn(turns[i], out)
                    stop_reason = self._stop_reason(out)
                    self._log(response_id, turns[i], out, finish)
                delta = out.text[len(sent_text[i]):] if out.text.startswith(sent_text[i]) else ""
                if delta or finish:
                    lp = self._logprobs(req, out, sent_tokens[i], len(out.token_ids),
                                        len(echoes[i]) + len(sent_text[i]))
                    choice = {"index": i, "text": delta, "logprobs": lp.model_dump() if lp else None,
                              "finish_reason": finish}
                    if finish:
                        choice["stop_reason"] = stop_reason
                        if req.return_token_ids:
                            choice["prompt_token_ids"] = list(turns[i].prompt_ids)
                            choice["token_ids"] = list(out.token_ids)
                    yield chunk(choice)
                    sent_text[i], sent_tokens[i] = out.text, len(out.token_ids)
            if include_usage:
                usage = self._usage(turns, [o for o in last if o is not None])
                yield {"data": json.dumps({"id": response_id, "object": "text_completion", "created": created,
                                           "model": req.model, "system_fingerprint": None, "choices": [],
                                           "usage": usage.model_dump(mode="json")})}
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
