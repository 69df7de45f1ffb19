"""The engine tier's fixtures: the engine environment's interpreter and the tiny model.

The tier runs a real vLLM (CPU build), and its tests are marked `engine`: `pytest -m 'not
engine'` leaves them out. Where they run, the engine environment must be there (the
README's test command sets it up): a missing one fails them, with one line saying how to
get it, rather than skipping them unseen.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.engine import engine

_HAS_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


@pytest.fixture(scope="session")
def engine_python(request: pytest.FixtureRequest) -> Path:
    """The engine environment's interpreter (`--engine-python`), checked to have vLLM."""
    python = Path(request.config.getoption("--engine-python"))
    how = (
        "set it up with the README's test command, or name another with --engine-python; "
        "`pytest -m 'not engine'` leaves the engine tier out"
    )
    if not python.exists():
        pytest.fail(f"no engine environment: {python} does not exist ({how})", pytrace=False)
    found = subprocess.run([str(python), "-c", _HAS_VLLM], capture_output=True, timeout=60)
    if found.returncode != 0:
        pytest.fail(f"no engine environment: {python} has no vllm module ({how})", pytrace=False)
    return python


@pytest.fixture(scope="session")
def tiny_model(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (hidden 128, 2 heads of 64, 2 layers), made once per session."""
    return engine.make_model(engine_python, tmp_path_factory.mktemp("models") / "tiny")
