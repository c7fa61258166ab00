"""The types of the turn API (turns.py): what a turn asks (`TurnSpec`, `Sampling`) and the events it
yields (`ReasoningDelta`, `TextDelta`, `CallOpened`, `CallArguments`, `CallDone`, `TurnPaused`, `TurnFinished`)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from infercept.engine.backend import RequestOutput

from .chat import Call, Message, Opening
from .conversations import Conversation, Paused
from .protocol import APIError, InterceptOptions, SamplingKnobs
from .structured import OutputConstraint
from .tool_mode import ToolMode


@dataclass(frozen=True)
class Sampling:
    """How a turn samples, as its front end's request asked (already checked by its wire model)."""

    temperature: float | None = None  # None: 1
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context length
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per sampled token; None: no logprobs
    presence_penalty: float | None = None  # None: 0
    frequency_penalty: float | None = None  # None: 0
    repetition_penalty: float | None = None  # None: 1
    min_p: float | None = None  # None: 0
    logit_bias: Mapping[str, float] | None = None  # token id (a JSON key: a string) -> bias
    stop_token_ids: Sequence[int] | None = None  # ids that end the turn as EOS does
    include_stop_str_in_output: bool = False  # the text keeps the stop string or token that ended the turn
    cache_salt: str | None = None  # the request's prefix-cache namespace (within its tenant's)
    priority: int = 0  # its place in the engine's queues: lower first
    thinking_token_budget: int | None = None  # thinking tokens before </think> is forced; None: no budget
    prompt_logprobs: int | None = None  # top logprobs per prompt token; None: no prompt logprobs
    allowed_token_ids: Sequence[int] | None = None  # the only tokens it may sample; None: any
    bad_words: Sequence[str] = ()  # words its output never contains
    skip_special_tokens: bool = True  # False: its text keeps the special tokens it writes

    def defaulted(self, defaults: Mapping[str, Any]) -> Sampling:
        """These fields, with `defaults` (the server's, generation_defaults.py) where these are unset."""
        return replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    @classmethod
    def of(cls, req: SamplingKnobs, max_tokens: int | None, logprobs: int | None = None,
           prompt_logprobs: int | None = None) -> Sampling:
        return cls(req.temperature, req.top_p, req.top_k, req.seed, max_tokens, req.min_tokens, req.stop,
                   req.ignore_eos, logprobs, req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
                   req.min_p, req.logit_bias, req.stop_token_ids, req.include_stop_str_in_output, req.cache_salt,
                   req.priority, None if req.thinking_token_budget == -1 else req.thinking_token_budget,
                   prompt_logprobs, req.allowed_token_ids, tuple(req.bad_words or ()), req.skip_special_tokens)


@dataclass(frozen=True)
class PromptTruncation:
    """Which of a rendered prompt's tokens a turn is served with (vLLM's `truncate_prompt_tokens`):
    its last `keep` (`side` "right": its first); `keep` -1: as many as leave room for one output token."""

    keep: int
    side: str = "left"
    param: str = "truncate_prompt_tokens"  # the request field that errors name

    @classmethod
    def of(cls, keep: int | None, side: str | None) -> PromptTruncation | None:
        return None if keep is None else cls(keep, side or "left")

    def apply(self, ids: list[int], max_model_len: int) -> list[int]:
        if self.keep > max_model_len:
            raise APIError(400, f"{self.param}={self.keep} cannot be greater than the model's context length "
                                f"{max_model_len}; ask for a smaller truncation", param=self.param)
        keep = max_model_len - 1 if self.keep == -1 else self.keep
        if keep >= len(ids):
            return ids
        return ids[-keep:] if self.side == "left" and keep else ids[:keep]


@dataclass(frozen=True)
class TurnSpec:
    """One turn, whatever front end it came through: `messages` (a chat turn) or `prompt_ids` (a token turn)."""

    endpoint: str  # the front end, for metrics and logs
    sampling: Sampling
    messages: tuple[Message, ...] = ()
    prompt_ids: tuple[int, ...] | None = None
    mode: ToolMode = field(default_factory=lambda: ToolMode(None, False))
    answer_schema: dict | None = None  # JSON an answer without calls must follow
    answer_param: str = "response_format"  # the request field that asks for it (errors name it)
    constraint: OutputConstraint | None = None  # a regex / choice the whole output must match
    intercept: InterceptOptions | None = None  # chat: what its calls wait for; tokens: every stop pauses
    holder: Conversation | None = None  # the named conversation it continues; it keeps the turn's pause
    owner: str | None = None  # the tenant asking (server/tenants.py): it finds and keeps only its own pauses
    id_prefix: str = "chatcmpl-"
    request_id: str | None = None  # instead of a new id with `id_prefix`
    param: str = "messages"  # the request field that prompt errors name
    truncation: PromptTruncation | None = None  # None: the whole prompt, or a 400 if it overflows the context
    # Extra keyword arguments of the chat template (`chat_template_kwargs`, a chat turn's); a paused turn
    # keeps its own, with which its prompt is rendered again when a later turn continues it (chat.py)
    template_kwargs: Mapping[str, Any] | None = None
    # How a chat turn's prompt ends; CONTINUE: in its final assistant message, whose text the answer
    # continues (and leaves out: the turn's text is the continuation, as vLLM and Anthropic return it)
    opening: Opening = Opening.GENERATION_PROMPT

    @property
    def is_chat(self) -> bool:
        return self.prompt_ids is None


# -- events -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TextDelta:
    text: str
    output: RequestOutput  # the engine output it came with (its tokens, logprobs)


@dataclass(frozen=True)
class ReasoningDelta:
    text: str  # thinking that extends the reasoning sent so far (a model with a reasoning parser)


@dataclass(frozen=True)
class CallOpened:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    delta: str  # JSON text that extends the arguments sent so far


@dataclass(frozen=True)
class CallDone:
    index: int
    call: Call


@dataclass(frozen=True)
class TurnPaused:
    handle: Paused


@dataclass(frozen=True)
class TurnResult:
    content: str | None
    calls: list[Call]
    finish_reason: str
    message: Message  # the assistant message the turn adds to its conversation (its thinking left out)
    reasoning: str | None = None  # the turn's thinking (a model with a reasoning parser; None: it did not think)


@dataclass(frozen=True)
class TurnUsage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused
    completion_tokens: int
    reasoning_tokens: int | None = None  # of the completion tokens, the thinking's (None: the turn does not think)


@dataclass(frozen=True)
class TurnFinished:
    result: TurnResult
    output: RequestOutput  # the turn's last engine output
    usage: TurnUsage


TurnEvent = ReasoningDelta | TextDelta | CallOpened | CallArguments | CallDone | TurnPaused | TurnFinished


def finish_reason(out: RequestOutput) -> str:
    """OpenAI finish reason of a turn that ended without tool calls (a pause on a stop included)."""
    if out.paused:
        return "stop" if out.stop_reason is not None else "length"
    if out.finish_reason == "abort":
        raise APIError(503, "the request was aborted (the server is shutting down)")
    return out.finish_reason or "stop"
