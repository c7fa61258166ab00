"""Structured outputs that are not JSON: vLLM's `structured_outputs` regex / choice, on Chat Completions,
Completions and Responses (and, on the first two, its older spellings `guided_regex` / `guided_choice`).

The constraint covers the whole output of the turn, so it is compiled here, once, into the grammar the
engine enforces (engine/guided_decoding.py: llguidance), and a bad regex is a 400 that names its field
before anything runs. What cannot hold together with it -- tool calls, a JSON response_format -- is
refused by the front end (`check_without_calls`).
"""
from __future__ import annotations

from dataclasses import dataclass

from infercept.engine.backend import GuidedDecodingParams

from .protocol import SamplingFields, SamplingKnobs, bad_request


@dataclass(frozen=True)
class OutputConstraint:
    """The grammar the whole output must match, and the request field that asked for it."""

    guided: GuidedDecodingParams
    param: str


def output_constraint(req: SamplingKnobs) -> OutputConstraint | None:
    """The request's regex / choice constraint, compiled (400 on a bad one or on more than one)."""
    fields = [("structured_outputs", *_structured(req))]
    if isinstance(req, SamplingFields):
        fields += [("guided_regex", req.guided_regex, None), ("guided_choice", None, req.guided_choice)]
    asked = [(param, regex, choice) for param, regex, choice in fields if regex is not None or choice is not None]
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(f"give one of structured_outputs, guided_regex and guided_choice, not "
                          f"{' and '.join(a[0] for a in asked)}", param=asked[1][0])
    param, regex, choice = asked[0]
    try:
        guided = GuidedDecodingParams(regex=regex, choice=tuple(choice) if choice is not None else None)
    except ValueError as e:  # a regex feature the grammar compiler does not support (look-around, ...)
        raise bad_request(f"{param} cannot be enforced: {e}", param=param) from None
    return OutputConstraint(guided, param)


def _structured(req: SamplingKnobs) -> tuple[str | None, list[str] | None]:
    so = req.structured_outputs
    return (None, None) if so is None else (so.regex, so.choice)


def check_without_calls(constraint: OutputConstraint | None, may_call: bool, json_param: str | None) -> None:
    """A regex or choice is the whole output: a turn that may end in tool calls, or whose answer must
    also be JSON (the field `json_param` asks for it: response_format, text.format), could not follow
    both, so such a request is a 400."""
    if constraint is None:
        return
    if may_call:
        raise bad_request(f"{constraint.param} constrains the whole output, so the turn cannot also make tool "
                          "calls; send tool_choice none or no tools", param=constraint.param)
    if json_param is not None:
        raise bad_request(f"{constraint.param} and a JSON {json_param} both constrain the whole output; "
                          "give one of them", param=constraint.param)
