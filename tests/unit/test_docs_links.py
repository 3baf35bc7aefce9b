"""The documentation's links lead somewhere: every relative link in the
README and the docs names a file of the repository, every ``#anchor`` a
heading of the page it points to, and every ``docs/<page>.md#<anchor>`` that
the code cites a heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "deploy").rglob("*.md")]
)
CODE_DIRS = (
    "coordinator",
    "draft_worker",
    "target_worker",
    "outrider",
    "protos",
    "scripts",
    "tests",
)
CODE_SUFFIXES = {".py", ".proto", ".sh"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CITED = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in prose_lines(page):
        if match := HEADING.match(line):
            base = slug(match.group(2))
            anchor, n = base, 0
            while anchor in found:  # repeated headings get -1, -2, ...
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of the page's links that are not URLs (a link's text may span lines)."""
    prose = INLINE_CODE.sub("", "\n".join(prose_lines(page)))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_pages_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "docs/design.md", "docs/usage.md", "docs/benchmark.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_docs_anchor_the_code_cites_is_a_heading():
    broken = []
    for directory in CODE_DIRS:
        for source in sorted((REPO / directory).rglob("*")):
            if source.suffix not in CODE_SUFFIXES or not source.is_file():
                continue
            for page, anchor in CITED.findall(source.read_text(encoding="utf-8")):
                if not (REPO / "docs" / page).is_file():
                    broken.append(f"{source.relative_to(REPO)}: docs/{page} does not exist")
                elif anchor not in anchors(REPO / "docs" / page):
                    broken.append(f"{source.relative_to(REPO)}: docs/{page}#{anchor}")
    assert not broken, "cited anchors without a heading: " + "; ".join(broken)


def test_slug_follows_github():
    assert slug("How `outrider bench` measures") == "how-outrider-bench-measures"
    assert slug("TLS, mutual TLS and tokens") == "tls-mutual-tls-and-tokens"
    assert slug("Step cost on an H100") == "step-cost-on-an-h100"
