"""Cross-references a user follows: ``docs/<page>.md, "<title>"`` and ``docs/<page>.md#<anchor>``
written in README.md, docs/*.md, the shipped config and the package's docstrings and messages
(the config reference, docs/configuration.md, is generated from them) must name a section that
exists in that page: a heading, or a bold run-in paragraph title (``**Title.**``), the page's
two ways of titling a section. GitHub's heading anchors are computed as GitHub does (lower
case, punctuation dropped, spaces to hyphens)."""

from __future__ import annotations

import re

from tests.docs_blocks import ROOT

PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
SOURCES = [ROOT / "README.md", ROOT / "configs" / "distgrad.yaml", *sorted((ROOT / "docs").glob("*.md")),
           *sorted((ROOT / "distgrad").rglob("*.py")), *sorted((ROOT / "grafana").rglob("*.py"))]


def _titles(text: str) -> list[str]:
    heads = [re.sub(r"^#+\s*", "", line).strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]
    bold = [b.strip().rstrip(".:") for b in re.findall(r"\*\*([^*\n]+)\*\*", text)]
    return heads + bold


def _anchor(heading: str) -> str:
    a = re.sub(r"[^\w\- ]", "", heading.lower())
    return a.replace(" ", "-")


def _page(name: str) -> str:
    return "README.md" if name == "README" else f"docs/{name}.md"


def _references() -> list[tuple[str, str, str, str]]:
    """(source, page, kind, target): kind "title" or "anchor"."""
    out = []
    for src in SOURCES:
        # a docstring or a generated YAML comment may wrap a reference over lines
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", src.read_text())
        rel = src.relative_to(ROOT).as_posix()
        for m in re.finditer(r"(?:docs/)?(\w+)\.md,? (?:section )?(?:\"([^\"\s][^\"]*)\"|'([^'\s][^']*)')", flat):
            if _page(m.group(1)) in PAGES:
                out.append((rel, _page(m.group(1)), "title", m.group(2) or m.group(3)))
        for m in re.finditer(r"(?:docs/)?(\w+)\.md#([\w\-]+)(?![\w<{-])", flat):
            if _page(m.group(1)) in PAGES and not m.group(2).endswith("-"):  # "#signal-<kind>" templates
                out.append((rel, _page(m.group(1)), "anchor", m.group(2)))
    return out


def test_section_references_name_existing_sections():
    refs = _references()
    assert len(refs) > 30, refs  # the scan finds the references (dozens across the docs and code)
    bad = []
    for src, page, kind, target in refs:
        titles = _titles(PAGES[page])
        if kind == "title":
            ok = any(t == target or t.startswith(target) for t in titles)
        else:
            ok = target in {_anchor(t) for t in titles if not t.startswith("**")}
        if not ok:
            bad.append(f"{src}: {page} {kind} {target!r}")
    assert not bad, "references to sections that do not exist:\n" + "\n".join(bad)


def test_the_checker_rejects_a_missing_section():
    """The checker itself: a title and an anchor that the runbook does not have are not found,
    ones it has are."""
    titles = _titles(PAGES["docs/runbook.md"])
    assert "DistgradRerunFaultyNode" in titles
    assert not any(t.startswith("DistgradRerunFaultyDevice") for t in titles)
    anchors = {_anchor(t) for t in titles}
    assert "distgradrerunfaultynode" in anchors and "distgradrerunfaultydevice" not in anchors
