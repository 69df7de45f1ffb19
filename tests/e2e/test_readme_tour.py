"""The README's short tour, run as a reader would: every `sh` block of it, as written.

The first block starts `llmgw up` (it runs until stopped); each later block runs in a
shell beside it, in order, and must exit 0. The reader's home is a scratch directory, so
`~/.llmgw` is the plane's data directory of this test only; the broker, dashboard and
gateway take free ports when their defaults are taken. `. .venv/bin/activate` lines are
left out: the test's own interpreter's directory is first on PATH instead.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "OTEL_"))},
        "HOME": str(tmp_path),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    data = tmp_path / ".llmgw"
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        ["bash", "-c", f"exec {blocks[0].strip()}"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not (data / "gateway.url").is_file() or not (data / "gateway.url").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
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
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()
