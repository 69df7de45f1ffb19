"""`llmgw snapshot --list -o ...` and `llmgw events tail -o ...` against a real broker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.events import type_of
from services import cli
from services.core.view import SCHEMA
from services.replay import eventline
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_ambient_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("LLMGW_NATS", "LLMGW_ROOT", "LLMGW_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMGW_DATA", str(tmp_path / "no-llmgw-up-here"))


def _cluster() -> Scenario:
    s = Scenario()
    s.node("n1", "8xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["tp4:4"])
    s.replica("c1", "chat", on=("n1", [0, 1, 2, 3]), ready="-1h")
    return s


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _import(url: str, s: Scenario, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "--nats", url, "events", "import", str(s.write(tmp_path / "l")))
    assert code == 0, err


def test_snapshot_list_outputs(
    nats_server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    url = nats_server.url
    s = _cluster()
    _import(url, s, tmp_path, capsys)
    n = len(s.events())
    # Nothing stored yet: json is an empty list, name prints nothing.
    assert _run(capsys, "--nats", url, "snapshot", "--list", "-o", "json")[:2] == (0, "[]\n")
    assert _run(capsys, "--nats", url, "snapshot", "--list", "-o", "name")[:2] == (0, "")
    assert _run(capsys, "--nats", url, "snapshot")[0] == 0

    code, table, _ = _run(capsys, "--nats", url, "snapshot", "--list")
    assert code == 0 and f"seq {n:>10,}" in table
    code, out, _ = _run(capsys, "--nats", url, "snapshot", "--list", "-o", "json")
    assert code == 0
    listed = json.loads(out)
    assert len(listed) == 1
    snap = listed[0]
    assert snap["seq"] == n and snap["schema"] == SCHEMA and snap["used"] is True
    assert snap["key"] in table
    assert _run(capsys, "--nats", url, "snapshot", "--list", "--json")[1] == out

    code, names, _ = _run(capsys, "--nats", url, "snapshot", "--list", "-o", "name")
    assert code == 0 and names.splitlines() == [snap["key"]]
    code, wide, _ = _run(capsys, "--nats", url, "snapshot", "--list", "-o", "wide")
    head, row = wide.splitlines()
    assert head.split() == ["SEQ", "SCHEMA", "USED", "KEY"]
    assert row.split() == [f"{n:,}", str(SCHEMA), "yes", snap["key"]]


def test_snapshot_output_without_list_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["snapshot", "-o", "json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "-o json goes with --list" in err


def test_tail_outputs(nats_server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    url = nats_server.url
    s = _cluster()
    _import(url, s, tmp_path, capsys)
    events = s.events()
    tail = ("--nats", url, "events", "tail", "--since", "1", "--count", str(len(events)))

    code, out, err = _run(capsys, *tail, "-o", "name")
    assert code == 0, err
    want = []
    for seq, subject, e in events:
        key, _ = eventline.describe(e, subject)
        want.append(f"{seq} {type_of(type(e))} {key}")
    assert out.splitlines() == want

    code, alias, _ = _run(capsys, *tail, "--json")
    assert code == 0
    code, chosen, _ = _run(capsys, *tail, "-o", "json")
    assert code == 0 and chosen == alias
    assert [json.loads(line)["seq"] for line in chosen.splitlines()] == [
        seq for seq, _, _ in events
    ]

    code, table, _ = _run(capsys, *tail)
    assert code == 0 and table.splitlines()[0].split()[0] == "1"
    assert "{" not in table

    # -o wide: the table's line, then the event's id and what caused it.
    code, wide, err = _run(capsys, *tail, "-o", "wide")
    assert code == 0, err
    rows = wide.splitlines()
    assert len(rows) == len(events)
    for row, line, (_, _, e) in zip(rows, table.splitlines(), events, strict=True):
        assert row == f"{line}  id={e.id} cause={e.causation or '-'}"


@pytest.mark.parametrize("output", ["yaml"])
def test_tail_refuses_other_outputs_in_one_line(
    capsys: pytest.CaptureFixture[str], output: str
) -> None:
    assert cli.main(["events", "tail", "-o", output]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "invalid choice" in err
