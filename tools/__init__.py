"""Augmentations the server can run itself (the interception never leaves the server), and the
simulated augmentations benchmarks replay.

    from infercept.tools import get_tool, list_tools
    result = await get_tool("calculator").run({"expression": "24*9/5+32"})   # "75.2"

Settings come from the environment (`ToolSettings.from_env`) when the registry is first used.
"""
from __future__ import annotations

from functools import cache

from infercept.tools.base import Tool
from infercept.tools.calculator import Calculator
from infercept.tools.documents import DocumentLookup
from infercept.tools.settings import ToolSettings
from infercept.tools.simulated import SimulatedTool, simulated_tools

__all__ = ["Tool", "ToolSettings", "build_registry", "get_tool", "list_tools", "SimulatedTool"]


def build_registry(settings: ToolSettings) -> dict[str, Tool]:
    tools: list[Tool] = [Calculator(), DocumentLookup(settings.docs_dir)]
    if settings.augments_path.is_file():  # absent outside a source checkout unless INFERCEPT_AUGMENTS is set
        tools += simulated_tools(settings.augments_path, seed=settings.simulated_seed,
                                 time_scale=settings.simulated_time_scale)
    return {t.name: t for t in tools}


@cache
def _registry() -> dict[str, Tool]:
    return build_registry(ToolSettings.from_env())


def list_tools() -> list[str]:
    return list(_registry())


def get_tool(name: str) -> Tool:
    try:
        return _registry()[name]
    except KeyError:
        raise KeyError(f"unknown tool {name!r}; known tools: {', '.join(_registry())}") from None
