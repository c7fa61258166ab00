"""A forced tool-call turn's structural tag, as vLLM's tool parsers build it (xgrammar's format tree: a
tag per allowed tool, in the model's own call format), written as an llguidance Lark grammar.

vLLM runs one structured-outputs backend per engine, and ours is llguidance (params.py), whose vLLM
backend reads only the old structural-tag form; xgrammar compiles the new form into rules of its own
(lazy tag dispatch, look-ahead) that no grammar converter carries over. So the tree is written here,
node by node, for the formats a forced turn uses: constant strings, sequences, alternatives, tags,
lists of tags (a separator between them), optional / repeated parts, regexes, and arguments as JSON
(under the tool's schema, `%json`) or as Qwen's XML parameters. A tree with anything else (another
argument style: DeepSeek's or MiniMax's XML, free text) raises ValueError naming it.

A forced turn is its calls: where the tree lets text come between or after the calls (triggered
tags), only whitespace does here; a tree that lets the turn have no call at all is no forced turn.
Qwen's XML parameters are any names with any values (each up to its ``</parameter>``): the judge checks
the arguments against the tool's schema once vLLM's parser read them, as it does for an unforced turn.

Strings that are special tokens of the model's vocabulary (``<|tool_calls_section_begin|>``) are named
by id, as llguidance reads a special token only so. Pure standard library.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping

# Between and after the calls of a turn whose tree allowed text there.
_BLANKS = r"/[ \t\r\n]*/"
# Qwen's XML arguments (xgrammar's "qwen_xml" style): <parameter=NAME>VALUE</parameter>, blanks around.
_QWEN_XML_RULES = ("qwen_xml_arguments: (" + _BLANKS + ' "<parameter=" /[a-zA-Z_][a-zA-Z0-9_]*/ ">" '
                   "qwen_xml_value)* " + _BLANKS + "\n"
                   "qwen_xml_value[lazy]: /(?s:.*)<\\/parameter>/\n")


def structural_tag_lark(tag_format: dict, special_tokens: Mapping[str, int]) -> str:
    """The Lark grammar of a forced turn whose calls `tag_format` (a structural tag's ``format``) writes.
    `special_tokens`: the vocabulary's special tokens and their ids."""
    writer = _Writer(special_tokens)
    start = writer.calls(tag_format)
    return f"start: {start}\n" + "".join(writer.rules)


class _Writer:
    def __init__(self, special_tokens: Mapping[str, int]):
        self.special_tokens = dict(special_tokens)
        # Longest first, so a token that begins another is not taken for it.
        names = sorted(self.special_tokens, key=len, reverse=True)
        self.special_pattern = re.compile("|".join(map(re.escape, names))) if names else None
        self.rules: list[str] = []

    def calls(self, node: dict) -> str:
        """The turn: the tree, which must call at least once."""
        kind = node.get("type")
        if kind in ("tags_with_separator", "triggered_tags") and not node.get("at_least_one"):
            raise ValueError("the structural tag lets the turn end without a call: not a forced turn")
        return self.expression(node)

    def expression(self, node: dict) -> str:
        kind = node.get("type")
        write = getattr(self, "_" + str(kind), None)
        if write is None:
            raise ValueError(f"xgrammar's structural-tag format {kind!r} is not written for llguidance")
        return write(node)

    def literal(self, text: str) -> str:
        """`text` as Lark: quoted strings, a special token by its id."""
        if not text:
            return '""'
        parts, at = [], 0
        for match in self.special_pattern.finditer(text) if self.special_pattern else ():
            if match.start() > at:
                parts.append(json.dumps(text[at:match.start()]))
            parts.append(f"<[{self.special_tokens[match.group()]}]>")
            at = match.end()
        if at < len(text):
            parts.append(json.dumps(text[at:]))
        return " ".join(parts)

    def _const_string(self, node: dict) -> str:
        return self.literal(node["value"])

    def _sequence(self, node: dict) -> str:
        return " ".join(f"({self.expression(e)})" for e in node["elements"]) or '""'

    def _or(self, node: dict) -> str:
        return "(" + " | ".join(f"({self.expression(e)})" for e in node["elements"]) + ")"

    def _optional(self, node: dict) -> str:
        return f"({self.expression(node['content'])})?"

    def _star(self, node: dict) -> str:
        return f"({self.expression(node['content'])})*"

    def _regex(self, node: dict) -> str:
        return "/" + node["pattern"].replace("/", "\\/") + "/"

    def _tag(self, node: dict) -> str:
        ends = node["end"] if isinstance(node["end"], list) else [node["end"]]
        end = "(" + " | ".join(self.literal(e) for e in ends) + ")"
        return f"{self.literal(node['begin'])} ({self.expression(node['content'])}) {end}"

    def _tags(self, node: dict, separator: str) -> str:
        one = "(" + " | ".join(f"({self._tag(t)})" for t in node["tags"]) + ")"
        if node.get("stop_after_first"):
            calls = one
        else:
            calls = f"{one} ({separator} {one})*"
        return calls if node.get("at_least_one") else f"({calls})?"

    def _tags_with_separator(self, node: dict) -> str:
        return self._tags(node, self.literal(node.get("separator", "")))

    def _triggered_tags(self, node: dict) -> str:
        # Each tag begins with its trigger; the text the tree allows around the calls is blanks here.
        return f"{self._tags(node, _BLANKS)} {_BLANKS}"

    def _json_schema(self, node: dict) -> str:
        style = node.get("style", "json")
        if style == "json":
            schema = node["json_schema"]
            return "%json " + json.dumps({} if schema is True else schema)  # (%json reads an object only)
        if style == "qwen_xml":
            if _QWEN_XML_RULES not in self.rules:
                self.rules.append(_QWEN_XML_RULES)
            return "qwen_xml_arguments"
        raise ValueError(f"xgrammar's {style!r} argument style is not written for llguidance")
