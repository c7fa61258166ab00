"""docs/architecture.md says where each concept lives; every module it names must exist, so a rename, a
move or a split that leaves the doc behind fails here.

The doc names modules in its backticked spans and in its diagram (the fenced block), as paths from the
repository root (`engine/policy/plan.py`, `engine/csrc/`, `server/`, globs like `serving_*.py`), as a
directory's listing (``engine/policy/: profile, waste, ...``, possibly wrapped over diagram lines), as
bare file names next to the directory they sit in (`serving_base.py` in a row naming `server/...`), as
dotted package modules (`infercept.engine.backend`) and as ``module.name`` (`serving_base.respond`).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
TOP = ("engine", "server", "tools", "integrations", "tests", "benchmarks", "examples", "docs")
_TOP = "|".join(TOP)
PATH = re.compile(rf"(?<![\w./])((?:{_TOP})/[\w./*-]*)")
LISTING = re.compile(rf"(?<![\w./])((?:{_TOP})/[\w/]*/): ([^)]*)\)")
BARE = re.compile(r"(?<![\w./*-])([\w*]+\.py)\b")
PACKAGE_MODULE = re.compile(r"(?<![\w.])infercept((?:\.\w+)+)")
MODULE_NAME = re.compile(r"(?<![\w./])([a-z_][a-z0-9_]*)\.([A-Za-z_]\w*)\b(?!\.)")


def _named_text() -> list[str]:
    """The lines where the doc names code: the fenced blocks whole, elsewhere only the backticked spans
    (prose like "the server/engine contract" is no path), each line's spans joined by spaces."""
    lines, fenced = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            lines.append("")  # keeps the doc's line numbers
        elif fenced:
            lines.append(line)
        else:
            lines.append(" ".join(re.findall(r"`([^`]+)`", line)))
    return lines


def _exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).is_dir() if path.endswith("/") else (ROOT / path).is_file()


def _python_files(name: str) -> list[Path]:
    return [p for top in TOP for p in (ROOT / top).rglob(name) if ".venv" not in p.parts]


def _defines(path: Path, name: str) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def missing_from_doc() -> list[str]:
    """What the doc names that the repository lacks, each with the line that names it."""
    lines, missing = _named_text(), []
    for number, line in enumerate(lines, start=1):
        paths = PATH.findall(line)
        missing += [f"{path} (line {number})" for path in paths if not _exists(path)]
        dirs = {p if p.endswith("/") else p.rsplit("/", 1)[0] + "/" for p in paths}
        for name in BARE.findall(line):
            found = any(ROOT.glob(d + name) for d in dirs) if dirs else bool(_python_files(name))
            if not found:
                missing.append(f"{name} (line {number}, looked in {', '.join(sorted(dirs)) or 'the source trees'})")
        for dotted in PACKAGE_MODULE.findall(line):
            module = dotted.lstrip(".").replace(".", "/")
            if not ((ROOT / f"{module}.py").is_file() or (ROOT / module / "__init__.py").is_file()):
                missing.append(f"infercept{dotted} (line {number})")
        for module, name in MODULE_NAME.findall(PACKAGE_MODULE.sub(" ", line)):
            if name == "py":
                continue  # a file name, checked above
            files = _python_files(f"{module}.py")
            if not any(_defines(f, name) for f in files):
                why = "not defined there" if files else "no such module"
                missing.append(f"{module}.{name} (line {number}: {why})")
    joined = "\n".join(lines).replace("│", " ")
    for directory, names in LISTING.findall(joined):
        missing += [f"{directory}{name}.py (listed)" for name in re.findall(r"[A-Za-z_]\w*", names)
                    if not (ROOT / directory / f"{name}.py").is_file()]
    return missing


def test_every_module_the_architecture_doc_names_exists():
    assert missing_from_doc() == []


def test_the_doc_names_the_policy_modules():
    """Guards the extraction itself: a doc it reads nothing from would pass the test above."""
    named = "\n".join(_named_text())
    assert {"engine/policy/plan.py", "engine/policy/policies.py", "engine/csrc/", "server/"} <= set(PATH.findall(named))
    assert any(d == "engine/policy/" and "expected_waste" in n for d, n in LISTING.findall(named.replace("│", " ")))
    assert {"serving_base.py", "turns.py"} <= set(BARE.findall(named))
    assert ("serving_base", "respond") in MODULE_NAME.findall(named)
