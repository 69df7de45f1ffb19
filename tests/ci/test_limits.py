"""The limits the README's test command keeps (and .ci/run, which runs the same line): a
function over ruff's complexity limit, a type error mypy strict finds and a broken link
in the docs each fail it. Each test runs the command's own step, as the README writes it,
in a small tree of its own that has the project's config and one fault, and beside it
the same tree without the fault, which passes: the step fails for that fault alone.

The steps run against a copy, never the checkout, so a test is quick (one small file for
ruff and mypy, the docs pages for mkdocs) and leaves nothing behind."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]


def _steps() -> list[str]:
    """The steps of the README's test command, split at its `&&`."""
    readme = (REPO / "README.md").read_text()
    lines = [x for x in readme.splitlines() if "pytest" in x and "pip install" in x]
    assert len(lines) == 1, "the README has one test command"
    return [s.strip() for s in lines[0].split(" && ")]


def _step(command: str) -> str:
    """The README command's one step that runs `.venv/bin/COMMAND` (a program and the
    first of its words)."""
    found = [s for s in _steps() if re.search(rf"(^|\s)\.venv/bin/{command}(\s|$)", s)]
    assert len(found) == 1, f"the README's test command runs .venv/bin/{command} once"
    return found[0]


def _tree(tmp_path: Path, *configs: str) -> Path:
    """A tree with the project's `configs` copied in and `.venv` the one running here,
    so that a step runs there as the README writes it."""
    root = tmp_path / "tree"
    root.mkdir()
    for name in configs:
        shutil.copy(REPO / name, root / name)
    (root / ".venv").symlink_to(Path(sys.prefix))
    return root


def _run(step: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(
        ["bash", "-c", step], cwd=cwd, capture_output=True, text=True, env=env, timeout=100
    )


def _branches(n: int) -> str:
    """A function of cyclomatic complexity `n` (one path and n - 1 `if`s)."""
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n - 1))
    return f"def decide(x: int) -> int:\n{body}    return -1\n"


def test_a_function_over_the_complexity_limit_fails_ruff(tmp_path: Path) -> None:
    step = _step("ruff check")
    assert step == ".venv/bin/ruff check -q ."
    root = _tree(tmp_path, "pyproject.toml")
    (root / "services").mkdir()
    decider = root / "services" / "decider.py"

    decider.write_text(_branches(15))
    kept = _run(step, root)
    assert kept.returncode == 0, kept.stdout + kept.stderr

    decider.write_text(_branches(16))
    over = _run(step, root)
    assert over.returncode != 0
    assert "C901" in over.stdout and "decide" in over.stdout, over.stdout + over.stderr


def test_the_complexity_allowance_leaves_core_and_the_gateway_out() -> None:
    """No file of services/core/ or services/gateway/ is let off C901, but for the policy
    engine's index, being split now and marked to go when it lands; every other file let
    off is one line with its reason above it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    lint = config["tool"]["ruff"]["lint"]
    assert "C90" in lint["select"] and lint["mccabe"]["max-complexity"] == 15
    allowed = {k for k, v in lint["per-file-ignores"].items() if "C901" in v}
    in_flight = {"services/core/policy/index.py"}
    for path in allowed - in_flight:
        assert not path.startswith(("services/core/", "services/gateway/", "schemas/")), path
        assert "*" not in path or path == "tests/**", f"{path}: one file a line"
    text = (REPO / "pyproject.toml").read_text()
    for path in allowed:
        before = text[: text.index(f'"{path}" = ')].rstrip().splitlines()[-1]
        assert before.startswith("#"), f"{path} is let off C901 without a reason"
    for path in allowed & in_flight:
        before = text[: text.index(f'"{path}" = ')].rstrip().splitlines()[-1]
        assert "removed when" in before and "land" in before, path


def test_a_type_error_fails_mypy_strict(tmp_path: Path) -> None:
    step = _step("mypy")
    assert step == ".venv/bin/mypy"
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True and set(config["files"]) == {"services", "schemas"}
    assert "overrides" not in config, "mypy strict on everything: no module is let off"
    root = _tree(tmp_path, "pyproject.toml")
    for package in ("services", "schemas"):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
    typed = root / "services" / "typed.py"

    typed.write_text("def half(x: int) -> float:\n    return x / 2\n")
    kept = _run(step, root)
    assert kept.returncode == 0, kept.stdout + kept.stderr

    typed.write_text("def half(x: int) -> str:\n    return x / 2\n")
    wrong = _run(step, root)
    assert wrong.returncode != 0
    assert "services/typed.py:2: error" in wrong.stdout, wrong.stdout + wrong.stderr

    # Strict: a function without its types is an error too, not an Any let through.
    typed.write_text("def half(x):\n    return x / 2\n")
    loose = _run(step, root)
    assert loose.returncode != 0
    assert "no-untyped-def" in loose.stdout, loose.stdout + loose.stderr


def test_a_broken_docs_link_fails_the_docs_build(tmp_path: Path) -> None:
    step = _step("mkdocs build")
    # Not quiet: mkdocs's -q drops the warnings strict mode counts, and a broken link
    # would pass.
    assert "build --strict" in step and "-d " in step and " -q" not in step
    root = _tree(tmp_path, "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs")

    kept = _run(step, root)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert not (root / "site").exists(), "the docs build writes outside the tree"

    page = root / "docs" / "operating.md"
    page.write_text(page.read_text() + "\nSee [the old page](no-such-page.md).\n")
    broken = _run(step, root)
    assert broken.returncode != 0
    assert "no-such-page.md" in broken.stdout + broken.stderr


def test_ci_runs_the_readme_command() -> None:
    """.ci/run runs the README's test command as it is written, checks included."""
    ci = (REPO / ".ci" / "run").read_text()
    line = " && ".join(_steps())
    assert f"\n{line}\n" in ci
    checks = [_step("ruff check"), _step("ruff format"), _step("mypy"), _step("mkdocs build")]
    # The suite runs twice: the fast one, then the engine tier on its own (`-m engine`).
    tests = [s for s in _steps() if s.startswith(".venv/bin/python -m pytest")]
    assert [s.split(" -m ")[-1] for s in tests] == ["'not engine'", "engine"], tests
    assert all(_steps().index(c) < _steps().index(tests[0]) for c in checks)


def test_the_gateways_http_surface_stays_a_surface() -> None:
    """server.py is the gateway's HTTP surface (at most 700 lines): forwarding, the
    waiting room, use reporting and what the routing rule is told live in rooms of their
    own, so a new routing input is a rule and a registration, not an edit here."""
    lines = (REPO / "services" / "gateway" / "server.py").read_text().count("\n")
    assert lines <= 700, f"services/gateway/server.py has {lines} lines; move a room out"
