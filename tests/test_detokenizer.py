"""Incremental detokenization: the `tokenizers` DecodeStream path (every fast tokenizer) and the window
path (tokenizers of other libraries) give the same text and stop strings, token by token, as decoding the
whole output would."""
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from infercept.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! 你好，世界 🎉🎉 naïve café", "<|im_start|>assistant\n<tool_call>{\"a\": 1}</tool_call><|im_end|>",
         "  leading spaces\n\n\ttabs", "emoji 👩‍👩‍👧 done"]


class WithoutBackend:
    """A tokenizer of another library: `decode` only, so the window path runs."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def outputs(tokenizer, prompt, ids, skip, stop):
    detok = IncrementalDetokenizer(tokenizer, prompt, skip, stop)
    stops = [detok.add(t) for t in ids]
    return detok, stops


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def test_the_stream_and_the_window_agree(tokenizer):
    """Texts with multi-byte characters and special tokens, and random ids (byte-level pieces that cut
    characters), after whole prompts and prompts cut short (some inside a character), with and without
    special tokens, with stop strings: the same text and the same stops either way; for a text whose
    tokens are whole characters, the text decoded at once."""
    rng = random.Random(0)
    for trial in range(120):
        ids = (tokenizer.encode(rng.choice(TEXTS) + " " + rng.choice(TEXTS), add_special_tokens=False)
               if trial % 3 else [rng.randrange(tokenizer.vocab_size) for _ in range(30)])
        prompt = tokenizer.encode(rng.choice(TEXTS))
        prompt = prompt[:rng.randrange(1, len(prompt) + 1)] if trial % 2 else prompt  # cut, maybe inside a character
        skip = bool(trial % 4 // 2)
        stop = ["done", "}"] if trial % 5 == 0 else []
        stream, stream_stops = outputs(tokenizer, prompt, ids, skip, stop)
        window, window_stops = outputs(WithoutBackend(tokenizer), prompt, ids, skip, stop)
        assert stream._stream is not None and window._stream is None
        assert (stream.text, stream_stops) == (window.text, window_stops), (trial, ids, prompt)
        if trial % 3 and not stop:
            assert stream.text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_word_after_the_prompt_keeps_its_leading_space():
    """SentencePiece-style tokenizers (Metaspace) drop a word's leading space when it is decoded alone:
    the first output after the prompt is decoded after the prompt's last tokens, on both paths."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tokenizer.decode([2]) == "world"  # alone: no space
    for tok in (tokenizer, WithoutBackend(tokenizer)):
        detok, _ = outputs(tok, [1], [2, 3, 2], False, [])
        assert detok.text == " world! world"
