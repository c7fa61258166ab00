"""Reasoning parsers: a thinking model's turn split into its reasoning and the text after it.

Qwen3 and DeepSeek-R1 think in ``<think> ... </think>`` before they answer or call a tool. A reasoning
parser (``--reasoning-parser``, vLLM's names) splits a turn's text so that

* the front ends show the thinking apart (chat: ``reasoning_content``; Responses: a ``reasoning`` item)
  and the answer as the content;
* tool-call parsing reads only the text after ``</think>`` (`CallJudge`): a ``<tool_call>`` the model
  writes while thinking is not a call, and a turn still thinking has no calls yet.

The two parsers differ in where the thinking starts:

    qwen3        the turn thinks when it starts (after blanks) with <think>; otherwise it is all content
    deepseek_r1  the turn starts thinking (its <think> may be in the prompt): everything up to the first
                 </think> is reasoning, and a turn that never closes it is all reasoning

and a qwen3 turn whose prompt ends with <think> (the template opened the thinking) is read as deepseek_r1
reads every turn (`after_prompt`).

`split(text, final=False)` is what a stream may show of a turn written so far: a trailing piece that
may still become ``</think>`` (or, at the start, ``<think>``) is held back, as are the newlines the
final split strips, so what a stream showed is always a prefix of the final split.

Pure standard library, like tool_parsers.py: the engine's output stage and the server both use it.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the turn did not think
    content: str  # the text after the thinking: the answer, or the tool calls


def _held_back(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with (it may still become one)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """One model family's thinking (stateless: one instance serves every request)."""

    name = ""
    starts_thinking = False  # the turn thinks from its first token, with or without <think>

    def split(self, text: str, final: bool = True) -> ReasoningSplit:
        body = text.lstrip()
        if not final and THINK_START.startswith(body) and body != THINK_START:  # "", "<thi": maybe the opening
            return ReasoningSplit("" if self.starts_thinking else None, "")
        if body.startswith(THINK_START):
            body = body[len(THINK_START):]
        elif not self.starts_thinking:
            return ReasoningSplit(None, text)
        end = body.find(THINK_END)
        if end >= 0:
            return ReasoningSplit(body[:end].strip("\n"), body[end + len(THINK_END):].lstrip())
        if final:  # the turn ended while thinking (max_tokens): no answer
            return ReasoningSplit(body.strip("\n"), "")
        body = body[:len(body) - _held_back(body, THINK_END)]
        return ReasoningSplit(body.lstrip("\n").rstrip("\n"), "")

    def after_prompt(self, prompt_end: str) -> ReasoningParser:
        """The parser of a turn whose prompt ends with `prompt_end`: a template that opens the thinking in
        the generation prompt (Qwen3's thinking-only models, DeepSeek-R1-0528) leaves the turn thinking
        from its first token, without a <think> of its own."""
        if not self.starts_thinking and prompt_end.rstrip().endswith(THINK_START):
            return DeepSeekR1ReasoningParser()
        return self

    def content(self, text: str) -> str:
        """The text tool-call parsing reads: what comes after the thinking ("" while it is not over)."""
        return self.split(text).content


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_thinking = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    # vLLM's names for GLM-4.5 to 4.7, which think as Qwen3 does: a turn that starts with <think> (4.5, 4.6),
    # or after a generation prompt that opens it (4.7); with thinking off the prompt closes it, all content
    "glm45": Qwen3ReasoningParser,
    "glm47": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}") \
            from None
