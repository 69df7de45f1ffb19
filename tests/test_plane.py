"""The tree shows the architecture: the running plane's own modules are one package
(`services/plane/`), and docs/design.md's picture of the tree by floor is the import
graph's (`tests/test_layers.py` builds it from the source).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import test_layers as layers

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
PLANE = {"follower", "leader", "lease", "liveness", "runner", "process", "heap"}
# SHARED: the loose modules under services/ that are not the plane's: the ground every
# floor stands on, the flags, cluster files and `llmgw up`, which composes it all.
SHARED = {"clock", "clusterfile", "files", "flags", "hosts", "listen", "names", "pids", "up"}


def test_the_running_plane_is_one_package() -> None:
    plane = {p.stem for p in (ROOT / "services" / "plane").glob("*.py")} - {"__init__"}
    assert plane == PLANE
    loose = {p.stem for p in (ROOT / "services").glob("*.py")} - {"__init__"}
    assert loose == SHARED, "a new loose module: put it in its room, or list it"


def test_no_module_imports_the_plane_by_its_old_loose_names() -> None:
    wrong = []
    for top in ("services", "tests"):
        for path in (ROOT / top).rglob("*.py"):
            text = path.read_text()
            for stem in PLANE:
                if re.search(
                    rf"from services\.{stem} import|from services import .*\b{stem}\b", text
                ):
                    wrong.append(f"{path.relative_to(ROOT)} imports services.{stem}")
    assert not wrong, "import the plane's modules from services.plane:\n" + "\n".join(wrong)


def _floors() -> dict[str, int]:
    """Each room's floor in the package graph: 0 for one that imports no room of ours,
    else one above the highest it imports."""
    arrows = layers.build(ROOT)["packages"].arrows
    deps: dict[str, set[str]] = {}
    for src, dsts in arrows.items():
        deps.setdefault(src, set()).update(dsts)
    floor: dict[str, int] = {}

    def of(name: str) -> int:
        if name not in floor:
            below = [d for d in deps[name] if d not in (name, "services")]
            floor[name] = 1 + max(map(of, below)) if below else 0
        return floor[name]

    return {name: of(name) for name in deps if name != "services"}


def _pictured() -> dict[str, range]:
    """The rooms docs/design.md's layout names under each `floor N` or `floors N-M`."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    out: dict[str, range] = {}
    floors = range(0)
    for line in block.splitlines():
        if m := re.match(r"floors? (\d+)(?:-(\d+))?\s", line):
            floors = range(int(m[1]), int(m[2] or m[1]) + 1)
        elif m := re.match(r"(schemas)/\s|  (\w+)(?:/|\.py)\s", line):
            name = "schemas" if m[1] else f"services.{m[2]}"
            out[name] = floors
    return out


def test_the_design_notes_picture_the_floors() -> None:
    floors, pictured = _floors(), _pictured()
    assert set(pictured) == set(floors), (
        f"docs/design.md's layout leaves out {sorted(set(floors) - set(pictured))} "
        f"and names {sorted(set(pictured) - set(floors))}, which is no room"
    )
    wrong = [
        f"{name}: on floor {floors[name]}, pictured on {list(pictured[name])}"
        for name in sorted(floors)
        if floors[name] not in pictured[name]
    ]
    assert not wrong, "docs/design.md's floors are not the import graph's:\n" + "\n".join(wrong)
