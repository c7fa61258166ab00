"""User-facing text describes the system as it is, not how the project got there.

The README, the docs, `benchmarks/README.md`, the CLI's `--help` texts and the comments and docstrings
of the engine and the server must not cite tracker issues ("issue 22", "issues #17") or a design file
the repository does not have ("DESIGN §4"): a reader cannot follow either. Dates of measurements and
the paper's sections ("paper §4", "Eq. 3") are fine. No model is loaded; the whole check takes well
under a second.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from infercept.server.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = (
    re.compile(r"\b[Ii]ssues? #?\d+"),   # "issue 22", "Issue 22's", "issues #17"
    re.compile(r"\b[Ii]ssue \""),        # issue "vLLM backend"
    re.compile(r"\bDESIGN §"),           # the project has no DESIGN file
)


def offences(text: str, where: str, first_line: int = 1) -> list[str]:
    """`where:line: matched text` for every forbidden reference in `text`."""
    found = []
    for offset, line in enumerate(text.splitlines()):
        for pattern in FORBIDDEN:
            for match in pattern.finditer(line):
                found.append(f"{where}:{first_line + offset}: {match.group(0)!r} in {line.strip()[:120]!r}")
    return found


def documents() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file())
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *docs]


def python_sources() -> list[Path]:
    """Every module of the project, its tests, benchmarks and examples (but this file, whose patterns and
    their checks must name what they catch)."""
    folders = ("engine", "server", "integrations", "tools", "tests", "benchmarks", "examples")
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if p != Path(__file__).resolve())


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every comment and every docstring-like string statement of a module."""
    source = path.read_text()
    parts = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            parts.append((node.lineno, node.value.value))
    return parts


def help_texts() -> dict[str, str]:
    """`infercept --help` and every subcommand's `--help`, formatted in-process."""
    parser = build_parser()
    texts = {"infercept --help": parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                texts[f"infercept {name} --help"] = sub.format_help()
    return texts


def test_the_checked_text_is_there():
    """The checks below read something: the files exist and `serve --help` has its options."""
    assert all(p.is_file() for p in documents())
    assert len(python_sources()) > 20
    assert "--policy" in help_texts()["infercept serve --help"]


def test_the_patterns_catch_what_they_are_for():
    text = "see issue 22\nIssue 22's parts\nissues #17\nissue \"vLLM backend\"\n(DESIGN §4)"
    assert len(offences(text, "x")) == 5
    ok = "a measurement of 2026-11-26; the paper's §4.3; Eq. 3; docs/operators.md §8; the issued call ids"
    assert offences(ok, "x") == []


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_cite_no_issues(path: Path):
    assert offences(path.read_text(), str(path.relative_to(ROOT))) == []


def test_cli_help_cites_no_issues():
    found = [o for where, text in help_texts().items() for o in offences(text, where)]
    assert found == []


def test_comments_and_docstrings_cite_no_issues():
    found = [o for path in python_sources() for line, text in comments_and_docstrings(path)
             for o in offences(text, str(path.relative_to(ROOT)), line)]
    assert found == []
