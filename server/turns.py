"""The typed turn API every front end serves through.

A `TurnSpec` says what one turn asks: a chat conversation (rendered with the model's chat template) or
token ids, its tools and tool mode, its sampling, and the named conversation it continues. `Turns.open`
opens it: checks and renders it (400s come before anything is counted), admits it (429 / 503), claims
the paused generation it continues from the conversation store and resumes it, or starts it fresh.
`Turn.events()` then yields typed events until the turn ends:

    ReasoningDelta  thinking the client may be shown (a model with a reasoning parser: before the text)
    TextDelta       text the client may be shown (a chat turn: never part of a tool call nor of the thinking)
    CallOpened      a tool call's id and name, as soon as it is certain (grammar-constrained turns stream
    CallArguments   its arguments while they are written; otherwise a call shows once the engine judged it)
    CallDone        a call that counts, whole, once the turn ended
    TurnPaused      the turn's generation stays paused, kept by the store for the request that resumes it
    TurnFinished    the turn's result (content, calls, finish reason, the assistant message) and usage

Failures are raised (`APIError`); each front end renders them as its wire's error (serving_base). The
front ends -- chat completions, completions, Responses, native sessions, the server-tool loop -- are
sibling adapters: each maps its wire request to a `TurnSpec` and these events to its wire shape.
"""
from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from infercept.engine.backend import InterceptParams, RequestOutput, SamplingParams
from infercept.engine.backend import THINK_END, ReasoningParser

from .chat import AssistantTurn, Call, ChatRenderer, Message, Opening, ends_in_assistant_text, validate_tool_flow
from .conversations import ConversationStore, Paused
from .engine_turn import Admission, EngineTurn, EngineTurns
from .metrics import ServerMetrics
from .protocol import APIError, bad_request, new_id
from .tool_mode import constrained, with_grammar
from .turn_types import (CallArguments, CallDone, CallOpened, PromptTruncation, ReasoningDelta, Sampling, TextDelta,
                         TurnEvent, TurnFinished, TurnPaused, TurnResult, TurnSpec, TurnUsage, finish_reason)

__all__ = ["CallArguments", "CallDone", "CallOpened", "PromptTruncation", "ReasoningDelta", "Sampling", "TextDelta",
           "Turn", "TurnEvent", "TurnFinished", "TurnPaused", "TurnResult", "TurnSpec", "TurnUsage", "Turns"]

logger = logging.getLogger("infercept.server")


# -- a turn -----------------------------------------------------------------------------------------

class Turn:
    """One turn being served: its engine turn, what of its text a stream may show, and its end."""

    def __init__(self, turns: Turns, spec: TurnSpec, id: str, engine: EngineTurn, prefill: str,
                 guided_calls: bool, reasoning: ReasoningParser | None = None):
        self.turns = turns
        self.spec = spec
        self.id = id  # the front end's id of this turn (a resumed generation's engine id stays its first)
        self.engine = engine
        self.prefill = prefill  # text the server wrote for the model (a forced call's opening)
        self.guided_calls = guided_calls  # grammar-constrained calls: every call written has valid arguments
        self.reasoning = reasoning  # splits the model's thinking off its text (None: the turn does not think)
        self.call_ids: list[str] = []  # by index, the same in stream deltas and in the final calls
        self._release: Callable[[], None] | None = None  # admission's, for a turn admitted on its own
        self._unkept: Paused | None = None  # its paused generation, until the store keeps it
        self._closed = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.engine.prompt_ids

    async def close(self) -> None:
        """Leave the turn (however it ended; idempotent): abort it unless it ended, release admission."""
        if self._closed:
            return
        self._closed = True
        await self.engine.close()
        if self._release is not None:
            self._release()

    async def result(self, keep: bool = True) -> TurnFinished:
        """Serve the turn to its end, without streaming (`keep`: see `events`)."""
        async for event in self.events(keep):
            if isinstance(event, TurnFinished):
                return event

    def keep(self) -> None:
        """Hand the turn's paused generation, if it has one not kept yet, to the conversation store."""
        if self._unkept is not None and not self._closed:
            self.engine.kept = True
            self.turns.conversations.pause(self._unkept, self.spec.holder, self.spec.owner)
        self._unkept = None

    async def events(self, keep: bool = True) -> AsyncIterator[TurnEvent]:
        """The turn's events until it ends. A turn that ends paused is kept by the store at once (no await
        between), unless `keep` is False: then only `keep()` keeps it, and closing the turn before that
        aborts it (a batch keeps its pauses once every turn of it has ended: its client gets them all)."""
        streamed = ""  # text shown so far
        thought = ""  # reasoning shown so far
        sent_tokens = 0
        sent_calls: dict[int, str] = {}  # index -> arguments shown so far
        last = None
        async for out in self.engine.outputs():
            last = out
            if self.spec.is_chat:
                if out.turn_done:  # its text is the result's content (or calls), below
                    break
                reasoning, text = self._split(out.text, final=False)
                if reasoning is not None and len(reasoning) > len(thought) and reasoning.startswith(thought):
                    yield ReasoningDelta(reasoning[len(thought):])
                    thought = reasoning
                for event in self._call_events(self._streamable_calls(text), sent_calls):
                    yield event
                visible = self._streamable_text(text, out)
                if len(visible) > len(streamed) and visible.startswith(streamed):
                    yield TextDelta(visible[len(streamed):], out)
                    streamed = visible
            elif len(out.token_ids) > sent_tokens:  # a token turn shows every token, its text never taken back
                text = out.text if out.text.startswith(streamed) else streamed
                yield TextDelta(text[len(streamed):], out)
                streamed, sent_tokens = text, len(out.token_ids)
        result, handle = self._end(last)
        self._unkept = handle
        if keep:
            self.keep()
        if result.reasoning and len(result.reasoning) > len(thought) and result.reasoning.startswith(thought):
            yield ReasoningDelta(result.reasoning[len(thought):])
        # Once calls were shown, a turn that ends as text (a guided call cut by max_tokens) is that
        # call's text: the client already has it as a call, and the finish reason says "length".
        rest = _unstreamed(result.content or "", streamed)
        if self.spec.is_chat and not sent_calls and rest:
            yield TextDelta(rest, last)
        # A guided turn's calls were shown as written: finish them so (the engine's calls are normalized,
        # JSON-equal but maybe not byte-equal, and a client joins the pieces it got).
        final = self._streamable_calls(self._split(last.text)[1]) if result.calls and self.guided_calls else \
            [(call.name, call.arguments) for call in result.calls]
        for event in self._call_events(final, sent_calls):
            yield event
        for i, call in enumerate(result.calls):
            yield CallDone(i, call)
        if handle is not None:
            yield TurnPaused(handle)
        yield TurnFinished(result, last, self.usage(last))

    def usage(self, out: RequestOutput) -> TurnUsage:
        return TurnUsage(len(self.prompt_ids), self.engine.cached_tokens, len(out.token_ids),
                         self._reasoning_tokens(out))

    def _reasoning_tokens(self, out: RequestOutput) -> int | None:
        """How many of the turn's tokens are its thinking: up to the one that completes </think>, or all
        of them for a turn that ended thinking (found by decoding prefixes: O(log n) decodes); None for
        a turn that does not think."""
        reasoning, content = self._split(out.text)
        if reasoning is None:
            return None
        ids = out.token_ids
        if not content and THINK_END not in out.text:
            return len(ids)
        decode = self.turns.renderer.tokenizer.decode
        lo, hi = 1, len(ids)  # the shortest prefix whose text has the end of the thinking
        while lo < hi:
            mid = (lo + hi) // 2
            if THINK_END in decode(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    # -- what a stream may show --------------------------------------------------------------------
    def _split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(the thinking, the rest) of the turn's text so far (engine/reasoning_parsers.py); (None, text)
        for a turn that does not think. Not `final`: what a stream may show of each yet."""
        if self.reasoning is None:
            return None, text
        split = self.reasoning.split(text, final)
        return split.reasoning, split.content

    def _streamable_text(self, text: str, out: RequestOutput) -> str:
        """The part of a chat turn's text so far that is surely content, never part of a tool call: where
        vLLM's parser reads the turn (VllmToolFormat), the content it streamed as it read it."""
        mode, fmt = self.spec.mode, self.turns.format
        if mode.forced:
            return ""
        if not mode.parse:
            return text
        return out.streamed_content if out.streamed_content is not None else fmt.safe_content(text)

    def _streamable_calls(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments so far) of the calls a stream may show while they are written: in a
        grammar-constrained turn, every call whose name is complete (the grammar guarantees valid
        arguments at the end); otherwise none (calls count only once the engine validated them)."""
        if not self.guided_calls:
            return []
        return [(c.name, c.arguments) for c in self.turns.format.partial_calls(self.prefill + text,
                                                                              self.spec.mode.tools or ())]

    def _call_events(self, calls: list[tuple[str, str]], sent: dict[int, str]) -> list[TurnEvent]:
        """The events that take a client from `sent` (index -> arguments shown) to `calls`."""
        events: list[TurnEvent] = []
        for index, (name, arguments) in enumerate(calls):
            if index not in sent:
                events.append(CallOpened(index, self._call_id(index), name))
                sent[index] = ""
            done = sent[index]
            if len(arguments) > len(done) and arguments.startswith(done):
                events.append(CallArguments(index, arguments[len(done):]))
                sent[index] = arguments
        return events

    def _call_id(self, index: int, given: str | None = None) -> str:
        """The id of the turn's call `index`: the one its parser `given` it (vLLM's parsers give one), unless
        the stream already named it, else the server's own."""
        while len(self.call_ids) <= index:
            named = given is not None and len(self.call_ids) == index
            self.call_ids.append(given if named else f"call_{uuid.uuid4().hex[:24]}")
        return self.call_ids[index]

    # -- the end -----------------------------------------------------------------------------------
    def _opened_ids(self) -> int | None:
        """How many of the prompt's last tokens open the turn's own assistant message, which a resume renders
        as this turn's tokens: a forced call's prefill, or the final message's text that the turn continued
        (the prompt less the conversation before that message with the generation prompt; None where the
        prompt does not start with that: the template or the tokenizer joins them)."""
        if self.spec.opening is not Opening.CONTINUE:
            return len(self.turns.renderer.encode(self.prefill)) if self.prefill else 0
        prompt, spec = self.engine.prompt_ids, self.spec
        try:
            head = self.turns.render_head(spec)
        except APIError:
            return None
        return len(prompt) - len(head) if prompt[:len(head)] == head else None

    def _end(self, out: RequestOutput) -> tuple[TurnResult, Paused | None]:
        """The engine's verdict on the turn, rendered, and the handle of its paused generation. Tool calls
        that all count keep the generation paused for the request that brings their results (calls of
        which some did not count end it: the paused context would show calls that never get results),
        unless the turn is a structured answer (tool_mode.py), whose call is its result."""
        spec, engine = self.spec, self.engine
        handle = None
        reasoning, text = self._split(out.text)
        if out.tool_calls and spec.is_chat:  # (token turns pause at stops, never at parsed calls)
            calls = [Call.make(self._call_id(i, c.id), c.name, c.arguments) for i, c in enumerate(out.tool_calls)]
            # The message leaves the thinking out (its content is the text after it, as the engine read
            # it), as does the history a client sends back: it still names this turn, whose tokens, the
            # thinking's included, stay the paused context (chat.py renders a known turn as its tokens).
            message = Message("assistant", out.content or "", None, tuple(calls))
            result = TurnResult(out.content or None, calls, "tool_calls", message, reasoning)
            # A structured answer's call is its result: nothing will resume it. A named conversation (chat
            # session_id) is exempt: its client may continue it with only the tool results, which needs the pause.
            if out.paused and spec.mode.answer and spec.holder is None:
                engine.end()
            elif out.paused and (opened := self._opened_ids()) is None:
                engine.end()  # the prompt does not show where the turn's message starts: nothing could resume it
            elif out.paused:
                turn_ids = tuple(engine.prompt_ids[len(engine.prompt_ids) - opened:] + out.token_ids)
                history = spec.messages
                if spec.opening is Opening.CONTINUE:  # the client sends the message back whole, its opening joined
                    *history, opening = history
                    message = replace(message, content=opening.content + message.content)
                handle = Paused(engine.request_id, engine.prompt_ids + list(out.token_ids),
                                AssistantTurn(message, turn_ids, spec.template_kwargs), tuple(history),
                                tools=tuple(spec.mode.tools or ()))
        else:
            text = self.prefill + text
            result = TurnResult(text, [], finish_reason(out), Message("assistant", text), reasoning)
            if out.paused:  # a token turn's interception (chat turns pause only at calls)
                handle = Paused(engine.request_id, engine.prompt_ids + list(out.token_ids))
        usage = self.usage(out)
        self.turns.metrics.observe_request(spec.endpoint, result.finish_reason, usage.prompt_tokens,
                                           usage.cached_tokens, usage.completion_tokens)
        logger.info("%s %s (engine %s%s): prompt %d tokens (%d cached), %d generated, finish %s%s", spec.endpoint,
                    self.id, engine.request_id, ", resumed" if engine.resumed else "", usage.prompt_tokens,
                    usage.cached_tokens, usage.completion_tokens, result.finish_reason, ", paused" if handle else "")
        return result, handle


def _unstreamed(content: str, streamed: str) -> str:
    """What of a turn's final content a stream has not shown yet, having shown `streamed`: the rest after
    it, the content's leading whitespace aside (vLLM's parser's content streams without it; an answer
    without calls keeps the turn's text as written). Nothing where the content does not go on from what
    was shown (vLLM's parser read the turn as it was written and then whole, and the two disagree): the
    client keeps the text it was shown, never shown a second time nor spliced with another."""
    for whole in (content, content.lstrip()):
        if whole.startswith(streamed):
            return whole[len(streamed):]
    return ""


# -- opening turns ----------------------------------------------------------------------------------

def check_continuable(spec: TurnSpec, forced: bool) -> None:
    """400 unless the answer can continue the conversation's final message: an assistant message of text,
    and no call forced (a forced call opens the answer itself)."""
    if not ends_in_assistant_text(spec.messages):
        raise bad_request(f"{spec.param}: an answer can continue only a final assistant message of text "
                          "(no tool calls)", param=spec.param)
    if forced:
        raise bad_request("a forced tool call opens the answer itself: it cannot continue the final assistant "
                          "message", param="tool_choice")


@dataclass
class _Prepared:
    spec: TurnSpec
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    intercept: InterceptParams | None
    prefill: str = ""
    reasoning: ReasoningParser | None = None


class Turns:
    """Opens turns: the one place that renders, admits, claims paused generations and starts engine turns."""

    def __init__(self, engine_turns: EngineTurns, conversations: ConversationStore, metrics: ServerMetrics,
                 admission: Admission, renderer: ChatRenderer | None, max_model_len: int, vocab_size: int,
                 guided_decoding: bool = True, reasoning: ReasoningParser | None = None,
                 sampling_defaults: Mapping[str, Any] | None = None, tenant_cache_salt: bool = True):
        self.engine_turns = engine_turns
        self.conversations = conversations
        self.metrics = metrics
        self.admission = admission
        self.renderer = renderer  # None: the model has no chat template (token turns only)
        self.format = renderer.tool_format if renderer is not None else None
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.guided_decoding = guided_decoding  # the backend's (EngineInfo.guided_decoding)
        self.reasoning = reasoning  # --reasoning-parser: chat turns' thinking is split off (None: not)
        self.sampling_defaults = sampling_defaults or {}  # for the fields a request leaves out (generation_defaults.py)
        self.tenant_cache_salt = tenant_cache_salt  # each tenant's prompts cached apart (not --shared-prefix-cache)

    async def open(self, spec: TurnSpec) -> Turn:
        """Open one turn; closing it releases its admission."""
        (turn,) = await self._open([spec])
        turn._release = self.admission.release
        return turn

    async def open_batch(self, specs: Sequence[TurnSpec]) -> tuple[list[Turn], Callable[[], None]]:
        """Open turns admitted as one request (a completions batch): close each, then call the release."""
        return await self._open(specs), self.admission.release

    async def _open(self, specs: Sequence[TurnSpec]) -> list[Turn]:
        started = time.monotonic()
        prepared = [self._prepare(spec) for spec in specs]
        self.admission.acquire()  # the last check that can refuse: from here on a claimed generation is resumed
        turns: list[Turn] = []
        try:
            for p in prepared:
                entry = self._claim(p.spec, p.prompt_ids)
                engine = await self.engine_turns.open(p.id, p.prompt_ids, p.params, p.intercept, entry, started)
                if engine.resumed:
                    how = "explicit" if p.spec.holder is not None else "implicit" if p.spec.is_chat else "tokens"
                    self.metrics.resumes.labels(self.metrics.model, how).inc()
                turns.append(Turn(self, p.spec, p.id, engine, p.prefill, reasoning=p.reasoning,
                                  guided_calls=p.spec.mode.parse and p.params.guided is not None))
        except BaseException:
            for turn in turns:
                await turn.close()
            self.admission.release()
            raise
        return turns

    def _prepare(self, spec: TurnSpec) -> _Prepared:
        """The turn's prompt, sampling parameters and interception rule (400 on bad input)."""
        if not spec.is_chat:
            prompt_ids = self.render_prompt(spec)
            intercept = None if spec.intercept is None else InterceptParams(
                pause_on_stop=True, expected_s=spec.intercept.expected_s, kind=spec.intercept.kind)
            params = self.sampling_params(spec, len(prompt_ids), spec.sampling.skip_special_tokens)
            if spec.constraint is not None:
                params = constrained(params, spec.constraint.guided, spec.constraint.param)
            return _Prepared(spec, spec.request_id or new_id(spec.id_prefix), prompt_ids, params, intercept)
        prompt_ids, prefill = self._render(spec)
        mode, fmt = spec.mode, self.format
        # (a tool format whose calls are written in special tokens keeps them, for its parser to read)
        skip_special_tokens = spec.sampling.skip_special_tokens and not (mode.parse and fmt.keeps_special_tokens)
        params = self.sampling_params(spec, len(prompt_ids), skip_special_tokens)
        params = with_grammar(fmt, params, mode, spec.answer_schema, self.guided_decoding, self.reasoning is not None,
                              spec.answer_param, spec.constraint)
        # A forced turn (opened by its call's prefill, or written by the grammar of vLLM's parser) starts
        # with that call: it does not think.
        # Nor does one under a response_format (or regex / choice) grammar, from its first token, as a
        # parser that takes the turn as thinking from there would (deepseek_r1's; qwen3's splits only a
        # text that opens with <think>, whatever wrote it). With a reasoning parser tool_choice none has no grammar.
        reasoning = self.reasoning
        if reasoning is not None:  # (the template may have opened the thinking in the generation prompt)
            reasoning = reasoning.after_prompt(self.renderer.tokenizer.decode(prompt_ids[-8:]))
        whole_output = spec.answer_schema is not None or spec.constraint is not None
        if mode.forced or (reasoning is not None and reasoning.starts_thinking and whole_output):
            reasoning = None
        intercept = None
        if mode.parse:
            hint = spec.intercept
            intercept = InterceptParams(tool_parser=fmt.family, tools=tuple(mode.tools), parallel_calls=mode.parallel,
                                        text_prefix=prefill, expected_s=hint.expected_s if hint else None,
                                        forced_call=(mode.forced_name or "required") if mode.forced else None,
                                        reasoning_parser=reasoning.name if reasoning is not None else None,
                                        kind=hint.kind if hint else "tool")
        return _Prepared(spec, spec.request_id or new_id(spec.id_prefix), prompt_ids, params, intercept, prefill,
                         reasoning)

    def render_prompt(self, spec: TurnSpec, fit_context: bool = True) -> list[int]:
        """The prompt token ids `spec` would be served with (400 on bad input); nothing runs.
        `fit_context` False: a prompt longer than the model's context is counted, not refused."""
        if not spec.is_chat:
            return self._fit(spec, list(spec.prompt_ids), fit_context)
        return self._render(spec, fit_context)[0]

    def _render(self, spec: TurnSpec, fit_context: bool = True) -> tuple[list[int], str]:
        """A chat turn's prompt token ids and the prefill they end with (a forced call's opening)."""
        if self.renderer is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
        validate_tool_flow(spec.messages)
        mode = spec.mode
        if mode.forced and not self.format.forces_calls:
            # A call forced in any other form than the model's own (vLLM's JSON list) would pause a turn
            # that is not what the model writes, nor what a resumed turn extends.
            asked = "required" if mode.forced_name is None else f"naming {mode.forced_name!r}"
            raise bad_request(f"tool_choice {asked} cannot be enforced with vLLM's tool parser "
                              f"{self.format.name!r}: {self.format.forcing_refusal}; send tool_choice auto",
                              param="tool_choice")
        if spec.opening is Opening.CONTINUE:
            check_continuable(spec, mode.forced)
        prefill = self.format.forced_prefill(mode.forced_name) if mode.forced else ""
        try:
            known_turn = functools.partial(self.conversations.known_turn, owner=spec.owner)
            prompt_ids = self.renderer.render(spec.messages, mode.tools, known_turn, prefill,
                                              spec.template_kwargs, spec.opening)
        except APIError:
            raise
        except Exception as e:  # the template (jinja) or the tokenizer refused the input
            raise bad_request(f"the conversation could not be rendered with the model's chat template: {e}",
                              param=spec.param) from None
        truncated = self._fit(spec, prompt_ids, fit_context)
        if prefill and len(truncated) < len(prompt_ids) and spec.truncation.side == "right":
            raise bad_request("truncation_side right would cut off the forced call's opening the prompt ends with; "
                              "truncate from the left", param="truncation_side")
        return truncated, prefill

    def _fit(self, spec: TurnSpec, prompt_ids: list[int], fit_context: bool) -> list[int]:
        """The prompt as `spec` truncates it, checked (400 on bad input)."""
        if spec.truncation is not None:
            prompt_ids = spec.truncation.apply(prompt_ids, self.max_model_len)
        self.check_prompt(prompt_ids, spec.param, fit_context)
        return prompt_ids

    def render_head(self, spec: TurnSpec) -> list[int]:
        """A continued chat turn's conversation before its final message, with the generation prompt."""
        return self._render(replace(spec, messages=spec.messages[:-1], opening=Opening.GENERATION_PROMPT,
                                    truncation=None), fit_context=False)[0]

    def _claim(self, spec: TurnSpec, prompt_ids: list[int]) -> Paused | None:
        """The paused generation the turn continues, taken out of the store: its holder's, or found by the
        conversation's call ids (chat) or by the tokens (a prompt strictly extending its tokens). None for
        a turn that asks for prompt logprobs: its whole prompt is computed, so it starts afresh."""
        store, holder = self.conversations, spec.holder
        if spec.sampling.prompt_logprobs is not None:
            if holder is not None:
                store.release_paused(holder, f"{holder.kind.value} {holder.id} asked for prompt logprobs")
            return None
        if spec.is_chat:
            entry = store.find_for_messages(spec.messages, holder, spec.owner)
        else:
            entry = holder.paused if holder is not None else store.find_for_tokens(prompt_ids, spec.owner)
        if entry is None:
            if holder is not None:  # it moved on: its paused generation is of no further use
                store.release_paused(holder, f"{holder.kind.value} {holder.id} continued differently")
            return None
        n = len(entry.token_ids)
        if len(prompt_ids) > n and prompt_ids[:n] == entry.token_ids:
            taken = store.take(entry)
            if taken is not None:
                tool = taken.turn.message.tool_calls[0].name if taken.turn is not None else "tokens"
                self.metrics.observe_interception(tool, store.clock() - taken.since)
            return taken
        logger.info("the turn matches paused %s but its prompt does not extend the paused tokens; serving it fresh",
                    entry.request_id)
        self.metrics.resume_fallbacks.labels(self.metrics.model).inc()
        return None

    # -- checks ------------------------------------------------------------------------------------
    def check_prompt(self, ids: Sequence[int], param: str, fit_context: bool = True) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size})", param=param)
        if fit_context and len(ids) >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                              f"{len(ids)} tokens.", param=param, code="context_length_exceeded")

    def sampling_params(self, spec: TurnSpec, num_prompt_tokens: int, skip_special_tokens: bool = True) -> SamplingParams:
        s = spec.sampling.defaulted(self.sampling_defaults)
        # As vLLM and SGLang do, max_tokens is a ceiling the context left also bounds: agents send a
        # fixed one (Claude Code 32,000) whatever the model's context; the turn ends with "length" there.
        room = self.max_model_len - num_prompt_tokens
        max_tokens = room if s.max_tokens is None else min(s.max_tokens, room)
        stop = [s.stop] if isinstance(s.stop, str) else list(s.stop or [])
        logit_bias = self.logit_bias(s.logit_bias)
        for param, token_ids in (("stop_token_ids", s.stop_token_ids), ("allowed_token_ids", s.allowed_token_ids)):
            if any(not 0 <= t < self.vocab_size for t in token_ids or ()):
                raise bad_request(f"{param} must be token ids in [0, {self.vocab_size})", param=param)
        if s.thinking_token_budget is not None and self.reasoning is None:
            raise bad_request("thinking_token_budget is for a thinking model: the server reads its thinking with "
                              "--reasoning-parser, which it was not started with", param="thinking_token_budget")
        try:
            return SamplingParams(
                temperature=1.0 if s.temperature is None else s.temperature,
                top_p=1.0 if s.top_p is None else s.top_p,
                top_k=max(s.top_k or 0, 0), seed=s.seed,
                max_tokens=max_tokens, min_tokens=s.min_tokens,
                stop=stop, stop_token_ids=list(s.stop_token_ids or ()),
                include_stop_str_in_output=s.include_stop_str_in_output,
                ignore_eos=s.ignore_eos, logprobs=s.logprobs, skip_special_tokens=skip_special_tokens,
                presence_penalty=s.presence_penalty or 0.0, frequency_penalty=s.frequency_penalty or 0.0,
                repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
                min_p=s.min_p or 0.0, logit_bias=logit_bias, cache_salt=self.cache_salt(spec.owner, s.cache_salt),
                priority=s.priority, thinking_token_budget=s.thinking_token_budget, prompt_logprobs=s.prompt_logprobs,
                allowed_token_ids=None if s.allowed_token_ids is None else list(s.allowed_token_ids),
                bad_words=list(s.bad_words))
        except ValueError as e:
            raise bad_request(str(e)) from None

    def cache_salt(self, owner: str | None, salt: str | None) -> str | None:
        """The prefix-cache namespace of a tenant's request: the tenant's own (unless tenants share the
        cache), and within it the request's `cache_salt`."""
        if owner is None or not self.tenant_cache_salt:
            return salt
        return json.dumps([owner, salt])

    def logit_bias(self, bias) -> dict[int, float] | None:
        """`logit_bias` with integer token ids; 400 for a key that is not a token id of this model, or a
        bias outside [-100, 100] (OpenAI's range)."""
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                token = None
            if token is None or not 0 <= token < self.vocab_size:
                raise bad_request(f"logit_bias keys must be token ids in [0, {self.vocab_size}); got {key!r}",
                                  param="logit_bias")
            if not -100 <= value <= 100:
                raise bad_request(f"logit_bias values must be in [-100, 100]; got {value!r} for token {token}",
                                  param="logit_bias")
            out[token] = float(value)
        return out or None
