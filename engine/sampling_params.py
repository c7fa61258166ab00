"""Per-request sampling settings."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Constrain what a request generates in each turn to a grammar: a Lark grammar (llguidance's
    dialect, which may embed JSON schemas with ``%json {...}``), a JSON schema, a regular expression
    the whole output must match, or a list of strings the output must be one of. Exactly one is given.

    The grammar is compiled once here, so a grammar error is a ValueError when the request is made,
    never a failure in the middle of a step (engine/guided_decoding.py enforces it while decoding).
    """

    lark: str | None = None
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str = field(init=False, repr=False, compare=False)  # llguidance's serialized grammar

    def __post_init__(self):
        if sum(x is not None for x in (self.lark, self.json_schema, self.regex, self.choice)) != 1:
            raise ValueError("guided decoding takes exactly one of lark, json_schema, regex and choice")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        object.__setattr__(self, "grammar", compile_grammar(self.lark, self.json_schema, self.regex, self.choice))


def choice_lark(choice: Sequence[str]) -> str:
    """A Lark grammar whose only sentences are the given strings (JSON string literals are Lark's)."""
    if not choice:
        raise ValueError("choice needs at least one string")
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def compile_grammar(lark: str | None, json_schema: dict[str, Any] | str | None, regex: str | None = None,
                    choice: Sequence[str] | None = None) -> str:
    """llguidance's grammar for a Lark grammar, a JSON schema, a regex or a choice of strings; ValueError
    when it does not compile. (Here, not in guided_decoding.py, which imports torch and this module: no
    import circle.)"""
    import llguidance

    if choice is not None:
        lark = choice_lark(choice)
    if lark is not None:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    elif regex is not None:
        grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    else:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json_schema)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid grammar: {messages[0]}")
    return grammar


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (as vLLM does)
GRAMMAR_ENDS_THE_OUTPUT = "a grammar decides where the output ends: min_tokens and ignore_eos do not combine with it"


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # end-of-sequence and stop tokens are suppressed until this many
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text keeps the stop string (or stop token) that ended it
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: the sampled token's logprob plus the top k
    # None: off; k: each prompt token's logprob given the tokens before it (the first has none), its rank
    # and the top k there (vLLM's `prompt_logprobs`). The prompt is then computed whole: no prefix-cache
    # reuse below the positions whose logprobs it still needs.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    guided: GuidedDecodingParams | None = None  # every turn's output must match this grammar
    # Penalties, as vLLM defines them (engine/sampler.py): presence and frequency (OpenAI's) over the
    # tokens this turn generated so far, repetition (HF's, CTRL's rule) over the prompt and those tokens.
    presence_penalty: float = 0.0  # [-2, 2]: subtracted from the logit of every token the output has
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: a seen token's logit is divided by it if > 0, else multiplied
    min_p: float = 0.0  # [0, 1]: random sampling drops tokens less likely than min_p x the most likely one
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # Not sampling, but a request's option that travels with these to either backend: the prefix cache's
    # namespace. Requests share cached blocks only with requests of the same salt (vLLM's `cache_salt`);
    # a request keeps its first turn's.
    cache_salt: str | None = None
    # Nor this: the request's place in the scheduler's queues, ahead of the policy's own order (vLLM's
    # `priority`: lower first); a resumed turn takes its own request's.
    priority: int = 0
    # A thinking model's turn thinks at most this many tokens, then the end-of-thinking marker is forced
    # (engine/thinking_budget.py; vLLM's `thinking_token_budget`); None: as long as it likes.
    thinking_token_budget: int | None = None
    # vLLM's: sample only among these token ids (None: all), and never write one of these words (each as
    # it tokenizes at the start of a text and after a space, as vLLM tokenizes it: a word's last token
    # is forbidden where the turn's output so far ends with the tokens before it; engine/bad_words.py).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError("repetition_penalty must be a finite number > 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs must be between 0 and 20")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise ValueError("thinking_token_budget must be >= 0 (None: no budget)")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.guided is not None and self.holds_back_the_end:
            raise ValueError(GRAMMAR_ENDS_THE_OUTPUT)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must name at least one token")
        if self.allowed_token_ids is not None and self.guided is not None:
            raise ValueError("allowed_token_ids do not combine with a grammar (the grammar decides the tokens)")
        if any(not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty words")

    @property
    def holds_back_the_end(self) -> bool:
        """min_tokens or ignore_eos: the end-of-sequence token is held back, even where a grammar would
        allow nothing else (so no grammar-constrained turn takes them: GRAMMAR_ENDS_THE_OUTPUT)."""
        return bool(self.min_tokens or self.ignore_eos)

    @property
    def greedy(self) -> bool:
        # A temperature this small is greedy in effect, and dividing fp32 logits by it overflows.
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Some penalty is set: sampling needs the request's tokens (prompt and output)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """The next token's sampling depends on the tokens before it, on the host: a grammar's mask (its
        matcher has taken them), the penalties' counts or the bad words' prefixes."""
        return self.guided is not None or self.penalized or bool(self.bad_words)


def _checked_logit_bias(bias: dict | None) -> dict[int, float] | None:
    """`bias` with integer token ids (JSON's string keys such as "123" are converted); None if empty.
    ValueError for a key that is not a token id or a bias outside [-100, 100]. Whether an id is in the
    model's vocabulary is for whoever knows the vocabulary (the server answers 400)."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, (int, str)) and not isinstance(key, bool) else None
        except ValueError:
            token = None
        if token is None or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers); got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100]; got {value!r} for token {token}")
        out[token] = float(value)
    return out
