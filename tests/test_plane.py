"""The tree shows the architecture: the running plane's own modules are one package
(`services/plane/`), and docs/design.md's picture of the tree by floor is the import
graph's (`tests/test_layers.py` builds it from the source).

The four old names the rooms being split now still import (`services/follower.py`,
`leader.py`, `runner.py`, `process.py`) are re-exports marked to go when those rooms
land; nothing else may import them, so they cannot grow back into use."""

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
MARK = "# removed when the policy engine / gateway rooms land"
# IN_FLIGHT: who may still import an old name, until the rooms land with their imports.
IN_FLIGHT = ("services/preemption/", "services/gateway/", "services/flags.py")


def _shims() -> dict[str, Path]:
    """The loose modules that are the old names of plane modules: `services.X` to file."""
    return {
        f"services.{p.stem}": p
        for p in (ROOT / "services").glob("*.py")
        if p.stem in PLANE and MARK in p.read_text()
    }


def test_the_running_plane_is_one_package() -> None:
    plane = {p.stem for p in (ROOT / "services" / "plane").glob("*.py")} - {"__init__"}
    assert plane == PLANE
    loose = {p.stem for p in (ROOT / "services").glob("*.py")} - {"__init__"}
    shims = {name.removeprefix("services.") for name in _shims()}
    assert loose - shims == SHARED, "a new loose module: put it in its room, or list it"
    for name, path in _shims().items():
        text = path.read_text()
        assert f"from services.plane.{path.stem} import" in text, name
        assert text.count("\n") < 12, f"{name} is a re-export, nothing more"


def test_the_old_names_are_imported_only_by_the_rooms_in_flight() -> None:
    modules = layers.modules_under(ROOT)
    shims = _shims()
    wrong = []
    for name, path in modules.items():
        rel = path.relative_to(ROOT).as_posix()
        for imp in layers.imports_of(name, path, ROOT, modules):
            if imp.target in shims and not rel.startswith(IN_FLIGHT):
                wrong.append(str(imp))
    for top in ("tests",):
        for path in (ROOT / top).rglob("*.py"):
            text = path.read_text()
            for name in shims:
                stem = name.removeprefix("services.")
                if re.search(
                    rf"from services\.{stem} import|from services import .*\b{stem}\b", text
                ):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "import the plane's modules from services.plane:\n" + "\n".join(wrong)


def _floors() -> dict[str, int]:
    """Each room's floor in the package graph: 0 for one that imports no room of ours,
    else one above the highest it imports; an old name counts as the plane."""
    arrows = layers.build(ROOT)["packages"].arrows
    shims = set(_shims())

    def room(name: str) -> str:
        return "services.plane" if name in shims else name

    deps: dict[str, set[str]] = {}
    for src, dsts in arrows.items():
        deps.setdefault(room(src), set()).update(room(d) for d in dsts)
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
