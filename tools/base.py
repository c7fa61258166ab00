"""What every tool offers: a name, a description and a JSON-schema of its arguments (the OpenAI
function-tool shape, so the server can render it for the model), and an async `run`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Tool(ABC):
    name: str
    description: str
    parameters: dict[str, Any]

    @abstractmethod
    async def run(self, arguments: dict[str, Any]) -> str:
        """The tool's result as the text the model reads next; ValueError if `arguments` do not fit
        `parameters`."""

    def openai_tool(self) -> dict[str, Any]:
        """This tool as an entry of a Chat Completions `tools` list."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def string_parameter(name: str, description: str) -> dict[str, Any]:
    """The schema of a tool taking one required string, the shape small models call most reliably."""
    return {"type": "object", "properties": {name: {"type": "string", "description": description}},
            "required": [name]}


def string_argument(arguments: dict[str, Any], name: str) -> str:
    value = arguments.get(name)
    if not isinstance(value, str):
        raise ValueError(f"argument {name!r} must be a string, got {type(value).__name__}")
    return value
