"""`-o table|json|name` on `explain`, `diff` and `preemption plan`, with `--json` the
alias of `-o json`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services import cli
from tests.replay.conftest import preemption_story
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s, facts = preemption_story()
    path = str(s.write(tmp_path / "story.jsonl"))
    victim = facts["victims"][0]  # type: ignore[index]
    code, alias, err = run(capsys, "explain", "replica", victim, "--log", path, "--json")
    assert code == 0, err
    code, chosen, _ = run(capsys, "explain", "replica", victim, "--log", path, "-o", "json")
    assert code == 0 and chosen == alias and json.loads(chosen)["name"] == victim
    code, table, _ = run(capsys, "explain", "replica", victim, "--log", path, "-o", "table")
    assert code == 0 and table.startswith(f"replica {victim} ")
    # -o name: what a prefix resolved to, for scripts.
    code, name, _ = run(capsys, "explain", "model", "cri", "--log", path, "-o", "name")
    assert (code, name) == (0, "model/crit\n")
    code, _, err = run(capsys, "explain", "model", "crit", "--log", path, "-o", "yaml")
    assert code == 2 and "invalid choice" in err and err.count("\n") == 1


def test_diff_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s, facts = preemption_story()
    path = str(s.write(tmp_path / "story.jsonl"))
    moments = ("--seq", "1", "--log", path)
    code, alias, err = run(capsys, "diff", *moments, "--json")
    assert code == 0, err
    code, chosen, _ = run(capsys, "diff", *moments, "-o", "json")
    assert code == 0 and chosen == alias
    changes = json.loads(chosen)["changes"]
    code, names, _ = run(capsys, "diff", *moments, "-o", "name")
    assert code == 0
    want = list(dict.fromkeys(f"{c['kind']}/{c['name']}" for c in changes))
    assert names.splitlines() == want
    for v in facts["victims"]:  # type: ignore[attr-defined]
        assert f"replica/{v}" in want


def _full(tmp_path: Path) -> str:
    """A node full of idle opportunistic replicas and a critical model with none."""
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "4xH100-80GB")
    s.model("crit", cls="critical", min=1, profiles=["two:2"])
    s.model("lab", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    for i in range(4):
        s.replica(f"l{i + 1}", "lab", on=("n1", [i]), ready="-2h", used="-1h")
    return str(s.write(tmp_path / "full.jsonl"))


def test_plan_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = ("preemption", "plan", "--log", _full(tmp_path), "--model", "crit")
    code, alias, err = run(capsys, *plan, "--json")
    assert code == 0, err
    code, chosen, _ = run(capsys, *plan, "-o", "json")
    assert code == 0 and chosen == alias
    victims = [v["replica"] for v in json.loads(chosen)["victims"]]
    assert len(victims) == 2
    code, names, _ = run(capsys, *plan, "-o", "name")
    assert code == 0 and names.splitlines() == [f"replica/{v}" for v in victims]
    code, table, _ = run(capsys, *plan)
    assert code == 0 and table.startswith("policy ")
