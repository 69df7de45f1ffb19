"""The project's documents as one text, for tests that check what they say: the README,
CONTRIBUTING.md, CHANGELOG.md and every page of the documentation site (docs/)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def text() -> str:
    paths = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]
    paths += sorted((ROOT / "docs").glob("*.md"))
    return "\n".join(p.read_text() for p in paths if p.is_file())
