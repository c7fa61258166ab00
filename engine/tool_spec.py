"""A tool as the engine needs it (plain data: the request, the scheduler and every tool format share it)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the engine needs it: its name, its arguments' schema, and its definition as prompts
    show it (OpenAI's function-tool object)."""

    name: str
    parameters: Mapping[str, Any] | None = None  # JSON schema of the arguments object
    definition: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def function(cls, name: str, parameters: Mapping[str, Any] | None = None,
                 description: str | None = None) -> "ToolSpec":
        fn = {"name": name} | ({"description": description} if description else {}) \
            | ({"parameters": dict(parameters)} if parameters is not None else {})
        return cls(name, parameters, {"type": "function", "function": fn})

    @property
    def arguments_schema(self) -> dict:
        """The parameters schema (a call's arguments are always an object)."""
        return {"type": "object", **(self.parameters or {})}
