"""docs/architecture.md opens with the map of the tree: every room of the package and every top-level folder of
the repository has its line, and every line names something that exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"


def map_entries(text: str) -> list[str]:
    """The paths the map's lines begin with (`miles_lite/run/`, `launcher/`, `miles_lite/types.py, plugins.py`
    gives both modules)."""
    section = text.split("## Map", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    entries = []
    for line in block.strip().splitlines():
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        first, *more = [part.strip() for part in head.split(",")]
        entries.append(first)
        entries += [str(Path(first).parent / m) for m in more]
    return entries


def tree_entries() -> set[str]:
    """Rooms of the package (folders with an `__init__.py`), its top-level modules, and the repository's
    top-level folders (those git tracks, hidden ones aside)."""
    package = REPO / "miles_lite"
    rooms = {f"{p.parent.relative_to(REPO)}/" for p in package.rglob("__init__.py") if p.parent != package}
    modules = {str(p.relative_to(REPO)) for p in package.glob("*.py") if p.name != "__init__.py"}
    folders = {f"{p.name}/" for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")
               and p.name not in {"miles_lite", "outputs", "build", "dist"} and not p.name.endswith(".egg-info")
               and any(p.rglob("*"))}
    return rooms | modules | folders


def test_the_map_opens_the_document() -> None:
    first_section = re.search(r"^## (.+)$", DOC.read_text(), re.M)
    assert first_section and first_section.group(1) == "Map"


def test_map_matches_the_tree() -> None:
    listed = map_entries(DOC.read_text())
    assert len(listed) == len(set(listed)), f"listed twice: {[e for e in listed if listed.count(e) > 1]}"
    tree = tree_entries()
    missing = sorted(tree - set(listed))
    stale = sorted(set(listed) - tree)
    assert not missing, f"docs/architecture.md's map has no line for {missing}"
    assert not stale, f"docs/architecture.md's map names what the tree lacks: {stale}"


def test_map_reader_sees_a_missing_room() -> None:
    text = "# t\n\n## Map\n```\nmiles_lite/run/   the run\nmiles_lite/types.py, plugins.py  shared\n```\n"
    assert map_entries(text) == ["miles_lite/run/", "miles_lite/types.py", "miles_lite/plugins.py"]
