"""`llmgw history -o table|wide|json|name`, in-process against a bundle."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from schemas import events as ev
from services import cli
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_ambient_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("LLMGW_NATS", "LLMGW_ROOT", "LLMGW_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMGW_DATA", str(tmp_path / "no-llmgw-up-here"))


def _bundle(tmp_path: Path) -> Path:
    """A replica whose ready state names its placement as its causation."""
    s = Scenario()
    s.node("n1", "8xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["tp4:4"])
    s.replica("c1", "chat", on=("n1", [0, 1, 2, 3]), ready="-1h")
    events = s._events  # the scenario's log: (seq, subject, event)
    placed = next(e for _, _, e in events if isinstance(e, ev.PlacementDecidedEvent))
    at = next(i for i, (_, _, e) in enumerate(events) if isinstance(e, ev.ReplicaStateEvent))
    seq, subject, ready = events[at]
    events[at] = (seq, subject, msgspec.structs.replace(ready, causation=placed.id))
    return s.write(tmp_path / "log.jsonl")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_is_the_alias_of_o_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(_bundle(tmp_path))
    code, alias, _ = _run(capsys, "history", "replica", "c1", "--log", log, "--json")
    assert code == 0
    code, chosen, _ = _run(capsys, "history", "replica", "c1", "--log", log, "-o", "json")
    assert code == 0 and chosen == alias
    entries = [json.loads(line) for line in chosen.splitlines()]
    assert [e["type"] for e in entries] == ["placement.decided", "replica.state"]
    assert set(entries[0]) == {"seq", "time", "type", "id", "summary", "rejected"}


def test_wide_shows_ids_and_causation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(_bundle(tmp_path))
    _, table, _ = _run(capsys, "history", "replica", "c1", "--log", log)
    assert "CAUSATION" not in table
    code, out, _ = _run(capsys, "history", "replica", "c1", "--log", log, "-o", "wide")
    assert code == 0
    lines = out.splitlines()
    head = next(line for line in lines if line.strip().startswith("SEQ"))
    assert head.split()[:6] == ["SEQ", "TIME", "AGE", "TYPE", "ID", "CAUSATION"]
    placed = next(line for line in lines if "placement.decided" in line)
    ready = next(line for line in lines if "replica.state" in line)

    def id_and_cause(line: str, kind: str) -> tuple[str, str]:
        words = line.split()  # AGE may be two words (`1h ago`): read from TYPE on
        at = words.index(kind)
        return words[at + 1], words[at + 2]

    placed_id, placed_cause = id_and_cause(placed, "placement.decided")
    assert placed_cause == "-"
    assert id_and_cause(ready, "replica.state")[1] == placed_id


def test_name_is_one_event_a_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(_bundle(tmp_path))
    code, out, _ = _run(capsys, "history", "replica", "c1", "--log", log, "-o", "name")
    assert code == 0
    _, js, _ = _run(capsys, "history", "replica", "c1", "--log", log, "--json")
    ids = [json.loads(line)["id"] for line in js.splitlines()]
    assert out.splitlines() == [f"event/{i}" for i in ids]


def test_an_unknown_output_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["history", "replica", "c1", "-o", "yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "invalid choice" in err
