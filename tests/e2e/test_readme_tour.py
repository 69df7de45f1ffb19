"""The README's short tour, run as a reader would: every `sh` block of it, as written.

The first block starts `llmgw up` (it runs until stopped); each later block runs in a
shell beside it, in order, and must exit 0. The reader's home is a scratch directory, so
`~/.llmgw` is the plane's data directory of this test only; the broker, dashboard and
gateway take free ports when their defaults are taken. `. .venv/bin/activate` lines are
left out: the test's own interpreter's directory is first on PATH instead.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.up_process import reader_env, shell_up

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## A short tour"


def tour_blocks(text: str) -> list[str]:
    """The `sh` blocks of the README's tour section, in order."""
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end != -1 else None]
    return re.findall(r"^```sh\n(.*?)^```", section, flags=re.S | re.M)


def _runnable(block: str) -> str:
    return "\n".join(line for line in block.splitlines() if line.strip() != ". .venv/bin/activate")


def test_the_tour_has_its_blocks() -> None:
    blocks = tour_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 4
    assert "llmgw up" in blocks[0]
    assert any("curl" in b for b in blocks) and any("openai" in b for b in blocks)


def test_every_command_of_the_readme_tour_runs(tmp_path: Path) -> None:
    blocks = [_runnable(b) for b in tour_blocks((ROOT / "README.md").read_text())]
    env = reader_env(tmp_path)
    with shell_up(blocks[0].strip(), ROOT, env, tmp_path / "up.log"):
        outputs = []
        for block in blocks[1:]:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=150,
            )
            assert done.returncode == 0, (
                f"the tour's block\n{block}\nexited {done.returncode}:\n"
                f"{done.stdout}\n{done.stderr}"
            )
            outputs.append(done.stdout)
        said = "\n".join(outputs)
        # The story the tour tells: a preemption for chat, and a request's use reported.
        assert "preemption.decided" in said
        assert "preempted" in said
        assert "last used" in said
