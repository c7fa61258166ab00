"""POST /v1/completions: text or token-id prompts (one or a batch), JSON or SSE.

Token-level implicit resume: a prompt whose token ids strictly extend a paused generation's whole
token sequence resumes it; only the extension is computed. The `intercept` extension makes this
request's stops (EOS, stop strings, max_tokens) interceptions: the generation pauses instead of
finishing, and the client resumes it by sending the prompt + generated tokens + what comes next
(`return_token_ids` gives the exact tokens to extend).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi.responses import Response
from starlette.requests import Request

from infercept.engine.backend import RequestOutput

from .protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                       PromptTokensDetails, Usage, bad_request, new_id, now)
from .serving_base import Frontend, check_n, close_all, merged_events, named_id, once, respond, samples
from .structured import output_constraint
from .tenants import owner_of
from .turns import PromptTruncation, Sampling, TextDelta, Turn, TurnFinished, TurnSpec


class CompletionServing(Frontend):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        check_n(req.n, "intercept makes each of its stops a pause" if req.intercept is not None else None)
        constraint = output_constraint(req)
        if req.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise bad_request("best_of > 1 is not supported", param="best_of")
        if req.max_tokens == 0 and (not req.echo or req.intercept is not None):
            raise bad_request("max_tokens 0 generates nothing: it asks for the echoed prompt alone (echo true, "
                              "no intercept)", param="max_tokens")
        prompts = self._prompts(req.prompt)
        named = named_id(raw, req.request_id, "cmpl-")  # (it names the response only, as on chat)
        response_id = named or new_id("cmpl-")
        samples_id = new_id("cmpl-") if named else response_id
        # The prompt alone is a turn of one token, left out of the answer (as vLLM does it).
        sampling = Sampling.of(req, req.max_tokens if req.max_tokens != 0 else 1, req.logprobs,
                               self._prompt_logprobs(req))
        n = req.n or 1
        truncation = PromptTruncation.of(req.truncate_prompt_tokens, req.truncation_side)
        # n samples of each prompt, in the order of their choice index: prompt p's are p*n ... p*n + n-1
        turns, release = await self.turns.open_batch([
            sample for p, ids in enumerate(prompts) for sample in samples(
                TurnSpec("completions", sampling, prompt_ids=tuple(ids), intercept=req.intercept, owner=owner_of(raw),
                         param="prompt", constraint=constraint, truncation=truncation), n, samples_id, first=p * n)])
        # (a truncated prompt echoes the tokens it was served with)
        texts = [text for text in self._prompt_texts(req.prompt) for _ in range(n)]
        echoes = [self._echo_text(req, turn.prompt_ids, text if turn.prompt_ids == ids else None)
                  for turn, ids, text in zip(turns, (ids for ids in prompts for _ in range(n)), texts)]
        return await respond(
            raw, req.stream, lambda: self._stream(response_id, req, turns, echoes),
            lambda: self._full(response_id, req, turns, echoes), once(lambda: close_all(turns, release)),
            {"X-Request-Id": response_id}, f"request {response_id}")

    def render(self, req: CompletionRequest) -> list[dict]:
        """vLLM's render answer (`POST /v1/completions/render`): each prompt's token ids, nothing run."""
        self.check_model(req.model)
        truncation = PromptTruncation.of(req.truncate_prompt_tokens, req.truncation_side)
        return [{"request_id": new_id("cmpl-"), "token_ids": self.turns.render_prompt(
                    TurnSpec("completions", Sampling(), prompt_ids=tuple(ids), param="prompt", truncation=truncation))}
                for ids in self._prompts(req.prompt)]

    # -- pieces ------------------------------------------------------------------------------------
    def _prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode_prompt(prompt)]
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [self.encode_prompt(p) if isinstance(p, str) else list(p) for p in prompt]

    @staticmethod
    def _prompt_texts(prompt) -> list[str | None]:
        """Each prompt's text as given (None for token ids)."""
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [None]
        return [p if isinstance(p, str) else None for p in prompt]

    @staticmethod
    def _prompt_logprobs(req: CompletionRequest) -> int | None:
        """The top logprobs each prompt token gets: `prompt_logprobs`, else with echo `logprobs` (as vLLM:
        the echoed prompt's tokens carry logprobs as the generated ones do)."""
        if req.prompt_logprobs is not None:
            return req.prompt_logprobs
        return req.logprobs if req.echo else None

    def _echo_text(self, req: CompletionRequest, ids: list[int], text: str | None) -> str:
        if not req.echo:
            return ""
        return text if text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)

    def _logprobs(self, req: CompletionRequest, out: RequestOutput, start: int, end: int,
                  offset: int) -> CompletionLogprobs | None:
        if req.logprobs is None or out.logprobs is None:
            return None
        first = len(out.logprobs) - len(out.token_ids)  # the engine keeps every turn's; ours are the tail
        return self._token_logprobs(req, out.logprobs[first + start:first + end], offset)

    def _echo_logprobs(self, req: CompletionRequest, out: RequestOutput) -> CompletionLogprobs:
        """The echoed prompt's tokens with their logprobs, its first token's None (nothing precedes it)."""
        first = out.prompt_token_ids[0]
        lp = self._token_logprobs(req, out.prompt_logprobs[1:], len(self.token_text(first)))
        lp.tokens.insert(0, self.token_label(first, req.return_tokens_as_token_ids))
        lp.token_logprobs.insert(0, None)
        lp.top_logprobs.insert(0, None)
        lp.text_offset.insert(0, 0)
        return lp

    def _token_logprobs(self, req: CompletionRequest, scored: list, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        as_ids = req.return_tokens_as_token_ids
        for sampled in scored:
            lp.tokens.append(self.token_label(sampled.token_id, as_ids))
            lp.token_logprobs.append(max(sampled.logprob, -9999.0))
            top = (sampled.top_logprobs or {}).items()
            lp.top_logprobs.append({self.token_label(t, as_ids): max(v, -9999.0) for t, v in top}
                                   if req.logprobs else None)
            lp.text_offset.append(offset)  # (into the text, whatever names the tokens)
            offset += len(self.token_text(sampled.token_id))
        return lp

    def _choice_logprobs(self, req: CompletionRequest, out: RequestOutput, start: int, end: int,
                         offset: int) -> CompletionLogprobs | None:
        """A choice's logprobs of its tokens [start, end), after the echoed prompt's where the choice
        starts (`start` 0) with an echo."""
        lp = self._logprobs(req, out, start, end, offset)
        if lp is None or not req.echo or start or out.prompt_logprobs is None:
            return lp
        echoed = self._echo_logprobs(req, out)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(echoed, name).extend(getattr(lp, name))
        return echoed

    @staticmethod
    def _shown(req: CompletionRequest, out: RequestOutput) -> RequestOutput:
        """What a choice shows of an engine output: with max_tokens 0, the prompt alone (the token
        generated for it left out)."""
        if req.max_tokens != 0:
            return out
        earlier = None if out.logprobs is None else out.logprobs[:len(out.logprobs) - len(out.token_ids)]
        return replace(out, token_ids=[], text="", logprobs=earlier, stop_reason=None)

    @staticmethod
    def _finish_reason(req: CompletionRequest, end: TurnFinished) -> str:
        return "length" if req.max_tokens == 0 else end.result.finish_reason

    @staticmethod
    def _usage(req: CompletionRequest, ends: list[TurnFinished]) -> Usage:
        """Every choice's completion tokens; each prompt's tokens once, not once per sample (as OpenAI
        counts them): its n samples have the same prompt, so the sums over samples are n times that."""
        n = req.n or 1
        n_prompt = sum(e.usage.prompt_tokens for e in ends) // n
        n_out = 0 if req.max_tokens == 0 else sum(e.usage.completion_tokens for e in ends)
        cached = sum(e.usage.cached_tokens for e in ends) // n  # (samples may differ here: their mean)
        return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _choice_extras(self, req: CompletionRequest, choice: dict, turn: Turn, out: RequestOutput) -> dict:
        if out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out)
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(turn.prompt_ids)
            choice["token_ids"] = list(out.token_ids)
        else:
            choice.pop("prompt_token_ids", None)
            choice.pop("token_ids", None)
        return choice

    # -- non-streaming -----------------------------------------------------------------------------
    async def _full(self, response_id: str, req: CompletionRequest, turns: list[Turn], echoes: list[str]) -> dict:
        ends = await asyncio.gather(*(turn.result(keep=False) for turn in turns))
        for turn in turns:
            turn.keep()
        choices = []
        for i, (turn, end) in enumerate(zip(turns, ends)):
            out = self._shown(req, end.output)
            choice = CompletionChoice(index=i, text=echoes[i] + out.text, finish_reason=self._finish_reason(req, end),
                                      stop_reason=self.stop_reason(out),
                                      logprobs=self._choice_logprobs(req, out, 0, len(out.token_ids), len(echoes[i])))
            choices.append(self._choice_extras(req, choice.model_dump(mode="json"), turn, out))
        body = CompletionResponse(id=response_id, model=req.model, choices=[], usage=self._usage(req, ends))
        return body.model_dump(mode="json") | {"choices": choices}

    # -- streaming ---------------------------------------------------------------------------------
    async def _stream(self, response_id: str, req: CompletionRequest, turns: list[Turn],
                      echoes: list[str]) -> AsyncIterator[dict]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choice: dict) -> dict:
            body = {"id": response_id, "object": "text_completion", "created": created, "model": req.model,
                    "system_fingerprint": None, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return {"data": json.dumps(body, ensure_ascii=False)}

        sent_chars = [0] * len(turns)  # of each turn's text
        sent_tokens = [0] * len(turns)  # whose logprobs were sent
        pending = [""] * len(turns)  # text not sent yet: the last delta goes out with the finish reason
        ends: list[TurnFinished] = []
        # An echo goes first; with logprobs, once the prompt's have come (with the turn's first output).
        scored_echo = req.logprobs is not None
        for i, echo in enumerate(echoes):
            if echo and not scored_echo:
                yield chunk({"index": i, "text": echo, "logprobs": None, "finish_reason": None})
        echo_due = [bool(echo) and scored_echo for echo in echoes]
        async for i, event in merged_events(turns):
            if echo_due[i] and isinstance(event, (TextDelta, TurnFinished)):
                echo_due[i] = False
                scored = event.output.prompt_logprobs is not None
                yield chunk({"index": i, "text": echoes[i], "finish_reason": None,
                             "logprobs": self._echo_logprobs(req, event.output).model_dump() if scored else None})
            if isinstance(event, TextDelta):
                if req.max_tokens != 0:  # (0: the prompt alone)
                    pending[i] += event.text
                if event.output.turn_done or not pending[i]:
                    continue
                out, finish = event.output, None
            elif isinstance(event, TurnFinished):
                ends.append(event)
                out, finish = self._shown(req, event.output), self._finish_reason(req, event)
            else:
                continue
            lp = self._logprobs(req, out, sent_tokens[i], len(out.token_ids), len(echoes[i]) + sent_chars[i])
            choice = {"index": i, "text": pending[i], "logprobs": lp.model_dump() if lp else None,
                      "finish_reason": finish}
            if finish:
                choice["stop_reason"] = self.stop_reason(out)
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(turns[i].prompt_ids)
                    choice["token_ids"] = list(out.token_ids)
            yield chunk(choice)
            sent_chars[i] += len(pending[i])
            pending[i], sent_tokens[i] = "", len(out.token_ids)
        if include_usage:
            yield {"data": json.dumps({"id": response_id, "object": "text_completion", "created": created,
                                       "model": req.model, "system_fingerprint": None, "choices": [],
                                       "usage": self._usage(req, ends).model_dump(mode="json")})}
