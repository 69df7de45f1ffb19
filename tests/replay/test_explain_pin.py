"""`explain` says when a preemption's pin applied: the replica placed inside the domain
its victims freed names the decision that pinned it, and `explain model` says while a
pin is on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import events as ev
from services import cli
from services.core import scheduling
from tests.core.test_pin import decided

pytestmark = pytest.mark.timeout(30)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return code, out


def test_explain_names_the_pin_of_a_placement_it_applied_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, d = decided()
    path = s.write(tmp_path / "before.jsonl")
    _, out = run(capsys, "explain", "model", "big", "--log", str(path))
    assert "  its placement is pinned to nvlink_domain=A, the domain its victims free" in out
    p = scheduling.plan(s.view(), s.now, scheduling.Config())
    (placed,) = [o for o in p.outputs if isinstance(o.event, ev.PlacementDecidedEvent)]
    s.put(placed.event)
    path = s.write(tmp_path / "after.jsonl")
    rid = placed.event.data.replica
    _, out = run(capsys, "explain", "replica", rid, "--log", str(path))
    lines = [x for x in out.splitlines() if x.startswith("  pinned     ")]
    assert len(lines) == 1 and "to nvlink_domain=A, the domain its victims freed" in lines[0]
    assert f"preemption.decided {d.id}" in lines[0]
    _, out = run(capsys, "explain", "replica", rid, "--log", str(path), "--json")
    assert json.loads(out)["pinned"]["domain"] == "nvlink_domain=A"
    _, out = run(capsys, "explain", "model", "big", "--log", str(path))
    assert "pinned" not in out.split("\n\n")[0]


def test_explain_says_nothing_of_a_pin_where_none_applied(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s, _ = decided(domain=False)
    p = scheduling.plan(s.view(), s.now, scheduling.Config())
    (placed,) = [o for o in p.outputs if isinstance(o.event, ev.PlacementDecidedEvent)]
    s.put(placed.event)
    path = s.write(tmp_path / "log.jsonl")
    _, out = run(capsys, "explain", "replica", placed.event.data.replica, "--log", str(path))
    assert "pinned" not in out
