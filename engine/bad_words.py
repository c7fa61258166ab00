"""vLLM's `bad_words` (SamplingParams.bad_words): words a turn's output never contains.

Each word is forbidden as vLLM tokenizes it: as written (its leading spaces dropped) and, where a space
before it gives another first token but as many tokens, after a space too (a word mid-sentence). A
word's last token is forbidden wherever the turn's output so far ends with the tokens before it, so a
word of one token is never sampled at all; the prompt does not count.
"""
from __future__ import annotations

from collections.abc import Sequence


def word_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The token sequences `words` forbid."""
    sequences = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"the bad word {word!r} tokenizes to no token")
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return sequences


def forbidden_next(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete one of `sequences` after `output`, the turn's tokens so far."""
    forbidden = []
    for sequence in sequences:
        before = len(sequence) - 1
        if before > len(output):
            continue
        if before == 0 or list(output[len(output) - before:]) == list(sequence[:-1]):
            forbidden.append(sequence[-1])
    return forbidden
