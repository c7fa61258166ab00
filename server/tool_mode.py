"""What a chat turn asks of its tools: the tools it sees and whether it may, must or must not call
them (`ToolMode`), and the grammar that enforces that (`with_grammar`).

`tool_choice` "none" keeps the tools in the prompt (as vLLM does), so an agent's last, answering step
renders the same prefix as its calling steps and resumes or reuses it; a grammar then keeps the turn
from opening a call (every tool format has one: engine/call_formats.py).

`response_format` json_object / json_schema constrains the answer (a turn without tool calls) to a
JSON object / to JSON that follows the schema: with no tools or tool_choice "none", the turn is that
JSON; with "auto", it is either calls or that JSON, the model chooses; a forced turn is calls only, so
the format has nothing to constrain there. A regex / choice (server/structured.py) is the whole
output, so its turn has no calls to allow: its grammar alone constrains it.

A structured answer (`ToolMode.answer`) is a turn whose request has exactly one tool, a tool_choice that
names it and `parallel_tool_calls: false`: what LangChain's `with_structured_output(method=
"function_calling")` sends, where the tool is the answer's schema, not a step of an agent loop, and no
result comes back for its call. It ends at the call instead of pausing, its KV left to the prefix cache
like any finished request's. Without `parallel_tool_calls: false` the same request is taken for a forced
step of a one-tool agent loop and pauses, as do "required" with one tool and a name among several tools;
so do a forced call of a tool the server runs itself and any turn of a named chat session (`session_id`),
which its client may continue with only the tool results (turns.py applies the rule).
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from infercept.engine.backend import GRAMMAR_ENDS_THE_OUTPUT, GuidedDecodingParams, SamplingParams, ToolFormat, ToolSpec

from .protocol import bad_request
from .structured import OutputConstraint


@dataclass
class ToolMode:
    tools: list[ToolSpec] | None  # rendered into the prompt
    parse: bool  # turns may end in tool calls (with tools but not this: tool_choice "none")
    forced: bool = False  # a call is required (tool_choice "required" or named)
    forced_name: str | None = None  # named tool_choice
    parallel: bool = True
    answer: bool = False  # a structured answer: its call ends the turn instead of pausing it


def with_grammar(fmt: ToolFormat, params: SamplingParams, mode: ToolMode, answer_schema: dict | None,
                 guided_decoding: bool = True, thinking: bool = False, answer_param: str = "response_format",
                 constraint: OutputConstraint | None = None) -> SamplingParams:
    """The turn's params constrained by its grammar, if it has one (see `turn_grammar`). Without
    `guided_decoding` (a backend that has none), tool_choice none goes unconstrained, as in formats
    without that grammar: a call the model writes anyway stays content. So does a `thinking` model's
    (--reasoning-parser): the no-call grammar refuses a turn that opens with "<", its <think> too."""
    if constraint is not None:  # a regex / choice: the front end refused turns that may call tools
        return constrained(params, constraint.guided, constraint.param)
    grammar = turn_grammar(fmt, params, mode, answer_schema, guided_decoding and not thinking, answer_param)
    if grammar is None:
        if mode.forced and params.holds_back_the_end:  # a forced call whose grammar vLLM's worker builds
            raise bad_request(f"tool_choice asks for a grammar-constrained turn: {GRAMMAR_ENDS_THE_OUTPUT}",
                              param="tool_choice")
        return params
    return constrained(params, *grammar)


def constrained(params: SamplingParams, guided: GuidedDecodingParams, param: str) -> SamplingParams:
    """`params` under the grammar `param` asked for (400 where the sampling cannot follow one)."""
    try:
        return replace(params, guided=guided)
    except ValueError as e:  # min_tokens / ignore_eos, which hold back the end a grammar decides
        raise bad_request(f"{param} asks for a grammar-constrained turn: {e}", param=param) from None


def turn_grammar(fmt: ToolFormat, params: SamplingParams, mode: ToolMode, answer_schema: dict | None,
                 guided_decoding: bool = True,
                 answer_param: str = "response_format") -> tuple[GuidedDecodingParams, str] | None:
    """The grammar of the turn and the request field that asks for it; None: the model writes freely.
    `answer_param` names the field of the JSON answer (response_format; text.format on Responses).

    forced calls -> the calls grammar (an answer never comes, so response_format has no say);
    auto + JSON answer -> calls or that JSON; JSON answer alone (no tools, or tool_choice none)
    -> that JSON; tool_choice none -> text that never opens a call."""
    if mode.forced:
        lark, param = _written(lambda: fmt.forced_grammar(mode.tools, mode.forced_name, mode.parallel)), "tool_choice"
    elif mode.parse and answer_schema is not None:
        lark, param = _written(lambda: fmt.answer_or_call_grammar(mode.tools, mode.parallel, answer_schema)), \
            answer_param
        if lark is None:
            raise bad_request(f"{answer_param} json_object/json_schema with tools and tool_choice auto cannot be "
                              f"enforced in this model's tool-call format ({fmt.family}); send "
                              "tool_choice none for a JSON answer", param=answer_param)
    elif answer_schema is not None:
        return (_compile(answer_param, json_schema=fmt.json_grammar_schema(answer_schema)), answer_param)
    elif mode.tools is not None and not mode.parse and guided_decoding and not params.holds_back_the_end:
        # tool_choice none; with vLLM's min_tokens / ignore_eos the turn must not end where it wants,
        # which a grammar cannot combine with, so there it stays unconstrained (a call is content).
        lark, param = fmt.no_call_grammar(), "tool_choice"
    else:
        return None
    return None if lark is None else (_compile(param, lark=lark, tools=mode.tools), param)


def _written(build) -> str | None:
    """A tool format's grammar; 400 where the format cannot write the tools' calls under a grammar (a
    pythonic call of a parameter that is no Python identifier, say)."""
    try:
        return build()
    except ValueError as e:
        raise bad_request(f"the tools' calls cannot be enforced in this model's tool-call format: {e}",
                          param="tools") from None


def _compile(param: str, tools: list[ToolSpec] | None = None, **grammar) -> GuidedDecodingParams:
    try:
        return GuidedDecodingParams(**grammar)
    except ValueError as e:  # a schema feature the grammar compiler does not support
        for tool in tools or ():  # name the tool at fault, rather than the whole grammar's listing
            try:
                if tool.parameters is not None:
                    GuidedDecodingParams(json_schema=dict(tool.parameters))
            except ValueError as fault:
                raise bad_request(f"tool {tool.name!r}: its parameters cannot be enforced: {fault}",
                                  param="tools") from None
        what = (f"the {param} schema (or, with tool_choice auto, a tool's parameters)"
                if param != "tool_choice" else "the tools' parameters")
        raise bad_request(f"{what} cannot be enforced: {e}",
                          param="tools" if param == "tool_choice" else param) from None


def tool_mode(tools: list[ToolSpec] | None, choice: str | None, parallel: bool = True,
              server_tools: Collection[str] = ()) -> ToolMode:
    """The turn's tools and whether it may, must or must not call them. `choice`: None, "none", "auto",
    "required" or the name of the one tool to call (400 on contradictions). `server_tools`: the names of
    the tools the server runs itself (their results do come back, so forcing one is no answer)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice requires tools", param="tool_choice")
        return ToolMode(None, False)
    if len({t.name for t in tools}) != len(tools):
        raise bad_request("tool names must be unique", param="tools")
    if choice == "none":  # still rendered: the prompt stays the one the other steps of the loop share
        return ToolMode(tools, False)
    if choice in (None, "auto"):
        return ToolMode(tools, True, parallel=parallel)
    if choice == "required":
        return ToolMode(tools, True, forced=True, parallel=parallel)
    if choice not in {t.name for t in tools}:
        raise bad_request(f"tool_choice names {choice!r}, which is not in tools", param="tool_choice")
    answer = len(tools) == 1 and not parallel and choice not in server_tools
    return ToolMode(tools, True, forced=True, forced_name=choice, parallel=False, answer=answer)
