"""`llmgw status`: ages from now, -o json|wide|name, quota per owner, and --watch."""

from __future__ import annotations

import io
import json
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from schemas import events as ev
from services import cli
from services.cli import status
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)


def _cluster() -> Scenario:
    s = Scenario()
    s.node("n1", "8xH100-80GB", labels={"zone": "a"})
    s.node("n2", "8xH100-80GB")
    s.quota(
        {
            "team-a": {"guarantee": {"gpus": 4}, "limit": {"gpus": 8}},
            "team-b": {"guarantee": {"gpus": 0}},
        }
    )
    s.model("chat", cls="critical", min=2, profiles=["tp4:4"], owner="team-a", aliases=["c"])
    s.model("batch", cls="opportunistic", min=0, max=8, profiles=["one:1"], owner="team-b")
    s.scale("batch", 20)
    s.replica("c1", "chat", on=("n1", [0, 1, 2, 3]), ready="-1h")
    s.replica("b1", "batch", on=("n2", [0]), ready="-1h", used="-2m")
    return s


def test_ages_count_from_now_not_from_the_last_event() -> None:
    s = _cluster()
    view = s.view()
    last = view.state.time
    assert last is not None
    out = status.text(view, "here", now=last + timedelta(minutes=1))
    assert "last event 1m ago" in out
    decisions = out.split("LAST DECISIONS")[1]
    assert "1h1m ago" in decisions
    # Without a now (only a bundle: `status --log`), ages count from its last event; a
    # broker's log, live or a stopped plane's, passes the wall clock (test_offline_read).
    assert "last event now" in status.text(view, "here")


def test_a_hold_past_its_until_is_off_at_now() -> None:
    s = _cluster()
    s.hold("batch", "chat", until="+5m")
    view = s.view()
    assert view.state.time is not None
    later = status.summary(view, now=view.state.time + timedelta(minutes=6))
    assert [h["on"] for h in later["holds"]] == [False]
    assert status.summary(view)["holds"][0]["on"] is True


def test_quota_per_owner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _cluster().write(tmp_path / "log.jsonl")
    assert cli.main(["status", "--log", str(log), "-o", "json"]) == 0
    quota = {q["owner"]: q for q in json.loads(capsys.readouterr().out)["quota"]}
    assert quota["team-a"]["guarantee"]["gpus"] == 4
    assert quota["team-a"]["limit"]["gpus"] == 8
    assert quota["team-a"]["used"]["gpus"] == 4 and quota["team-a"]["borrowed_gpus"] == 0
    # team-b has no guarantee: all it holds is borrowed.
    assert quota["team-b"]["limit"] is None
    assert quota["team-b"]["used"]["gpus"] == 1 and quota["team-b"]["borrowed_gpus"] == 1
    assert cli.main(["status", "--log", str(log)]) == 0
    out = capsys.readouterr().out
    table = out.split("QUOTA")[1].split("HOLDS")[0]
    assert [line.split() for line in table.strip().splitlines()[1:]] == [
        ["OWNER", "PARENT", "GUARANTEED", "LIMIT", "USED", "BORROWED"],
        ["team-a", "-", "4", "8", "4", "0"],
        ["team-b", "-", "0", "none", "1", "1"],
    ]
    assert "asked 20, its max is 8" in out


@pytest.mark.parametrize("flag", [["--json"], ["-o", "json"], ["--output", "json"]])
def test_json_spellings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    log = _cluster().write(tmp_path / "log.jsonl")
    assert cli.main(["status", "--log", str(log), *flag]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"] == {"total": 16, "used": 5, "lost": 0}


def test_wide_and_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _cluster().write(tmp_path / "log.jsonl")
    assert cli.main(["status", "--log", str(log), "-o", "wide"]) == 0
    out = capsys.readouterr().out
    chat = next(line for line in out.splitlines() if line.strip().startswith("chat "))
    assert chat.split()[5:8] == ["2..2", "c", "tp4"]
    assert "zone=a" in out and "REPLICAS" in out
    assert cli.main(["status", "--log", str(log), "-o", "name"]) == 0
    assert capsys.readouterr().out.split() == [
        "node/n1",
        "node/n2",
        "model/batch",
        "model/chat",
        "replica/b1",
        "replica/c1",
        "owner/team-a",
        "owner/team-b",
    ]


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        pytest.param(["-o", "yaml"], 2, "invalid choice", id="unknown output"),
        pytest.param(["--count", "2"], 2, "--count goes with --watch", id="count alone"),
        pytest.param(["--watch", "--log", "x.jsonl"], 2, "does not change", id="watch a bundle"),
    ],
)
def test_status_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int, says: str
) -> None:
    assert cli.main(["status", *argv]) == code
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and says in err, err


def test_live_status_counts_ages_from_the_wall_clock(  # type: ignore[no-untyped-def]
    nats_server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The scenario's events are stamped in January 2026: far from now, and status says so.
    log = _cluster().write(tmp_path / "log.jsonl")
    assert cli.main(["--nats", nats_server.url, "events", "import", str(log)]) == 0
    capsys.readouterr()
    # A broker with a log and no plane running on it: the status, headed by why, exit 1.
    assert cli.main(["--nats", nats_server.url, "status"]) == 1
    headline, head = capsys.readouterr().out.splitlines()[:2]
    assert headline == "PLANE NOT RUNNING: no scheduler leads; no preemption leads", headline
    age = (datetime.now(UTC) - _cluster().view().state.time).days  # type: ignore[operator]
    assert f"last event {age}d" in head, head


class _Frames(io.StringIO):
    """stdout that tells a waiting test when a drawing has been printed."""

    def __init__(self) -> None:
        super().__init__()
        self.frames = 0
        self.cv = threading.Condition()

    def write(self, s: str) -> int:
        n = super().write(s)
        with self.cv:
            self.frames += s.count("GPUs in use")
            self.cv.notify_all()
        return n

    def wait_for(self, frames: int) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.frames >= frames, timeout=20)


def test_watch_redraws_on_every_event(nats_server, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    url = nats_server.url
    log = _cluster().write(tmp_path / "log.jsonl")
    assert cli.main(["--nats", url, "events", "import", str(log)]) == 0
    out = _Frames()
    monkeypatch.setattr("sys.stdout", out)
    codes: list[int] = []
    watcher = threading.Thread(
        target=lambda: codes.append(
            cli.main(["--nats", url, "status", "--watch", "--count", "2", "--interval", "600"])
        )
    )
    watcher.start()
    try:
        assert out.wait_for(1), "no first drawing"
        assert "n1    ready" in out.getvalue()
        assert cli.main(["--nats", url, "cordon", "n1"]) == 0
        assert out.wait_for(2), "no redraw after the cordon"
    finally:
        watcher.join(timeout=20)
    assert codes == [0]
    last = out.getvalue().rsplit("GPUs in use", 1)[1]
    assert "n1    cordoned" in last


def _retried(s: Scenario, times: int, live: int = 2) -> None:
    """The scheduler's retry of a count that cannot be placed, every 5 s, and the
    preemption service's same answer to each."""
    for _ in range(times):
        s.at("+5s")
        failed = s.emit(
            ev.PlacementFailed(
                model="chat",
                profiles=("tp4",),
                live=live,
                desired=3,
                reason="no_fit",
                why={"tp4": "no node with 4 free GPUs of >= 80 GB; best had 0"},
            )
        )
        s.emit(ev.PreemptionDecided(for_model="chat", outcome="no_candidates", trigger=failed.id))


def test_a_retried_placement_failure_is_one_row_with_its_count() -> None:
    s = _cluster()
    _retried(s, 12)
    _retried(s, 1, live=1)  # another count is another decision
    view = s.view()
    assert view.state.time is not None
    now = view.state.time + timedelta(seconds=3)
    out = status.text(view, "here", now=now)
    decisions = out.split("LAST DECISIONS")[1]
    rows = [line for line in decisions.splitlines() if "placement.failed" in line]
    assert len(rows) == 2, decisions
    assert "\u00d712, last 8s ago" in rows[0] and "live 2/3" in rows[0], rows
    assert "\u00d7" not in rows[1] and "3s ago" in rows[1] and "live 1/3" in rows[1], rows
    answers = [line for line in decisions.splitlines() if "no_candidates" in line]
    assert len(answers) == 1 and "\u00d713, last 3s ago" in answers[0], answers
    # The placement and the replicas the story started with are still there: the retries
    # no longer push them out of the rows shown.
    assert "placement.decided" in decisions
    doc = status.summary(view, now=now)
    failed = [d for d in doc["decisions"] if d["type"] == "placement.failed"]
    assert [d["count"] for d in failed] == [12, 1]
    assert failed[0]["first_seq"] < failed[0]["seq"] < failed[1]["seq"]
    assert failed[0]["first_time"] < failed[0]["time"]
