"""vLLM's own tool parsers (`vllm serve --tool-call-parser NAME`), run by the worker on a turn once it ended.

Run by the vLLM environment's python (worker.py), where vLLM's parsers and the model's tokenizer are
importable; imports only the standard library and vllm. A turn whose calls one of vLLM's parsers reads
carries its rule (`CallRule`, plain data from the backend: the parser's name, the request's tools, the
reasoning parser whose thinking comes first); when vLLM ends the turn (the model's EOS or stop token,
its length, a stop string), the worker decodes the turn's tokens and the parser reads them as vLLM's
chat serving reads a finished turn (`Parser.parse`, tool_choice auto): the calls it found (name,
arguments JSON, id) and the content outside them go to the backend with the turn's last output, and the
backend's output stage judges them (known tool, valid arguments) and pauses or finishes the turn.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("infercept.vllm_worker")


def registered() -> list[str]:
    """The names of every tool parser this vLLM has (`ToolParserManager`: vLLM's own and plugins')."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


@dataclass(frozen=True)
class CallRule:
    """What reads a turn's calls: vLLM's parser `parser`, over the request's `tools` (OpenAI's function-tool
    objects), after the thinking as vLLM's reasoning parser `reasoning` splits it (None: no thinking)."""

    parser: str
    tools: tuple[dict, ...]
    reasoning: str | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "CallRule":
        return cls(d["parser"], tuple(d["tools"]), d.get("reasoning"))


class VllmToolCalls:
    """vLLM's parsers over the model's tokenizer, as vLLM's OpenAI server composes them (`ParserManager`).
    `is_harmony`: a gpt-oss model, whose turns vLLM reads with its Harmony parser whatever the name."""

    def __init__(self, tokenizer, model: str, is_harmony: bool = False):
        self.tokenizer = tokenizer
        self.model = model
        self.is_harmony = is_harmony
        self._classes: dict[tuple[str, str | None], type] = {}

    def check(self, name: str) -> None:
        """ValueError, before anything is served, for a name vLLM does not know or a parser the tokenizer
        lacks the tokens of (vLLM's own start-up check)."""
        names = registered()
        if name not in names:
            raise ValueError(f"unknown tool parser {name!r}; vLLM's are: {', '.join(names)}")
        try:
            self._parser_class(name, None)
        except TypeError as e:
            raise ValueError(str(e)) from None

    def _parser_class(self, name: str, reasoning: str | None) -> type:
        key = (name, reasoning)
        if key not in self._classes:
            from vllm.parser.parser_manager import ParserManager

            self._classes[key] = ParserManager.get_parser(
                tool_parser_name=name, reasoning_parser_name=reasoning, enable_auto_tools=True,
                model_name=self.model, is_harmony=self.is_harmony, tokenizer=self.tokenizer)
        return self._classes[key]

    def parse(self, rule: CallRule, token_ids: list[int], finish_reason: str | None, stop_reason) -> dict:
        """The turn's calls ([name, arguments JSON, id] each) and its content as vLLM's parser reads them.
        `token_ids`: the turn's tokens as vLLM generated them (a stop token last, if one ended it); the
        text is decoded as vLLM's detokenizer writes it (without that stop token, cut before a stop
        string), special tokens kept where the parser asks for them (its `adjust_request`)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(messages=[], model=self.model, tools=list(rule.tools) or None,
                                        tool_choice="auto")
        parser = self._parser_class(rule.parser, rule.reasoning)(self.tokenizer, request.tools)
        request = parser.adjust_request(request)
        ends_with_stop_token = finish_reason == "stop" and not isinstance(stop_reason, str) and token_ids
        text = self.tokenizer.decode(token_ids[:-1] if ends_with_stop_token else token_ids,
                                     skip_special_tokens=request.skip_special_tokens)
        if isinstance(stop_reason, str) and stop_reason in text:
            text = text[:text.index(stop_reason)]
        try:
            _, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=token_ids)
        except Exception:  # a parser's fault is no call: the turn's text is its answer
            logger.exception("vLLM's tool parser %r failed on a turn; it is read as text", rule.parser)
            return {"calls": [], "content": None}
        return {"calls": [[c.name, c.arguments, c.id] for c in calls or []], "content": content}
