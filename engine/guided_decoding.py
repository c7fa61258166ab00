"""Guided decoding: a request's generated tokens stay inside its grammar (llguidance).

One `GuidedDecoder` per engine, owned by the model runner. Each step, for the rows it samples:

    rows with a grammar --> matcher.compute mask --> bitmask [R, ceil(V/32)] int32 --> bool [R, V]
    sampler: logits of disallowed tokens = -inf, then greedy / top-k / top-p as usual
    sampled token --> matcher.consume_token

Requests without a grammar cost nothing: no mask is built unless some row to sample has one.

**Turns.** A grammar constrains what a request generates in one turn. A resumed request's next turn
starts after appended tokens (tool results: prompt, not generated), so it starts a *fresh* matcher,
from the new turn's params (the same grammar, another one, or none). A matcher is therefore created
at the first sample of a turn (the request has no output tokens in the turn yet). Preemption and
recompute keep the matcher: it has consumed exactly the turn's output tokens, which recompute does not
change. A matcher is freed when its request finishes or is aborted, when its grammar ended
(end-of-sequence consumed), or when the next turn replaces it.

**Errors.** A grammar is compiled and checked when its `SamplingParams` is made (`sampling_params.compile_grammar`), so
bad grammars are refused up front. A matcher that still fails mid-turn (a parser limit) allows only
end-of-sequence from then on: the turn ends rather than leaving the grammar.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch

from .outputs import SampledToken, ScheduledChunk
from .sampler import AllowedTokens

logger = logging.getLogger("infercept.engine")

_BIT = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bits: [R, W] int32, bit j of word w = token 32*w + j allowed -> [R, vocab_size] bool.
    Token ids the tokenizer does not have (a model vocabulary padded past it) are disallowed."""
    allowed = ((bits.unsqueeze(-1) >> _BIT) & 1).bool().view(bits.shape[0], -1)  # [R, 32*W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    padding = torch.zeros(bits.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, padding], dim=1)


class GuidedDecoder:
    """The llguidance tokenizer of one engine and the matchers of its guided requests."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int]):
        self.hf_tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self.matchers: dict[str, llguidance.LLMatcher] = {}

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        # Built on the first guided request (about half a second), then shared by all of them.
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def allowed_tokens(self, chunks: Sequence[ScheduledChunk], vocab_size: int) -> AllowedTokens | None:
        """Masks for the chunks (one per row to sample) whose request has a grammar; None if none has."""
        rows, matchers = [], []
        for row, chunk in enumerate(chunks):
            matcher = self._matcher_for(chunk)
            if matcher is not None:
                rows.append(row)
                matchers.append(matcher)
        if not rows:
            return None
        words = (self.ll_tokenizer.vocab_size + 31) // 32
        bits = torch.zeros(len(rows), words, dtype=torch.int32)  # [R, W]
        for i, matcher in enumerate(matchers):
            if matcher.is_error():
                for eos in self.eos_token_ids:
                    bits[i, eos // 32] |= 1 << (eos % 32)
            else:
                matcher.unsafe_compute_mask_ptr(bits[i].data_ptr(), words * 4)
        return AllowedTokens(rows, unpack_bitmask(bits, vocab_size))

    def accept(self, chunks: Sequence[ScheduledChunk], tokens: Sequence[SampledToken]) -> None:
        """Advance the matchers of the sampled rows by their tokens."""
        for chunk, token in zip(chunks, tokens):
            matcher = self.matchers.get(chunk.request_id)
            if matcher is None or matcher.is_error():
                continue
            if not matcher.consume_token(token.token_id):
                logger.warning("request %s left its grammar: %s", chunk.request_id, matcher.get_error())
            elif token.token_id in self.eos_token_ids:
                del self.matchers[chunk.request_id]

    def free(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def _matcher_for(self, chunk: ScheduledChunk) -> llguidance.LLMatcher | None:
        guided = chunk.sampling_params.guided
        if guided is None:
            self.matchers.pop(chunk.request_id, None)  # a resumed turn without the previous grammar
            return None
        if chunk.num_output_tokens == 0:  # the first token of a turn: its grammar starts here
            self.matchers[chunk.request_id] = llguidance.LLMatcher(self.ll_tokenizer, guided.grammar)
        return self.matchers.get(chunk.request_id)
