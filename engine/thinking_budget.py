"""Thinking budgets: a thinking model's turn stops thinking after `thinking_token_budget` tokens.

vLLM's `thinking_token_budget` (and Anthropic's `thinking.budget_tokens`, which the server maps to it):
once a turn has thought that many tokens, the sampler forces the end-of-thinking marker (``</think>``,
as many tokens as it takes) and the model answers from there. One `ThinkingBudgets` per engine, owned
by the model runner beside the grammars, with the same life cycle:

    first sample of a turn --> the turn's context says whether it is thinking already (the prompt's last
                               <think> is not closed: a template that opened the thinking)
    each sampled token      --> `take`: a <think> starts a section, a </think> ends it, a token inside
                               counts; the budget spent, the next tokens are the end marker's, forced
    sampler                 --> a forced row allows only its forced token (`forced_tokens`)

As in vLLM, thinking is read from the markers alone (whichever reasoning parser the server splits the
text with), a new ``<think>`` after a ``</think>`` starts a new section with a new budget, and a budget
of 0 ends the thinking as soon as it opens. Requests without a budget cost nothing. A turn's state is
what it sampled: preemption and recompute keep it, a resumed turn (its first sample) starts afresh.

Under asynchronous scheduling a step is planned before the step before's token is on the host; a turn
whose next token may be forced (`may_force`) is then sampled after that token is read, as a grammar's
is (`ModelRunner.run`), and every other turn of a budget samples early: its token cannot be forced yet.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .outputs import ScheduledChunk
from .reasoning_parsers import THINK_END, THINK_START
from .sampler import AllowedTokens


def last_index(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Where the last occurrence of `marker` starts in `tokens`, or -1."""
    n, first, marker = len(marker), marker[0], list(marker)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i] == first and list(tokens[i:i + n]) == marker:
            return i
    return -1


@dataclass
class _Turn:
    """One turn's thinking, as far as its sampled tokens have been taken."""

    budget: int
    thinking: bool  # inside a <think> section
    count: int = 0  # tokens thought in the section (the markers' own tokens left out)
    forced: int = 0  # tokens of the end marker forced so far in this section
    recent: list[int] = field(default_factory=list)  # the last tokens, to find a marker that spans several


class ThinkingBudgets:
    """The thinking markers of one tokenizer and the turns that think on a budget."""

    def __init__(self, start_ids: Sequence[int], end_ids: Sequence[int]):
        if not start_ids or not end_ids:
            raise ValueError("the thinking markers must tokenize to at least one token each")
        self.start_ids, self.end_ids = list(start_ids), list(end_ids)
        self._keep = max(len(self.start_ids), len(self.end_ids))
        self.turns: dict[str, _Turn] = {}

    @classmethod
    def of_tokenizer(cls, tokenizer) -> ThinkingBudgets:
        return cls(tokenizer.encode(THINK_START, add_special_tokens=False),
                   tokenizer.encode(THINK_END, add_special_tokens=False))

    def _turn_for(self, chunk: ScheduledChunk) -> _Turn | None:
        budget = chunk.sampling_params.thinking_token_budget
        if budget is None:
            self.turns.pop(chunk.request_id, None)  # a resumed turn without the previous budget
            return None
        if chunk.num_output_tokens == 0:  # the first token of a turn: read where its context leaves it
            context = chunk.context_token_ids or []
            start = last_index(context, self.start_ids)
            thinking = start >= 0 and start > last_index(context, self.end_ids)
            count = len(context) - start - len(self.start_ids) if thinking else 0
            self.turns[chunk.request_id] = _Turn(budget, thinking, count, recent=context[-self._keep:])
        return self.turns.get(chunk.request_id)

    def may_force(self, chunk: ScheduledChunk) -> bool:
        """Whether the token this chunk samples may be forced once the one before it, not yet taken (the
        step before's sample, still on its way), is: the turn is a token short of its budget or past it."""
        turn = self._turn_for(chunk)
        if turn is None:
            return False
        return turn.count + 1 >= turn.budget if turn.thinking else turn.budget == 0

    def forced_tokens(self, chunks: Sequence[ScheduledChunk], vocab_size: int,
                      grammar: AllowedTokens | None = None) -> AllowedTokens | None:
        """The rows (one per chunk to sample) whose next token is forced, each allowing only that token,
        merged with the grammars' masks: a row whose grammar does not allow its forced token keeps its
        grammar's mask (the grammar decides where the turn goes). None if no row is constrained."""
        masks = {} if grammar is None else dict(zip(grammar.rows, grammar.mask))
        for row, chunk in enumerate(chunks):
            turn = self._turn_for(chunk)
            if turn is None or not turn.thinking or turn.count < turn.budget:
                continue
            token = self.end_ids[turn.forced]
            allowed = masks.get(row)
            if token >= vocab_size or (allowed is not None and not allowed[token]):
                continue
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[token] = True
            masks[row] = mask
        if not masks:
            return None
        rows = sorted(masks)
        return AllowedTokens(rows, torch.stack([masks[r] for r in rows]))

    def take(self, request_id: str, token: int) -> None:
        """The turn's sampled `token` (forced or not), in the order sampled."""
        turn = self.turns.get(request_id)
        if turn is None:
            return
        turn.recent = [*turn.recent, token][-self._keep:]
        if not turn.thinking:
            if turn.recent[-len(self.start_ids):] == self.start_ids:
                turn.thinking, turn.count, turn.forced = True, 0, 0
            return
        if turn.count >= turn.budget and token == self.end_ids[turn.forced]:
            turn.forced += 1  # the forced end marker, token by token
            if turn.forced == len(self.end_ids):
                turn.thinking, turn.forced = False, 0
            return
        if turn.recent[-len(self.end_ids):] == self.end_ids:
            turn.thinking, turn.forced = False, 0  # the model ended its thinking itself
            return
        turn.count += 1

    def free(self, request_id: str) -> None:
        self.turns.pop(request_id, None)
