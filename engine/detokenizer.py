"""Incremental detokenization and stop strings.

Decoding a growing token list one token at a time is subtle: a token may be half of a UTF-8
character, and SentencePiece tokenizers drop a word's leading space when it is decoded alone. Where
the tokenizer has a `tokenizers` backend (every fast tokenizer), its `DecodeStream` does this in Rust,
one call a token, seeded with the prompt's last tokens. Elsewhere (a tokenizer of another library) we
decode a short window of preceding tokens with the new ones and emit only the text that the window
does not already explain, holding back while the text ends in a replacement character: two decodes of
the window a token, several times the cost, which on a GPU is host time in every step.
"""
from __future__ import annotations

# Tokens of the prompt decoded with the first outputs, for SentencePiece's leading-space rule.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 keep_stop: bool = False):
        """`keep_stop`: the text ends with the stop string that ended it (else just before it)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.keep_stop = keep_stop
        self._backend, self._stream = self._decode_stream()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_stream(self):
        """(the tokenizers backend, a DecodeStream that has read the prompt's tail) or (None, None)."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if type(backend).__module__.split(".")[0] != "tokenizers":
            return None, None
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        # Up to the tail's last whole character: bytes of a cut one would come out with the first output.
        tail = self.ids
        while tail and self._decode(tail).endswith(REPLACEMENT):
            tail = tail[:-1]
        for token_id in tail:
            stream.step(backend, token_id)
        return backend, stream

    def _new_text(self, token_id: int) -> str | None:
        """The text `token_id` completes (None while it ends inside a character)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or None
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def add(self, token_id: int) -> str | None:
        """Append one generated token; returns the stop string it completed, if any."""
        self.ids.append(token_id)
        delta = self._new_text(token_id)
        if delta is None:
            return None
        search_from = max(len(self.text) - self.max_stop_len + 1, 0)
        self.text += delta
        # The stop string that appears first in the text wins, whatever its place in the list.
        found = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) >= 0]
        if not found:
            return None
        at, stop = min(found)
        self.text = self.text[:at + len(stop) if self.keep_stop else at]
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, hold back a tail that could still become a stop string."""
        if finished or not self.max_stop_len:
            return self.text
        return self.text[:max(len(self.text) - self.max_stop_len + 1, 0)]
