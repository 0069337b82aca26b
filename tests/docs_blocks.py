"""The fenced code blocks of README.md and docs/*.md (what a user copies), with their doctest
markers, for tests/test_docs_code.py and its driver tests/dist/docs_cases.py.

A marker is an HTML comment on the line right before the fence (invisible when rendered):

* ``<!-- doctest: context=NAME -->``: the block is a fragment; the driver runs it in the
  namespace of its context ``NAME`` (tiny models, loaders, an instrument, ... see
  ``tests/dist/docs_cases.py``), then checks what the block claims;
* ``<!-- doctest: skip=REASON -->``: not run here; REASON names the test file(s) that run the
  same calls (checked by tests/test_docs_code.py) and every skip is listed in its output.

A python block without a marker runs as it stands, in a fresh namespace."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*doctest:\s*(context|skip)=(.*?)\s*-->")


@dataclass
class Block:
    """One fenced block: ``file`` (relative to the repository root), ``line`` (1-based line of
    the opening fence), ``lang`` (the info string, "" when none), ``code`` and ``marker``
    (``{"context": NAME}``, ``{"skip": REASON}`` or ``{}``)."""

    file: str
    line: int
    lang: str
    code: str
    marker: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(files: list[Path] | None = None) -> list[Block]:
    """Every fenced block of ``files`` (default :func:`doc_files`), in order.

    Raises:
        ValueError: a fence is not closed, or a doctest marker is malformed or not followed by
            a fence.
    """
    out = []
    for path in files or doc_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        rel = str(path.relative_to(ROOT))
        i = 0
        while i < len(lines):
            line = lines[i]
            if "doctest:" in line and line.lstrip().startswith("<!--"):
                if not MARKER.fullmatch(line.strip()):
                    raise ValueError(f"{rel}:{i + 1}: malformed doctest marker {line.strip()!r}")
                if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
                    raise ValueError(f"{rel}:{i + 1}: a doctest marker must be right before a fence")
            if line.startswith("```"):
                lang = line[3:].strip()
                start = i
                i += 1
                body = []
                while i < len(lines) and not lines[i].startswith("```"):
                    body.append(lines[i])
                    i += 1
                if i >= len(lines):
                    raise ValueError(f"{rel}:{start + 1}: unclosed code fence")
                m = MARKER.fullmatch(lines[start - 1].strip()) if start else None
                out.append(Block(rel, start + 1, lang, "\n".join(body) + "\n",
                                 {m.group(1): m.group(2)} if m else {}))
            i += 1
    return out
