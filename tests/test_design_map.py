"""docs/design.md's map names every module of the package: a new or renamed module without its line fails here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hf_attnstore"


def map_text() -> str:
    return (ROOT / "docs" / "design.md").read_text().split("## The map", 1)[1].split("\n## ", 1)[0]


def test_the_map_names_every_module():
    """Each module by its path from the package (`store/tiers/disk.py`); a nested package (`store/policy.py`,
    `serving/protocol/`, `lab/evaluation/`) may be named by its folder instead of its files."""
    text = map_text()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            continue  # a package's exports: its modules are what the map names
        folders = [f"`{'/'.join(rel.parts[:k])}/`" for k in range(2, len(rel.parts))]
        if f"`{rel.as_posix()}`" not in text and not any(folder in text for folder in folders):
            missing.append(rel.as_posix())
    assert not missing, f"docs/design.md's map does not name: {missing}"
