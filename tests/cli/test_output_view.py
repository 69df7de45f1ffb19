"""`llmgw view -o table|wide|json|name` and `view --watch`, in-process against a bundle and
a real broker."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest

from services import cli
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
    s.node("n2", "8xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["tp4:4"])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.replica("c1", "chat", on=("n1", [0, 1, 2, 3]), created="-2h", ready="-1h", used="-5m")
    s.replica("b1", "batch", on=("n2", [0]), ready="-1h")
    s.replica("b2", "batch", on=("n2", [1]), ready="-30m")
    s.state("b2", "stopped")
    s.at("+1m")
    return s


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_is_the_alias_of_o_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(_cluster().write(tmp_path / "log.jsonl"))
    code, alias, _ = _run(capsys, "view", "--log", log, "--json")
    assert code == 0
    code, chosen, _ = _run(capsys, "view", "--log", log, "-o", "json")
    assert code == 0 and chosen == alias
    d = json.loads(chosen)
    assert [r["id"] for r in d["replicas"]] == ["b1", "b2", "c1"]
    assert {"seq", "time", "digest", "nodes", "models", "replicas", "holds"} <= set(d)


def test_table_is_the_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(_cluster().write(tmp_path / "log.jsonl"))
    _, plain, _ = _run(capsys, "view", "--log", log)
    _, table, _ = _run(capsys, "view", "--log", log, "-o", "table")
    assert plain == table and "NODES x GPUS" in plain
    assert "CREATED" not in plain


def test_wide_adds_gpus_and_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = _cluster()
    log = str(s.write(tmp_path / "log.jsonl"))
    code, out, _ = _run(capsys, "view", "--log", log, "-o", "wide")
    assert code == 0
    head = next(line for line in out.splitlines() if "REPLICA" in line and "STATE" in line)
    for col in ("PROFILE", "GPUS", "CREATED", "READY AT", "LAST USED"):
        assert col in head, head
    c1 = next(line for line in out.splitlines() if line.strip().startswith("c1 "))
    v = s.view()
    r = v.state.replicas["c1"]
    assert "n1:0-3" in c1 and "tp4" in c1
    for t in (r.created_at, r.ready_at, r.last_used_at):
        assert t is not None and t.strftime("%Y-%m-%dT%H:%M:%SZ") in c1
    # b1 never served a request: its last use is unknown.
    b1 = next(line for line in out.splitlines() if line.strip().startswith("b1 "))
    assert "n2:0 " in b1


def test_name_is_one_kind_slash_name_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = str(_cluster().write(tmp_path / "log.jsonl"))
    code, out, _ = _run(capsys, "view", "--log", log, "-o", "name")
    assert code == 0
    assert out.splitlines() == [
        "node/n1",
        "node/n2",
        "model/batch",
        "model/chat",
        "replica/b1",
        "replica/c1",
    ]
    # --all lists the stopped replica too, as the table does.
    _, everything, _ = _run(capsys, "view", "--log", log, "-o", "name", "--all")
    assert "replica/b2" in everything.splitlines()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        pytest.param(["-o", "yaml"], "invalid choice", id="unknown output"),
        pytest.param(["--count", "2"], "--count goes with --watch", id="count alone"),
        pytest.param(["--watch", "--log", "x.jsonl"], "does not change", id="watch a bundle"),
        pytest.param(["--watch", "--seq", "4"], "--seq", id="watch a seq"),
        pytest.param(["--watch", "--at", "10m"], "--at", id="watch a time"),
        pytest.param(["--watch", "--count", "0"], "--count", id="count zero"),
    ],
)
def test_view_usage_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert cli.main(["view", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and says in err, err


class _Frames(io.StringIO):
    """stdout that tells a waiting test when a drawing has been printed."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.frames = 0
        self.cv = threading.Condition()

    def write(self, s: str) -> int:
        n = super().write(s)
        with self.cv:
            self.frames += s.count(self.marker)
            self.cv.notify_all()
        return n

    def wait_for(self, frames: int) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.frames >= frames, timeout=20)


def _watch(url: str, out: _Frames, argv: list[str], change: list[str]) -> tuple[list[int], str]:
    codes: list[int] = []
    watcher = threading.Thread(
        target=lambda: codes.append(cli.main(["--nats", url, "view", "--watch", *argv]))
    )
    watcher.start()
    try:
        assert out.wait_for(1), "no first drawing"
        first = out.getvalue()
        assert cli.main(["--nats", url, *change]) == 0
        assert out.wait_for(2), "no redraw after the change"
    finally:
        watcher.join(timeout=20)
    assert not watcher.is_alive()
    return codes, first


def test_watch_redraws_the_view_on_every_event(
    nats_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    url = nats_server.url
    log = _cluster().write(tmp_path / "log.jsonl")
    assert cli.main(["--nats", url, "events", "import", str(log)]) == 0
    out = _Frames("NODES x GPUS")
    monkeypatch.setattr("sys.stdout", out)
    codes, first = _watch(url, out, ["--count", "2"], ["cordon", "n1"])
    assert codes == [0]
    assert "cordoned" not in first
    last = out.getvalue().rsplit("NODES x GPUS", 1)[1]
    n1 = next(line for line in last.splitlines() if line.strip().startswith("n1"))
    assert "cordoned" in n1
    assert out.frames == 2


def test_watch_in_json_draws_one_object_per_event(
    nats_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    url = nats_server.url
    log = _cluster().write(tmp_path / "log.jsonl")
    assert cli.main(["--nats", url, "events", "import", str(log)]) == 0
    out = _Frames('"digest"')
    monkeypatch.setattr("sys.stdout", out)
    codes, _ = _watch(url, out, ["-o", "json", "--count", "2"], ["cordon", "n2"])
    assert codes == [0]
    dec = json.JSONDecoder()
    # The cordon's own line goes to the same stdout, between the drawings.
    lines = out.getvalue().splitlines()
    text = "\n".join(x for x in lines if not x.startswith("node.cordoned"))
    docs, at = [], 0
    while at < len(text.rstrip()):
        while text[at].isspace():
            at += 1
        doc, at = dec.raw_decode(text, at)
        docs.append(doc)
    assert len(docs) == 2 and docs[1]["seq"] > docs[0]["seq"]
    n2 = next(n for n in docs[1]["nodes"] if n["name"] == "n2")
    assert n2["cordoned"] is True
