"""vLLM's own tool parsers (`vllm serve --tool-call-parser NAME`), run by the worker on a turn as it is
written and once it ended.

Run by the vLLM environment's python (worker.py), where vLLM's parsers and the model's tokenizer are
importable; imports only the standard library, vllm and two standard-library modules of ours
(../detokenizer.py, structural_tag_lark.py). A turn whose
calls one of vLLM's parsers reads carries its rule (`CallRule`, plain data from the backend: the parser's
name, the request's tools, the reasoning parser whose thinking comes first). While the model writes it, a
parser of its own reads each output as vLLM's chat serving streams a turn (`ContentStream`:
`Parser.parse_delta`, tool_choice auto), and the content it streams (text outside any call, after the
thinking) goes to the backend with each output; its calls do not. When vLLM ends the turn (the model's
EOS or stop token, its length, a stop string), the worker decodes the turn's tokens and a parser reads
them as vLLM's chat serving reads a finished turn (`Parser.parse`): the calls it found (name, arguments
JSON, id) and the content outside them go to the backend with the turn's last output, and the backend's
output stage judges them (known tool, valid arguments) and pauses or finishes the turn.

A turn that must call (tool_choice required, or naming a tool) is written under a grammar of the calls in
the model's own format: the structural tag vLLM's parser builds for that tool_choice (its
`adjust_request`, as vLLM's chat serving asks it), written for llguidance (structural_tag_lark.py).
Parsers without a structural tag (vLLM would force a JSON list of calls, not the model's format) or
whose tag the grammar cannot write cannot force a call (`forcing_refusals`).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from ..detokenizer import IncrementalDetokenizer
from .structural_tag_lark import structural_tag_lark

logger = logging.getLogger("infercept.vllm_worker")


def registered() -> list[str]:
    """The names of every tool parser this vLLM has (`ToolParserManager`: vLLM's own and plugins')."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


# A tool every format can call, to find which parsers' structural tags a grammar writes.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}


def forcing_refusals() -> dict[str, str]:
    """Why each of vLLM's tool parsers that cannot force a call in its model's format cannot (by name);
    the others force tool_choice required and named calls (`VllmToolCalls.forced_grammar`)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag

    tools = ChatCompletionRequest(messages=[], model="", tools=[_PROBE_TOOL]).tools
    refusals = {}
    for name in registered():
        try:
            model = ToolParserManager.get_tool_parser(name).structural_tag_model
            if model is None:
                raise ValueError("it has no structural tag for its calls (vLLM would force them as a JSON list, "
                                 "not in the model's own format)")
            tag = get_model_structural_tag(model, tools, "required", reasoning=False)
            structural_tag_lark(tag.model_dump()["format"], {})
        except Exception as e:  # a parser vLLM cannot load here is refused with its reason too
            refusals[name] = str(e)
    return refusals


@dataclass(frozen=True)
class CallRule:
    """What reads a turn's calls: vLLM's parser `parser`, over the request's `tools` (OpenAI's function-tool
    objects), after the thinking as vLLM's reasoning parser `reasoning` splits it (None: no thinking).
    `forced`: the turn must call ("required", or the name of the tool it must call; None: it may);
    `parallel`: it may call more than once."""

    parser: str
    tools: tuple[dict, ...]
    reasoning: str | None = None
    forced: str | None = None
    parallel: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "CallRule":
        return cls(d["parser"], tuple(d["tools"]), d.get("reasoning"), d.get("forced"), d.get("parallel", True))

    @property
    def tool_choice(self) -> str | dict:
        """The forced turn's tool_choice as a chat completion request writes it."""
        if self.forced == "required":
            return "required"
        return {"type": "function", "function": {"name": self.forced}}


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

    def _parser(self, rule: CallRule, **forcing):
        """A parser of the rule's (one per turn read: vLLM's parsers keep a stream's state) and the
        request it reads with, as its `adjust_request` left it (skip_special_tokens: whether the text
        it reads keeps the special tokens). A turn is read as under tool_choice auto, forced or not (a
        forced call is written as the model writes its calls); `forcing` (tool_choice,
        parallel_tool_calls) asks for the structural tag of a forced turn instead."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(messages=[], model=self.model, tools=list(rule.tools) or None,
                                        **{"tool_choice": "auto"} | forcing)
        parser = self._parser_class(rule.parser, rule.reasoning)(self.tokenizer, request.tools)
        return parser, parser.adjust_request(request)

    def forced_grammar(self, rule: CallRule) -> str:
        """The Lark grammar of a forced turn (`rule.forced`): its calls as the structural tag vLLM's parser
        builds for that tool_choice writes them (ValueError: the parser has none, or the grammar cannot
        write it)."""
        _, request = self._parser(rule, tool_choice=rule.tool_choice, parallel_tool_calls=rule.parallel)
        tag = request.structured_outputs.structural_tag if request.structured_outputs is not None else None
        if tag is None:
            raise ValueError(f"vLLM's tool parser {rule.parser!r} builds no structural tag to force its calls")
        return structural_tag_lark(json.loads(tag)["format"], self.special_tokens)

    @property
    def special_tokens(self) -> dict[str, int]:
        """The vocabulary's special tokens by their text (a forced grammar names them by id)."""
        return {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}

    def stream(self, rule: CallRule, prompt_token_ids: list[int]) -> "ContentStream":
        """vLLM's parser reading a turn as it is written. `prompt_token_ids`: the tokens before the turn
        as this vLLM request got them (a session's resume: the chunk that resumed it), where its reasoning
        parser finds whether the prompt already closed the thinking (a template that turns it off)."""
        parser, request = self._parser(rule)
        return ContentStream(parser, request, self.tokenizer, prompt_token_ids, rule.parser)

    def parse(self, rule: CallRule, token_ids: list[int], finish_reason: str | None, stop_reason) -> dict:
        """The turn's calls ([name, arguments JSON, id] each) and its content as vLLM's parser reads them.
        `token_ids`: the turn's tokens as vLLM generated them (a stop token last, if one ended it); the
        text is decoded as vLLM's detokenizer writes it (without that stop token, cut before a stop
        string), special tokens kept where the parser asks for them (its `adjust_request`)."""
        parser, request = self._parser(rule)
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


class ContentStream:
    """One turn read by vLLM's parser as it is written, as vLLM's chat serving streams a turn: each output's
    tokens, decoded as `VllmToolCalls.parse` decodes the whole turn (`tokenizer.decode`, special tokens as
    the parser asks), go to `Parser.parse_delta`, which says what of them is content; `add` returns that
    content. The calls it reads are not taken: they count once the whole turn is parsed and judged. A
    parser's fault ends the stream (nothing more is content until the turn's end), never the turn."""

    def __init__(self, parser, request, tokenizer, prompt_token_ids: list[int], name: str):
        self.parser, self.request, self.name = parser, request, name
        self.prompt_token_ids: list[int] | None = prompt_token_ids  # read with the first output only
        # The turn's tokens, decoded as they come; no prompt tokens lead the window: the whole-turn parse
        # decodes the turn's tokens alone. (Stop strings are the backend's: none here.)
        self.detok = IncrementalDetokenizer(tokenizer, [], request.skip_special_tokens, [])
        self.failed = False

    @property
    def token_ids(self) -> list[int]:
        """The turn's tokens so far (those of every output `add` read)."""
        return self.detok.ids

    def add(self, token_ids: list[int]) -> str:
        """The content the parser streams for an output of the turn (not its last: the whole-turn parse
        reads that one)."""
        written = len(self.detok.text)
        for token_id in token_ids:
            self.detok.add(token_id)
        if self.failed:
            return ""
        try:
            delta = self.parser.parse_delta(self.detok.text[written:], list(token_ids), self.request,
                                            self.prompt_token_ids, finished=False)
        except Exception:
            logger.exception("vLLM's tool parser %r failed streaming a turn; its content shows at its end", self.name)
            self.failed = True
            return ""
        self.prompt_token_ids = None
        return (delta.content or "") if delta is not None else ""
