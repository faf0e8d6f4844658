"""The README is a landing page whose links all lead somewhere, and the repo carries its own
design: nothing refers to a design document outside it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_a_landing_page():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 260


def test_every_relative_link_leads_to_a_file():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert broken == []


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces made ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_every_anchor_leads_to_a_heading():
    """A link's ``#anchor`` names a heading of its page (a bold paragraph opener has none:
    six links to two of them led nowhere)."""
    anchored = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")
    broken = []
    for page in PAGES:
        for target, anchor in anchored.findall(page.read_text(encoding="utf-8")):
            if "://" in target or not (target == "" or target.endswith(".md")):
                continue
            doc = page if target == "" else page.parent / target
            headings = {_slug(line.lstrip("#")) for line in doc.read_text(
                encoding="utf-8").splitlines() if line.startswith("#")}
            if anchor not in headings:
                broken.append(f"{page.relative_to(REPO)} -> {target}#{anchor}")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme] == []


def test_nothing_cites_a_design_document_outside_the_repo():
    outside = re.compile(r"DESIGN(\.md| section|'s)")
    files = [*PAGES, *REPO.joinpath("kdb").rglob("*.py"), *REPO.joinpath("benchmarks").glob("*.py"),
             *REPO.joinpath("tests").glob("*.py")]
    here = Path(__file__).resolve()
    assert [str(f.relative_to(REPO)) for f in files
            if f.resolve() != here and outside.search(f.read_text(encoding="utf-8"))] == []
