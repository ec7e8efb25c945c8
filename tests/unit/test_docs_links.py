"""Every relative link in README.md and docs/ points at a file that exists, and every page of docs/ is on the
map (docs/index.md): pages move, and a newcomer following a dead link is lost."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _targets(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    dead = [t for t in _targets(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not dead, f"{page.relative_to(ROOT)}: dead links {dead}"


def test_every_page_is_on_the_map() -> None:
    index = (DOCS / "index.md").read_text()
    pages = [p for p in DOCS.glob("*.md") if p.name != "index.md"] + list((DOCS / "concepts").glob("*.md"))
    missing = [str(p.relative_to(DOCS)) for p in pages if f"]({p.relative_to(DOCS)})" not in index]
    assert not missing, f"docs/index.md does not list {missing}"


def test_every_decision_is_indexed_and_has_its_parts() -> None:
    index = (DOCS / "decisions" / "README.md").read_text()
    for f in sorted((DOCS / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md")):
        text = f.read_text()
        assert text.startswith("# "), f"{f.name}: no title"
        assert re.search(r"status\W+(accepted|superseded)", text, re.I), f"{f.name}: no status"
        for part in ("context", "decision", "consequences"):  # as headings or bold labels, any level
            assert re.search(rf"^(#+ *|\*\*){part}", text, re.M | re.I), f"{f.name}: no {part}"
        assert f"]({f.name})" in index, f"{f.name} is not in docs/decisions/README.md"
