"""The output stage both backends share: a turn's tokens become its text, its stop strings and the
verdict on its tool calls, and the turn goes on, pauses or finishes.

    token ──> TurnOutput.add ──> text, stop string ──> TurnOutput.decide(stopped) ──> go on
                                                                              ├──> pause (calls that all count, or pause_on_stop)
                                                                              └──> finish

The native engine runs it after every step (engine.py). The vLLM backend runs it on the outputs vLLM
streams (vllm_backend/backend.py); a turn that may pause lives inside vLLM as a streaming session, which
only vLLM's scheduler can end without ending the session, so that scheduler runs the part of the rule
that ends a turn (`TurnWatch`: the same detokenizer, stop strings and call rule) on every token, and the
turn ends on the same token as on the native engine. `TurnRule` is that part as plain data, carried to
vLLM's engine-core process in the turn's sampling parameters.

Torch-free (the tokenizer is any object with Hugging Face's `decode`): vLLM's process imports it.
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestOutput
from .request import InterceptParams
from .sampling_params import SamplingParams
from .tool_format import CallJudge, TurnCalls
from .tool_parsers import ParsedByVllm, vllm_parser_name


def call_judge(intercept: InterceptParams | None, vllm_parses: bool = False) -> CallJudge | None:
    """The turn's call rule, or None when its calls cannot pause it. Raises ValueError for an unknown
    tool format, or for one of vLLM's parsers (``vllm:NAME``) where vLLM does not parse the turn
    (`vllm_parses`: the vLLM backend), so a request fails when it is added, not mid-generation."""
    if intercept is None or intercept.tool_parser is None:
        return None
    if vllm_parser_name(intercept.tool_parser) is not None and not vllm_parses:
        raise ValueError(f"the tool parser {intercept.tool_parser!r} is vLLM's: it runs on the vLLM backend only")
    return CallJudge(intercept.tool_parser, intercept.tools, intercept.parallel_calls, intercept.text_prefix,
                     intercept.reasoning_parser)


def may_pause(intercept: InterceptParams | None) -> bool:
    """The turn's rule lets it pause: it judges tool calls or pauses at any stop."""
    return intercept is not None and (intercept.tool_parser is not None or intercept.pause_on_stop)


class Action(enum.Enum):
    GO_ON = "go on"
    PAUSE = "pause"
    FINISH = "finish"


@dataclass(frozen=True)
class Verdict:
    action: Action
    judged: TurnCalls | None = None  # the verdict on the turn's calls, once the turn ends with some

    @property
    def calls(self) -> list:
        return list(self.judged.calls) if self.judged is not None else []


GO_ON = Verdict(Action.GO_ON)


class TurnOutput:
    """One turn of one request: its text so far and its rule."""

    def __init__(self, tokenizer, context: list[int], params: SamplingParams, intercept: InterceptParams | None,
                 eos_token_ids: frozenset[int] | None = None, vllm_parses: bool = False):
        """`context`: every token before the turn's first output (its tail seeds the detokenizer).
        `eos_token_ids`: the model's end-of-sequence tokens (None: the tokenizer's). `vllm_parses`: the
        backend runs vLLM's tool parsers, whose calls arrive with the turn's end (`take_vllm_calls`)."""
        self.detok = IncrementalDetokenizer(tokenizer, context, params.skip_special_tokens, params.stop,
                                            keep_stop=params.include_stop_str_in_output)
        self.judge = call_judge(intercept, vllm_parses)
        self.pause_on_stop = intercept is not None and intercept.pause_on_stop
        self.params = params
        # The token that stops the turn (EOS, a stop token) is not text, as in vLLM (unless
        # `include_stop_str_in_output`): with
        # skip_special_tokens off (tool formats whose markers are special tokens), "<|eot_id|>" or
        # "</s>" would otherwise end the turn's text and its content.
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = frozenset() if eos is None else frozenset([eos])
        self.end_ids = (frozenset() if params.ignore_eos else eos_token_ids) | frozenset(params.stop_token_ids)
        # The content vLLM's parser has streamed so far, reading the turn in vLLM's process as it is
        # written (`add_vllm_content`); None where no vLLM parser reads the turn.
        self.vllm_content = "" if self.vllm_parser is not None else None

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def vllm_parser(self) -> str | None:
        """vLLM's name of the tool parser that reads this turn in vLLM's process, if one does."""
        parser = self.judge.parser if self.judge is not None else None
        return parser.name if isinstance(parser, ParsedByVllm) else None

    def take_vllm_calls(self, calls: list, content: str | None) -> None:
        """The calls vLLM's parser found in the ended turn ([name, arguments JSON, id] each) and the
        content outside them: what `decide` judges at the turn's end."""
        self.judge.parser.take(calls, content)

    def add_vllm_content(self, delta: str) -> None:
        """Content vLLM's parser streamed for an output of the turn."""
        self.vllm_content += delta

    @property
    def streamed_content(self) -> str | None:
        """What a stream may show of the content vLLM's parser streamed: as the turn's final content reads
        it (`ParsedByVllm.take` strips it), without its leading whitespace, its trailing whitespace held
        back, and so is a tail that may still become a stop string (the turn's end cuts it off)."""
        if self.vllm_content is None:
            return None
        held = max(self.detok.max_stop_len - 1, 0)
        return self.vllm_content[:max(len(self.vllm_content) - held, 0)].strip()

    def add(self, token_id: int) -> str | None:
        """One generated token; returns the stop string it completed, if any."""
        if token_id in self.end_ids and not self.params.include_stop_str_in_output:
            return None
        return self.detok.add(token_id)

    def decide(self, stopped: bool) -> Verdict:
        """`stopped`: the turn hit EOS, a stop token or string, or its length limit.

        Pause at tool calls that all count, once the model has moved past them (so parallel calls stay
        together), or at a stop when the request pauses on any stop; finish at a stop, or as soon as the
        turn's calls are done but do not all count (an unknown tool, arguments its schema refuses, a
        second call without parallel calls): nobody could answer them. Call-shaped text that holds no
        call is content: the turn goes on."""
        judged = None
        if self.judge is not None:
            if not stopped and not self.judge.turn_done(self.text):
                return GO_ON
            judged = self.judge.judge(self.text)
            if not stopped and judged is None:
                return GO_ON
        if judged is not None and judged.calls and judged.complete:
            return Verdict(Action.PAUSE, judged)
        if judged is None and stopped and self.pause_on_stop:
            return Verdict(Action.PAUSE)
        if stopped or judged is not None:
            return Verdict(Action.FINISH, judged)
        return GO_ON

    def output(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int], verdict: Verdict,
               finish_reason: str | None, stop_reason: str | int | None, logprobs: list | None,
               num_cached_tokens: int, prompt_logprobs: list | None = None) -> RequestOutput:
        """The caller's record after this token. `finish_reason` is the stop's ("stop", "length"); a turn
        that ends in calls reports "tool_calls", one paused without calls "intercept". `prompt_logprobs`:
        the request's (RequestOutput.prompt_logprobs), complete by its first token, shared, not copied."""
        finished = verdict.action is Action.FINISH
        paused = verdict.action is Action.PAUSE
        calls = verdict.calls
        if paused or (finished and calls):
            finish_reason = "tool_calls" if calls else "intercept"
        return RequestOutput(
            request_id=request_id, prompt_token_ids=prompt_token_ids, token_ids=token_ids,
            text=self.detok.visible_text(finished or paused), finished=finished,
            finish_reason=finish_reason if finished or paused else None, stop_reason=stop_reason,
            logprobs=logprobs if self.params.logprobs is not None else None, prompt_logprobs=prompt_logprobs,
            num_cached_tokens=num_cached_tokens,
            paused=paused, tool_calls=calls, content=verdict.judged.content if verdict.judged is not None else None,
            streamed_content=self.streamed_content)


@dataclass(frozen=True)
class TurnRule:
    """What ends a turn before EOS, a stop token or its length: stop strings, and tool calls the model
    has written and moved past. Plain data (`as_dict`), for a process that has only the tokens."""

    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    tool_parser: str | None = None
    text_prefix: str = ""
    reasoning_parser: str | None = None

    @classmethod
    def of(cls, params: SamplingParams, intercept: InterceptParams | None) -> "TurnRule":
        """vLLM's tool parsers read the whole turn once the model ended it: such a turn's rule has no
        calls to watch for."""
        calls = intercept is not None and intercept.tool_parser is not None \
            and vllm_parser_name(intercept.tool_parser) is None
        return cls(tuple(params.stop), params.skip_special_tokens, intercept.tool_parser if calls else None,
                   intercept.text_prefix if calls else "", intercept.reasoning_parser if calls else None)

    @property
    def empty(self) -> bool:
        return not self.stop and self.tool_parser is None

    def as_dict(self) -> dict:
        return asdict(self) | {"stop": list(self.stop)}

    @classmethod
    def from_dict(cls, d: dict) -> "TurnRule":
        return cls(**(d | {"stop": tuple(d.get("stop", ()))}))


class TurnWatch:
    """`TurnRule` followed token by token: `add` says whether the turn ends at this token, and why.

    Ends where `TurnOutput.decide` stops going on: at a stop string, or at calls the model has moved past
    (every well-formed call here: which of them count is the output stage's to judge, after the turn)."""

    def __init__(self, tokenizer, context: list[int], rule: TurnRule):
        self.detok = IncrementalDetokenizer(tokenizer, context, rule.skip_special_tokens, list(rule.stop))
        self.judge = None if rule.tool_parser is None else \
            CallJudge(rule.tool_parser, None, True, rule.text_prefix, rule.reasoning_parser)

    def add(self, token_id: int) -> tuple[bool, str | None]:
        """(the turn ends here, the stop string that ended it)."""
        stop = self.detok.add(token_id)
        if stop is not None:
            return True, stop
        text = self.detok.text
        return self.judge is not None and self.judge.turn_done(text) and self.judge.judge(text) is not None, None
