"""`non_stdlib_imports(path)`: the absolute imports of a source file, at any depth, that are not from the
standard library. Pure-Python modules (policies, tool parsers) must run where torch is absent."""
from __future__ import annotations

import ast
import sys
from pathlib import Path


def non_stdlib_imports(path: Path) -> list[str]:
    roots = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            roots.append(node.module.split(".")[0])
    return [r for r in roots if r not in sys.stdlib_module_names and r != "__future__"]
