"""No test sleeps to let time pass: time is a parameter (the core's `now`, a service's
clocks, which a test moves). A sleep in a test is a poll's pause, inside the loop that
polls a condition with a deadline; one standing alone waits for the clock to cross
something, and fails here. What a fake server does when asked to take its time (a
request's seconds, a drain's) is the server's behaviour under test, not the test's wait.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

TESTS = Path(__file__).resolve().parents[1]
# SERVERS: the fake servers, whose sleeps are what they were asked to take (a request's
# seconds, a drain's, a slow /metrics): their behaviour under test, not a test's wait.
SERVERS = {"agent/fakeserver.py"}


def lone_sleeps(path: Path, root: Path = TESTS) -> list[str]:
    """The `sleep(...)` calls of a file that sit in no loop and ask for more than 0 s, as
    `file:line in function` (the file's path from `root`)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []

    def walk(node: ast.AST, looping: bool, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                name = getattr(child, "name", function)
                walk(child, False, name)
                continue
            if isinstance(child, ast.Call) and _is_sleep(child) and not looping:
                found.append(f"{path.relative_to(root)}:{child.lineno} in {function}")
            walk(child, looping or isinstance(child, ast.While | ast.For | ast.AsyncFor), function)

    walk(tree, False, "<module>")
    return found


def _is_sleep(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name != "sleep" or not call.args:
        return False
    arg = call.args[0]
    return not (isinstance(arg, ast.Constant) and arg.value == 0)


def test_no_test_sleeps_outside_a_poll() -> None:
    wrong = []
    for path in sorted(TESTS.rglob("*.py")):
        if "bench" in path.relative_to(TESTS).parts:
            continue  # a benchmark paces its load on purpose
        if path.relative_to(TESTS).as_posix() in SERVERS:
            continue
        wrong += lone_sleeps(path)
    assert not wrong, "sleeps that let time pass (move a clock instead):\n" + "\n".join(wrong)


def test_the_check_finds_a_lone_sleep(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    src = (
        "import asyncio, time\n"
        "async def test_waits():\n"
        "    await asyncio.sleep(0.5)\n"
        "async def test_polls():\n"
        "    while True:\n"
        "        await asyncio.sleep(0.05)\n"
        "def test_yields():\n"
        "    time.sleep(0)\n"
    )
    probe.write_text(src)
    assert lone_sleeps(probe, tmp_path) == ["probe.py:3 in test_waits"]
