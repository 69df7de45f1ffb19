"""The core and the schemas stay pure: no I/O library, and no clock in the core."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = ("services/core", "schemas")

# FORBIDDEN are the modules whose import would put I/O or concurrency in the pure layers.
# `os` is absent on purpose: nothing in the core needs it, and the allow-list below
# keeps the core to the standard library and msgspec anyway.
FORBIDDEN = {
    "nats",
    "aiosqlite",
    "asyncio",
    "opentelemetry",
    "sqlite3",
    "socket",
    "subprocess",
    "threading",
    "multiprocessing",
    "selectors",
    "http",
    "urllib",
}
# CORE_ALLOWED_THIRD_PARTY: services/core imports the standard library, msgspec, the
# schemas it folds, and itself; nothing else of ours, so no shell code leaks in.
CORE_ALLOWED_THIRD_PARTY = {"msgspec", "schemas", "services"}
# DECIDERS are the modules that decide what the scheduler and the preemption service
# publish (the preemption policy is a package). They live in the core, so this test and
# mypy strict cover them.
DECIDERS = ("scheduling.py", "policy", "reaction.py")
# CLOCK_CALLS read the wall clock; the core takes time as a parameter instead.
CLOCK_CALLS = {"now", "utcnow", "today", "time", "monotonic", "perf_counter"}


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


@pytest.mark.parametrize("package", PURE)
def test_no_io_imports(package: str) -> None:
    files = sources(package)
    assert files, f"no sources under {package}"
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in imported(ast.parse(path.read_text()))
        if name.split(".")[0] in FORBIDDEN
    ]
    assert bad == []


def test_core_imports_stdlib_and_msgspec_only() -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources("services/core")
        for name in imported(ast.parse(path.read_text()))
        if (
            (top := name.split(".")[0]) not in sys.stdlib_module_names
            and top not in CORE_ALLOWED_THIRD_PARTY
        )
        or (name.startswith("services.") and not name.startswith("services.core"))
        or name.split(".")[0] == "time"
    ]
    assert bad == []


def test_core_reads_no_clock() -> None:
    bad = []
    for path in sources("services/core"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in CLOCK_CALLS
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} calls .{node.func.attr}()")
    assert bad == []


def test_deciders_live_in_the_core() -> None:
    core = {p.name for p in (ROOT / "services/core").iterdir()}
    assert set(DECIDERS) <= core
    shells = sources("services/scheduler") + sources("services/preemption")
    names = {"plan.py", "preemption.py", *DECIDERS}
    assert [p.name for p in shells if p.name in names or p.parent.name in names] == []


# MUTATORS are the methods that change a container in place.
MUTATORS = {
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update",
    "setdefault", "add", "discard", "sort", "reverse", "appendleft", "popleft",
}  # fmt: skip


def _module_names(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _base(node: ast.expr) -> str | None:
    while isinstance(node, ast.Subscript | ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _writes_to_globals(fn: ast.FunctionDef | ast.AsyncFunctionDef, names: set[str]) -> list[str]:
    """Where a function changes a module-level name, directly or through a local name bound
    to it (`memos = _DIGESTS; memos.insert(...)`), or declares one `global`."""
    shared = set(names)
    bad = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Global):
            bad.append(f"global {', '.join(node.names)}")
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Name)
            and node.value.id in shared
        ):
            shared |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript | ast.Attribute) and _base(t) in shared:
                bad.append(f"writes into {_base(t)}")
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in MUTATORS and _base(f.value) in shared:
                bad.append(f"calls {_base(f.value)}.{f.attr}()")
            if (
                isinstance(f, ast.Name)
                and f.id == "next"
                and node.args
                and _base(node.args[0]) in shared
            ):
                bad.append(f"advances {_base(node.args[0])}")
    return bad


def _cached(tree: ast.Module) -> list[str]:
    """Functions memoised by functools (a cache kept by the module)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in node.decorator_list:
                name = ast.unparse(d)
                if "cache" in name:
                    out.append(f"{node.name} is decorated with {name}")
    return out


def test_core_keeps_no_state_between_calls_in_module_globals() -> None:
    """Core keeps nothing between calls but in objects a caller owns: no function writes
    into a module-level container, advances a module-level iterator, declares a global
    or is memoised by functools. (A speed-up lives in an object its caller holds, such
    as `scheduling.Memo` or the policy's index.)"""
    bad = []
    for path in sources("services/core"):
        tree = ast.parse(path.read_text())
        names = _module_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                bad += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {w}"
                    for w in _writes_to_globals(node, names)
                ]
        bad += [f"{path.relative_to(ROOT)}: {c}" for c in _cached(tree)]
    assert bad == []


def test_no_cache_rides_on_a_domain_object() -> None:
    """The view, the inventory and the catalog keep derived indexes the fold maintains,
    never a reader's cache: nothing named memo or cache on them."""
    from services.core import catalog, inventory, view

    for cls in (view.View, inventory.Inventory, catalog.Catalog):
        slots = set(getattr(cls, "__slots__", ())) | set(vars(cls))
        words = {w for s in slots for w in s.strip("_").split("_")}
        assert not words & {"memo", "cache", "cached", "kept"}, cls.__name__
