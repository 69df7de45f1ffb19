"""`python -m tests.adversarial.count`: the attack kinds are counted from pytest's own
collection, every file of the suite in it (new ones as they come), and a kind is
handled only when its test passed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adversarial import count

pytestmark = pytest.mark.timeout(120)

# FLOOR is the suite's count when the script came (99): it only grows (finding 10 of the
# third boundary round asks for at least 80 kinds, all handled).
FLOOR = 99


def _count(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.adversarial.count", *args],
        cwd=count.ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_every_file_of_the_suite_is_counted_and_the_total_is_at_least_the_floor() -> None:
    got = _count("--json")
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    files = {f"tests/adversarial/{p.name}" for p in count.HERE.glob("test_*.py")}
    files.discard(f"tests/adversarial/{count.SELF_TEST}")
    assert set(doc["files"]) == files
    assert doc["total"] == sum(doc["files"].values()) >= FLOOR
    # Parametrized cases count one by one: the file cases are more than its functions.
    assert doc["files"]["tests/adversarial/test_boundary_cli.py"] > 2

    text = _count("--min", str(doc["total"]))
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[-2].split() == ["total", str(doc["total"])]
    assert f"{doc['total']} attack kinds" in text.stdout
    below = _count("--min", str(doc["total"] + 1))
    assert below.returncode == 1 and "fewer attack kinds than --min" in below.stderr


SUITE = {
    "test_held.py": (
        "import pytest\n@pytest.mark.parametrize('n', [1, 2, 3])\ndef test_held(n):\n    assert n\n"
    ),
    "test_mixed.py": (
        "import pytest\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert False\n"
        "@pytest.mark.skip(reason='not yet')\n"
        "def test_skipped():\n    pass\n"
    ),
}


def test_run_counts_only_the_passed_as_handled_and_names_the_rest(tmp_path: Path) -> None:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    got = _count("--run", str(tmp_path))
    assert got.returncode == 1, got.stderr
    rows = {
        line.split()[0].rsplit("/", 1)[-1]: line.split()[1:] for line in got.stdout.splitlines()
    }
    assert rows["test_held.py"] == ["3", "3"] and rows["test_mixed.py"] == ["3", "1"]
    assert rows["total"] == ["6", "4"]
    assert "4 of 6 attack kinds handled" in got.stdout
    not_handled = [x for x in got.stdout.splitlines() if "not handled:" in x]
    assert [x.rsplit("::", 1)[-1] for x in not_handled] == ["test_fails", "test_skipped"]

    (tmp_path / "test_broken.py").write_text("import no_such_module_here\n")
    broken = _count(str(tmp_path))
    assert broken.returncode == 2 and "pytest could not collect" in broken.stderr
    assert "no_such_module_here" in broken.stderr
