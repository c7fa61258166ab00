"""One owner of "this turn ended in tool calls": a tool format per chat family, run once, by the engine.

A `ToolFormat` is everything about one chat family's calls: its parser (tool_parsers.py), how a call is
written and prompted, the grammars that force or forbid calls, and what a stream may show while calls
are written. The server asks it for prompts and grammars; the engine judges every turn with it
(`CallJudge`, built from a request's `InterceptParams`) in its output stage, beside the detokenizer and
the stop strings: a turn's calls are parsed once, checked against the request's tools (a known name,
arguments valid under its parameters schema), and the engine pauses only on calls the client can
answer. `RequestOutput.tool_calls` / `.content` carry the verdict; the server only renders it.

Every family the parsers read (hermes, llama3_json, mistral, pythonic, qwen3_coder, glm45, deepseek_v31) is
forced by a grammar, kept from calling by one under tool_choice "none", may answer in JSON or call under a
JSON response_format, and has its grammar-written calls followed while they stream (call_formats.py;
hermes_format.py for Hermes). Templates without a tool section get a Hermes-style tool prompt whatever the family.

On the vLLM backend, a family may also be one of vLLM's own tool parsers (`VllmToolFormat`, family
``vllm:NAME``): vLLM's parser reads the whole turn once it ends, in vLLM's process, and the judge here
checks the calls it found (`tool_parsers.ParsedByVllm`). A forced call is written by a grammar built in
vLLM's process from that parser's structural tag (vllm_backend/tool_calls.py); no grammar forbids calls.

Pure standard library (jsonschema imported when a request's tools are compiled): importable without
torch, so a backend in another process can run the same judge.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import hermes_format as hermes
from .call_formats import writer_for
from .reasoning_parsers import get_reasoning_parser
from .tool_parsers import PARSERS, VLLM_PREFIX, ToolCall, get_tool_parser, vllm_parser_name
from .tool_spec import ToolSpec

# Call markers that are special tokens in some vocabularies: a grammar names them by id (call_formats.py).
MARKER_TOKENS = ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|python_start|>", "<|python_end|>",
                 "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁sep｜>")


@dataclass(frozen=True)
class TurnCalls:
    """The verdict on a turn's tool calls."""

    calls: tuple[ToolCall, ...]  # the valid calls, as the client gets them
    content: str  # the turn's text outside them (the text of calls not kept stays, in place)
    complete: bool  # every call the model wrote is in `calls`: the generation may wait for their results


def _validator(schema: dict) -> Callable[[Any], bool]:
    """Whether arguments validate against `schema`. A schema that is not a valid JSON schema cannot
    judge arguments: its tool still serves (an odd schema is not a reason to refuse a request; a forced
    call of it is refused by the grammar compiler instead), and its calls need only be objects."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    cls = validator_for(schema)
    try:
        cls.check_schema(schema)
    except SchemaError:
        return lambda arguments: isinstance(arguments, dict)
    return cls(schema).is_valid


class ToolFormat:
    """One chat family's tool calls (stateless; one instance serves every request).

    `chat_template` and `token_ids` (the vocabulary's ids of the family's marker tokens) pick how calls
    are written where a family has several forms (Mistral's ``[ARGS]`` form) and let grammars name
    special tokens; `for_tokenizer` reads both from a tokenizer."""

    forces_calls = True  # tool_choice required / named: a prefill and a grammar write the call

    def __init__(self, family: str, chat_template: str | None = None, token_ids: Mapping[str, int] | None = None):
        if vllm_parser_name(family) is not None:
            raise ValueError(f"{family!r} is vLLM's tool parser: VllmToolFormat")
        self.parser = get_tool_parser(family)  # ValueError for an unknown family
        self.family = family
        self.writer = writer_for(family, chat_template, token_ids)
        # Llama's <|python_tag|>, Mistral's [TOOL_CALLS] and pythonic's <|python_start|> are special tokens
        # the parser must see (<tool_call> is text to Hermes and Qwen vocabularies).
        self.keeps_special_tokens = family not in ("hermes", "qwen3_coder")

    @classmethod
    def for_tokenizer(cls, family: str, tokenizer) -> "ToolFormat":
        """The format of `family` as `tokenizer` (Hugging Face's) writes it: its chat template, and the
        ids of the call markers that are tokens of its own."""
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        token_ids = {m: added[m] for m in MARKER_TOKENS if m in added}
        return cls(family, getattr(tokenizer, "chat_template", None), token_ids)

    @property
    def openers(self) -> tuple[str, ...]:
        return self.parser.openers

    # -- the prompt side --
    def forced_prefill(self, tool_name: str | None) -> str:
        """Text that starts a turn that must call `tool_name` (None: any tool), put at the end of its
        prompt: the fixed opening of the call."""
        return self.writer.forced_prefill(tool_name)

    def forced_grammar(self, tools: Sequence[ToolSpec], tool_name: str | None, parallel: bool) -> str | None:
        """Lark grammar of the rest of a forced turn after `forced_prefill(tool_name)`: calls of the
        allowed tools with arguments that follow their schemas (ValueError: a tool this format cannot
        write under a grammar)."""
        return self.writer.forced_grammar(tools, tool_name, parallel)

    def answer_or_call_grammar(self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict) -> str | None:
        """Lark grammar of an auto turn under a JSON response_format: calls of the tools (arguments per
        schema) or a JSON answer that follows `answer_schema`."""
        return self.writer.answer_or_call_grammar(tools, parallel, answer_schema)

    def no_call_grammar(self) -> str | None:
        """Lark grammar of a turn that sees the tools but may not call them: text that never opens a
        call (each format's opening refused, call_formats.py)."""
        return self.writer.no_call_grammar()

    @staticmethod
    def json_grammar_schema(schema: dict) -> dict:
        return hermes.json_grammar_schema(schema)

    @staticmethod
    def prompt_messages(tools: Sequence[ToolSpec]) -> tuple[str, list[dict]]:
        """For a chat template without a tool section: the tool system prompt and example exchanges.
        Hermes-style whatever the family (`parser_for_model` picks hermes for such templates)."""
        return hermes.tool_prompt(tools), hermes.example_exchanges(tools[0])

    @staticmethod
    def call_text(name: str, arguments: Any) -> str:
        """A past call as a template without a tool section shows it."""
        return hermes.call_text(name, arguments)

    # -- the stream side --
    def partial_calls(self, text: str, tools: Sequence[ToolSpec] = ()) -> list[hermes.PartialCall]:
        """Calls a stream may show while they are written, in the form the format's grammars write;
        [] for text in any other form. A complete call's arguments are typed by its tool's schema, as the
        verdict's will be (qwen3_coder's values are text until then)."""
        schemas = {t.name: t.arguments_schema for t in tools}
        return [replace(c, arguments=self.parser.typed(ToolCall(c.name, c.arguments, ""), schemas.get(c.name)).arguments)
                if c.complete else c for c in self.writer.partial_calls(text)]

    def safe_content(self, text: str) -> str:
        """The part of `text` that cannot belong to a tool call: before the first call opener (or a
        trailing piece that may still become one), trailing whitespace held back."""
        return self.writer.safe_content(text)


class VllmToolFormat:
    """One of vLLM's tool parsers as a format (family ``vllm:NAME``), on the vLLM backend: the parser runs in
    vLLM's process on the whole turn once the model ended it (vllm_backend/tool_calls.py). Nothing here
    knows how its calls are written: a forced call (tool_choice required / named) is written by a grammar
    vLLM's process builds from the parser's structural tag, where the parser has one the grammar can
    write (`forcing_refusal` None; otherwise why not, and such turns are refused); no grammar forbids
    calls (a JSON response_format beside tools is refused; tool_choice none only leaves calls unparsed),
    and nothing in the text alone says what of it is content. A stream shows what vLLM's parser, reading
    the turn in vLLM's process as it is written, streams as content (`RequestOutput.streamed_content`,
    as vLLM's chat serving streams it), and the calls once the turn ended and they were judged."""

    keeps_special_tokens = False  # the text the client sees; vLLM's parser decodes the tokens as it needs
    openers: tuple[str, ...] = ()

    def __init__(self, name: str, forcing_refusal: str | None = None):
        self.name = name
        self.family = VLLM_PREFIX + name
        self.forcing_refusal = forcing_refusal

    @property
    def forces_calls(self) -> bool:
        return self.forcing_refusal is None

    def forced_prefill(self, tool_name: str | None) -> str:
        return ""  # the grammar writes the whole call, its opening too

    def forced_grammar(self, tools: Sequence[ToolSpec], tool_name: str | None, parallel: bool) -> None:
        return None  # built where vLLM's parser is, from the turn's rule (vllm_backend/worker.py)

    def answer_or_call_grammar(self, tools: Sequence[ToolSpec], parallel: bool, answer_schema: dict) -> None:
        return None

    def no_call_grammar(self) -> None:
        return None

    json_grammar_schema = staticmethod(ToolFormat.json_grammar_schema)
    prompt_messages = staticmethod(ToolFormat.prompt_messages)
    call_text = staticmethod(ToolFormat.call_text)

    def partial_calls(self, text: str, tools: Sequence[ToolSpec] = ()) -> list:
        return []

    def safe_content(self, text: str) -> str:
        return ""  # (a turn vLLM's parser reads streams its `streamed_content` instead)


def tool_format_for(name: str, tokenizer, vllm_parsers: Sequence[str] = (),
                    vllm_forcing_refusals: Mapping[str, str] | None = None) -> ToolFormat | VllmToolFormat:
    """The format `--tool-parser NAME` serves: ours by that name (hermes, llama3_json, mistral, pythonic,
    qwen3_coder, glm45, glm47, deepseek_v31), else
    vLLM's parser NAME where the backend runs vLLM's parsers (`vllm_parsers`, their names; ``vllm:NAME``
    picks vLLM's where we have one of the same name; `vllm_forcing_refusals`: why those that cannot force
    a call cannot). ValueError naming the valid names otherwise."""
    vllm_name = vllm_parser_name(name) or (name if name not in PARSERS else None)
    if vllm_name is None:
        return ToolFormat.for_tokenizer(name, tokenizer)
    if vllm_name in vllm_parsers:
        return VllmToolFormat(vllm_name, (vllm_forcing_refusals or {}).get(vllm_name))
    ours = ", ".join(sorted(PARSERS))
    if not vllm_parsers:
        raise ValueError(f"unknown tool parser {name!r}: this engine reads {ours}; vLLM's other tool parsers "
                         "(qwen3_coder, kimi_k2, deepseek_v3, ...) run on the vLLM backend only (--backend vllm)")
    raise ValueError(f"unknown tool parser {name!r}: choose one of ours ({ours}) or one of vLLM's "
                     f"({', '.join(sorted(vllm_parsers))})")


class CallJudge:
    """A request's turn rule: when its turn is done, and which of its calls count.

    `tools` None accepts every well-formed call (the engine's own API, benchmarks); otherwise a call must
    name one of them and its arguments must validate. `text_prefix` is read before the generated text:
    the opening of a forced call, which the caller put at the end of the prompt. With a `reasoning`
    parser (reasoning_parsers.py) only the text after the model's thinking is read: a call written
    while thinking is not one, and the verdict's content leaves the thinking out."""

    def __init__(self, family: str, tools: Sequence[ToolSpec] | None = None, parallel: bool = True,
                 text_prefix: str = "", reasoning: str | None = None):
        self.parser = get_tool_parser(family)
        self.validators = None if tools is None else {t.name: _validator(t.arguments_schema) for t in tools}
        self.schemas = None if tools is None else {t.name: t.arguments_schema for t in tools}
        self.parallel = parallel
        self.text_prefix = text_prefix
        self.reasoning = get_reasoning_parser(reasoning) if reasoning is not None else None

    def _read(self, text: str) -> str:
        if self.reasoning is not None:
            text = self.reasoning.content(text)
        return self.text_prefix + text

    def turn_done(self, text: str) -> bool:
        """The parser's pause rule: a call is closed and the model has moved past it (tool_parsers.py)."""
        return self.parser.turn_done(self._read(text))

    def judge(self, text: str) -> TurnCalls | None:
        """The verdict on the turn's text so far; None when it holds no well-formed call at all."""
        text = self._read(text)
        parsed = self.parser.parse(text, self.schemas)
        if not parsed.tool_calls:
            return None
        valid = [c for c in parsed.tool_calls if self._valid(c)]
        kept = valid if self.parallel else valid[:1]
        if len(kept) == len(parsed.tool_calls):
            content = parsed.content
        else:  # take out the kept calls only: the text of the others stays in place
            content = text
            for call in kept:
                content = content.replace(call.raw, "", 1)
            content = content.strip()
        return TurnCalls(tuple(kept), content, complete=len(kept) == len(parsed.tool_calls))

    def _valid(self, call: ToolCall) -> bool:
        if self.validators is None:
            return True
        validate = self.validators.get(call.name)
        return validate is not None and validate(json.loads(call.arguments))
