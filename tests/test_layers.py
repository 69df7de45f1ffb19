"""The layers, read from the source: who imports whom, and no cycles.

Every module under `schemas/` and `services/` is parsed with `ast`, never imported, and
every import in it counts, those inside functions too: a lazy import is a dependency all
the same, and a cycle hidden in a function is still a cycle. Two graphs are built from
them: modules, and packages (`schemas` is one package, each directory under `services/` is
one, and each loose module in `services/` counts as its own). The rules:

- no cycles in either graph;
- `schemas` imports nothing from `services`;
- `services.core` imports nothing from the other services packages;
- nothing outside `services.cli` imports `services.cli`.

A failure names the import lines, so the way out is visible: if two packages need
each other, a third, lower one holds what they share.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("schemas", "services")


# ----------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class Import:
    """One import of ours: where it is written and what it names."""

    path: str
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


@dataclass
class Graph:
    """Arrows between names, each with the first import line that draws it."""

    arrows: dict[str, dict[str, Import]] = field(default_factory=dict)

    def add(self, src: str, dst: str, imp: Import) -> None:
        self.arrows.setdefault(src, {})
        self.arrows.setdefault(dst, {})
        if src != dst:
            self.arrows[src].setdefault(dst, imp)

    def tangles(self) -> list[frozenset[str]]:
        """The names caught in cycles: each strongly connected component of more than one."""
        return [frozenset(c) for c in _components(self.arrows) if len(c) > 1]

    def cycles(self) -> list[list[str]]:
        """One cycle per tangle, as a path that starts and ends at its first name (sorted)."""
        return [self._path_through(min(t), t) for t in self.tangles()]

    def _path_through(self, start: str, within: frozenset[str]) -> list[str]:
        # Shortest way back to `start`, staying inside its component (one exists).
        back: dict[str, str] = {}
        todo = deque([start])
        while todo:
            at = todo.popleft()
            for nxt in sorted(self.arrows[at]):
                if nxt not in within:
                    continue
                if nxt == start:
                    path = [at]
                    while path[-1] != start:
                        path.append(back[path[-1]])
                    return [*reversed(path), start]
                if nxt not in back:
                    back[nxt] = at
                    todo.append(nxt)
        raise AssertionError(f"{start} is in a component but on no cycle")

    def explain(self, tangle: frozenset[str]) -> str:
        """`a -> b -> a`, the import line behind each arrow, and who else is caught."""
        cycle = self._path_through(min(tangle), tangle)
        lines = [" -> ".join(cycle)]
        lines += [f"  {self.arrows[a][b]}" for a, b in itertools.pairwise(cycle)]
        others = tangle - set(cycle)
        if others:
            lines.append(f"  and in the same tangle: {', '.join(sorted(others))}")
        return "\n".join(lines)


def _components(arrows: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's strongly connected components, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    for root in sorted(arrows):
        if root in index:
            continue
        work = [(root, iter(sorted(arrows[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, nexts = work[-1]
            for w in nexts:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(arrows[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    comps.append(comp)
    return comps


def modules_under(root: Path, tops: Iterable[str] = TOPS) -> dict[str, Path]:
    """Every module's dotted name and file; a package is named by its `__init__.py`."""
    found = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that `name` is or lies in; None for other projects'."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, root: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of ours in one module, wherever in it it is written."""
    rel = path.relative_to(root).as_posix()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name, modules) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                # `from pkg import mod` names the module; `from pkg import thing`, the package.
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in modules else _resolve(base, modules))
        found += [Import(rel, node.lineno, t) for t in targets if t and t != name]
    return found


def package_of(module: str, root: Path) -> str:
    """`schemas`; `services.<dir>` for anything in a directory under services/; else the
    module itself (a loose module is its own package here)."""
    parts = module.split(".")
    if parts[0] == "schemas":
        return "schemas"
    if len(parts) >= 2 and (root / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def build(root: Path = ROOT, tops: Iterable[str] = TOPS) -> dict[str, Graph]:
    """The module graph and the package graph of the tree under `root`."""
    modules = modules_under(root, tops)
    graphs = {"modules": Graph(), "packages": Graph()}
    for name, path in modules.items():
        graphs["modules"].arrows.setdefault(name, {})
        graphs["packages"].arrows.setdefault(package_of(name, root), {})
        for imp in imports_of(name, path, root, modules):
            graphs["modules"].add(name, imp.target, imp)
            graphs["packages"].add(package_of(name, root), package_of(imp.target, root), imp)
    return graphs


@pytest.fixture(scope="module")
def graphs() -> dict[str, Graph]:
    return build()


# ----------------------------------------------------------------------------- the rules


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["modules", "packages"])
def test_no_cycles(kind: str, graphs: dict[str, Graph]) -> None:
    graph = graphs[kind]
    tangles = graph.tangles()
    assert not tangles, f"import cycles among {kind}:\n" + "\n".join(map(graph.explain, tangles))


def _crossings(graphs: dict[str, Graph], root: Path) -> list[tuple[str, str, Import]]:
    """Every import from one package into another: (from, to, the import)."""
    return [
        (package_of(src, root), package_of(dst, root), imp)
        for src, arrows in graphs["modules"].arrows.items()
        for dst, imp in arrows.items()
        if package_of(src, root) != package_of(dst, root)
    ]


def reaching_out(
    graphs: dict[str, Graph], package: str, allowed: set[str], root: Path
) -> list[str]:
    """The imports by which `package` reaches a package outside `allowed`."""
    return [
        str(i) for src, dst, i in _crossings(graphs, root) if src == package and dst not in allowed
    ]


def reaching_in(graphs: dict[str, Graph], package: str, root: Path) -> list[str]:
    """The imports of `package` from outside it."""
    return [str(i) for _, dst, i in _crossings(graphs, root) if dst == package]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        pytest.param("schemas", set(), id="schemas imports nothing of services"),
        pytest.param("services.core", {"schemas"}, id="services.core imports only schemas"),
    ],
)
def test_lower_layers_import_nothing_above(
    package: str, allowed: set[str], graphs: dict[str, Graph]
) -> None:
    bad = reaching_out(graphs, package, allowed, ROOT)
    assert not bad, f"{package} reaches above its layer:\n  " + "\n  ".join(bad)


@pytest.mark.timeout(30)
def test_nothing_below_the_cli_imports_it(graphs: dict[str, Graph]) -> None:
    bad = reaching_in(graphs, "services.cli", ROOT)
    assert not bad, "only the CLI imports the CLI:\n  " + "\n  ".join(bad)


# ----------------------------------------------------------------------------- the reader


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.timeout(30)
def test_a_cycle_through_a_lazy_relative_import_is_found_and_named(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "schemas/__init__.py": "",
            "services/__init__.py": "",
            "services/loose.py": "from services.pkg import b\n",
            "services/pkg/__init__.py": "from .a import thing\n",
            "services/pkg/a.py": "import os\n\nthing = 1\n",
            "services/pkg/b.py": "def f():\n    from . import c\n",
            "services/pkg/c.py": "import json\nfrom services.pkg.a import thing\nimport services.loose\n",
        },
    )
    graphs = build(root)
    assert graphs["modules"].arrows == {
        "schemas": {},
        "services": {},
        "services.loose": {"services.pkg.b": Import("services/loose.py", 1, "services.pkg.b")},
        "services.pkg": {"services.pkg.a": Import("services/pkg/__init__.py", 1, "services.pkg.a")},
        "services.pkg.a": {},
        "services.pkg.b": {"services.pkg.c": Import("services/pkg/b.py", 2, "services.pkg.c")},
        "services.pkg.c": {
            "services.pkg.a": Import("services/pkg/c.py", 2, "services.pkg.a"),
            "services.loose": Import("services/pkg/c.py", 3, "services.loose"),
        },
    }
    modules = graphs["modules"]
    (tangle,) = modules.tangles()
    assert modules.explain(tangle) == (
        "services.loose -> services.pkg.b -> services.pkg.c -> services.loose\n"
        "  services/loose.py:1 imports services.pkg.b\n"
        "  services/pkg/b.py:2 imports services.pkg.c\n"
        "  services/pkg/c.py:3 imports services.loose"
    )
    packages = graphs["packages"]
    assert set(packages.arrows) == {"schemas", "services", "services.loose", "services.pkg"}
    (cycle,) = packages.cycles()
    assert cycle == ["services.loose", "services.pkg", "services.loose"]


@pytest.mark.timeout(30)
def test_a_graph_without_cycles_has_none() -> None:
    graph = Graph()
    for src, dst in [("a", "b"), ("b", "c"), ("a", "c"), ("d", "a")]:
        graph.add(src, dst, Import("x.py", 1, dst))
    assert graph.cycles() == []
    graph.add("c", "d", Import("x.py", 2, "d"))
    assert graph.cycles() == [["a", "c", "d", "a"]]
    assert graph.explain(frozenset("abcd")) == (
        "a -> c -> d -> a\n  x.py:1 imports c\n  x.py:2 imports d\n  x.py:1 imports a\n"
        "  and in the same tangle: b"
    )


@pytest.mark.timeout(30)
def test_imports_across_layers_are_named(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "schemas/__init__.py": "",
            "schemas/events.py": "def f():\n    import services.core.fold\n",
            "services/cli/__init__.py": "",
            "services/core/__init__.py": "",
            "services/core/fold.py": "import schemas.events\nfrom services.bus import x\n",
            "services/bus/__init__.py": "from services import cli\n",
        },
    )
    graphs = build(root)
    assert reaching_out(graphs, "schemas", set(), root) == [
        "schemas/events.py:2 imports services.core.fold"
    ]
    assert reaching_out(graphs, "services.core", {"schemas"}, root) == [
        "services/core/fold.py:2 imports services.bus"
    ]
    assert reaching_in(graphs, "services.cli", root) == [
        "services/bus/__init__.py:1 imports services.cli"
    ]
