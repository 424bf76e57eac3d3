"""The README stays a front page that tells the truth about the tree: its code map names every
package under shared/ and services/ and nothing else, it stays short, and no relative link in it or
in docs/ points at a file (or a heading) that is not there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 150

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_MAP_ENTRY = re.compile(r"^((?:shared|services)(?:/\w+)+)/\s")


def packages() -> set[str]:
    """Every directory under shared/ and services/ that is a package (has an __init__.py)."""
    found = set()
    for top in ("shared", "services"):
        for init in (ROOT / top).rglob("__init__.py"):
            package = init.parent.relative_to(ROOT).as_posix()
            if package != top:
                found.add(package)
    return found


def code_map(text: str) -> list[str]:
    """The packages named by the code map: the first fenced block under the `## Code map` heading."""
    section = text.split("\n## Code map\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    return [m.group(1) for line in block.splitlines() if (m := CODE_MAP_ENTRY.match(line))]


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "loadtest" / "results" / "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.+)", line)):
            found.add(slug(m.group(1)))
    return found


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links in code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, mailto: ...


def test_the_code_map_names_every_package_and_nothing_else():
    named = code_map(README.read_text())
    assert len(named) == len(set(named)), f"named twice: {sorted(p for p in named if named.count(p) > 1)}"
    on_disk = packages()
    assert not on_disk - set(named), f"packages missing from README's code map: {sorted(on_disk - set(named))}"
    assert not set(named) - on_disk, f"README's code map names what is not a package: {sorted(set(named) - on_disk)}"


def test_the_code_map_check_sees_a_missing_package():
    text = README.read_text()
    dropped = next(line for line in text.splitlines() if line.startswith("shared/disagg/"))
    assert "shared/disagg" not in code_map(text.replace(dropped + "\n", ""))
    assert "shared/disagg" in packages()


def test_the_readme_is_a_short_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_and_headings_that_exist(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)
