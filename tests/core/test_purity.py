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
# publish. They live in the core, so this test and mypy strict cover them.
DECIDERS = ("scheduling.py", "preemption.py", "reaction.py")
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
    core = {p.name for p in sources("services/core")}
    assert set(DECIDERS) <= core
    shells = sources("services/scheduler") + sources("services/preemption")
    assert [p.name for p in shells if p.name in {"plan.py", *DECIDERS}] == []
