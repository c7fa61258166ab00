"""Local document lookup: the paragraphs of a folder's .md and .txt files that share the most terms
with the query. Term overlap is crude but has no dependencies and is predictable, which is what a
tool the server runs inside an interception needs."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infercept.tools.base import Tool, string_argument, string_parameter

SUFFIXES = (".md", ".txt")
MAX_SNIPPET_CHARS = 400
STOPWORDS = frozenset("a an and are as at be by do does for from how in is it its of on or that the this to "
                      "what when where which who why with".split())


def terms(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS and len(w) > 1}


@dataclass(frozen=True)
class Passage:
    source: str  # file name relative to the folder
    text: str
    terms: frozenset[str]


def load_passages(folder: Path) -> list[Passage]:
    """Every blank-line separated paragraph of the folder's text files, in file-name order."""
    if not folder.is_dir():
        raise FileNotFoundError(f"document folder {folder} does not exist")
    passages = []
    for path in sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
        for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="replace")):
            block = " ".join(block.split())
            if block:
                passages.append(Passage(str(path.relative_to(folder)), block, frozenset(terms(block))))
    return passages


def search(passages: list[Passage], query: str, top_k: int) -> list[Passage]:
    """The `top_k` passages sharing the most query terms (ties: earlier first); none without overlap."""
    wanted = terms(query)
    scored = [(len(wanted & p.terms), -i, p) for i, p in enumerate(passages)]
    best = sorted((s for s in scored if s[0] > 0), key=lambda s: s[:2], reverse=True)
    return [p for _, _, p in best[:top_k]]


class DocumentLookup(Tool):
    name = "document_lookup"
    description = "Search the local documents and return the passages that best match the query."
    parameters = string_parameter("query", "what to look for")

    def __init__(self, folder: Path, top_k: int = 3):
        self.folder = folder
        self.top_k = top_k
        self._passages: list[Passage] | None = None  # read on first use: the folder may be large

    async def run(self, arguments: dict[str, Any]) -> str:
        query = string_argument(arguments, "query")
        if self._passages is None:
            self._passages = load_passages(self.folder)
        found = search(self._passages, query, self.top_k)
        if not found:
            return f"No document mentions {query!r}."
        return "\n\n".join(f"[{p.source}] {_shorten(p.text)}" for p in found)


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_SNIPPET_CHARS else text[:MAX_SNIPPET_CHARS].rsplit(" ", 1)[0] + " ..."
