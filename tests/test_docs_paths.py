"""README.md and docs/ stand on their own: every relative link and every ``../`` path they cite
lies inside the repository (a reader of the published package has nothing beside it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]+)")  # a markdown link's target, anchor dropped
CITED = re.compile(r"`(\.\./[^`\s]*)`")  # a path cited in code quotes that climbs out of its folder


def _outside(page: Path, target: str) -> bool:
    if re.match(r"[a-z]+:", target):  # https:, mailto:
        return False
    return not (page.parent / target).resolve().is_relative_to(ROOT)


def test_readme_and_docs_cite_no_path_outside_the_repository():
    found = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES for pattern in (LINK, CITED)
             for target in pattern.findall(page.read_text()) if _outside(page, target)]
    assert not found, f"paths outside the repository (describe them or add the document to docs/): {found}"


def test_readme_and_docs_links_point_at_files_that_exist():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES for target in LINK.findall(page.read_text())
              if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists()]
    assert not broken, broken
