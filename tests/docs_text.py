"""The README and the docs site's pages as the tests read them: pages by name, and their fenced code blocks.

A block may be preceded by ``<!-- tested by: tests/FILE.py::TEST -->`` (invisible once rendered), naming the
test that runs it; ``tests/test_docs.py`` requires one for every Python block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
TESTED_BY = re.compile(r"^<!-- tested by: (.+?) -->$")


@dataclass(frozen=True)
class Block:
    page: str
    """The page's path from the repository root."""
    line: int
    """The line of the opening fence, from 1."""
    lang: str
    body: str
    tested_by: tuple[str, ...]
    """``tests/FILE.py::TEST`` names from the comment before the fence."""

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """The README, then every page of the site."""
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def page(name: str) -> str:
    """The text of ``name`` (``README.md``, ``docs/sharded.md``, ...)."""
    return (REPO / name).read_text()


def blocks_of(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with its language (``""`` when the fence names none)."""
    lines = path.read_text().splitlines()
    name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)(`{3,})(\S*)\s*$", lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence, lang = opening.groups()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            body.append(lines[j].removeprefix(indent))
            j += 1
        if j == len(lines):
            raise AssertionError(f"{name}:{i + 1}: a code block is never closed")
        before = lines[i - 1].strip() if i > 0 else ""
        named = TESTED_BY.match(before)
        tested_by = tuple(n.strip() for n in named.group(1).split(",")) if named else ()
        found.append(Block(name, i + 1, lang, "\n".join(body) + "\n", tested_by))
        i = j + 1
    return found


def blocks(name: str, lang: str, containing: str = "") -> list[str]:
    """The bodies of ``name``'s blocks in ``lang`` that contain ``containing``."""
    return [b.body for b in blocks_of(REPO / name) if b.lang == lang and containing in b.body]


def the_block(name: str, lang: str, containing: str) -> str:
    """The one block of ``name`` in ``lang`` that contains ``containing`` (an error if none or several)."""
    found = blocks(name, lang, containing)
    assert len(found) == 1, f"{name}: {len(found)} {lang} blocks contain {containing!r}, not one"
    return found[0]
