"""Commands that could hurt say so first: `drain node` below a model's min needs --force,
`log compact` asks and says what it purges, `preemption plan` says when the model needs
nothing, `status` and `explain model` lead with why a model's replicas fail, and a
decision that stopped nothing does not read as success. Against a real nats-server."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from schemas import codec
from schemas import events as ev
from services import cli
from services.bus import EmbeddedBroker, connect, consume
from services.cli import app
from services.core import reaction
from services.core.policy import Config
from services.replay import eventline
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(90)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _seed(url: str, s: Scenario, tmp_path: Path) -> None:
    bundle = s.write(tmp_path / "seed.jsonl")
    assert cli.main(["--nats", url, "events", "import", str(bundle)]) == 0


def _stored(url: str) -> list[ev.Event]:
    async def read() -> list[ev.Event]:
        nc = await connect(url, "test")
        try:
            out: list[ev.Event] = []
            async for batch in consume.read_range(nc.jetstream(), 1, None):
                out.extend(codec.decode(d.data) for d in batch)
            return out
        finally:
            await nc.close()

    return asyncio.run(read())


# ---------------------------------------------------------------------- drain node


def _drain_cluster() -> Scenario:
    s = Scenario()
    s.node("n1", "8xH100-80GB")
    s.node("n2", "8xH100-80GB")
    s.model("web", cls="standard", min=1, max=2, profiles=["one:1"])
    s.model("chat", cls="critical", min=1, max=2, profiles=["one:1"])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.model("api", cls="critical", min=1, max=2, profiles=["one:1"])
    s.replica("w1", "web", on=("n1", [0]))
    s.replica("c1", "chat", on=("n1", [1]))
    s.replica("c2", "chat", on=("n1", [2]))
    s.replica("b1", "batch", on=("n1", [3]))
    s.replica("a1", "api", on=("n1", [4]))
    s.replica("a2", "api", on=("n2", [0]))  # api keeps one elsewhere: not below its min
    return s


def test_drain_below_min_needs_force(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = nats_server.url
    _seed(url, _drain_cluster(), tmp_path)
    capsys.readouterr()
    before = len(_stored(url))
    code, out, err = _run(capsys, "--nats", url, "drain", "node", "n1", "--yes")
    assert code == app.EXIT_REFUSED == 5 and out == ""
    line = err.strip()
    assert "\n" not in line
    assert line.startswith("llmgw: drain node n1 would take 2 models below its min: ")
    # Critical first; api keeps a replica on n2, batch's min is 0: neither is named.
    assert (
        "chat (critical) from 2 live to 0, below its min 1; "
        "web (standard) from 1 live to 0, below its min 1; nothing published" in line
    )
    assert "api" not in line and "batch" not in line and "--force" in line
    assert len(_stored(url)) == before
    # Asked, with --force, the question names them too.
    code, _, err = _run(capsys, "--nats", url, "drain", "node", "n1", "--force")
    assert code == app.EXIT_REFUSED and "this takes chat (critical) from 2 live to 0" in err
    assert len(_stored(url)) == before
    code, out, err = _run(capsys, "--nats", url, "drain", "node", "n1", "--force", "--yes")
    assert code == 0, err
    drained = [e.data.replica for e in _stored(url)[before:] if isinstance(e, ev.ReplicaDrainEvent)]
    assert sorted(drained) == ["a1", "b1", "c1", "c2", "w1"]


def test_drain_that_keeps_every_min_needs_no_force(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = nats_server.url
    _seed(url, _drain_cluster(), tmp_path)
    code, out, err = _run(capsys, "--nats", url, "drain", "node", "n2", "--yes")
    assert code == 0, err
    assert "1 replica draining" in out


# ---------------------------------------------------------------------- log compact


def test_compact_asks_and_says_what_it_purges(
    nats_server: EmbeddedBroker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = nats_server.url
    _seed(url, _drain_cluster(), tmp_path)
    n = len(_stored(url))
    where = tmp_path / "archive"
    argv = ["--nats", url, "log", "compact", "--before", "5", "--archive", str(where)]
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    code, out, err = _run(capsys, *argv)
    assert code == app.EXIT_REFUSED
    assert "archive seq 1..4 (4 events, stored 20" in err and f"to {where} and purge" in err
    assert "the stream, which then starts at seq 5? [y/N]" in err
    assert err.strip().splitlines()[-1] == (
        "llmgw: not confirmed; nothing archived or purged (--yes skips the question)"
    )
    assert len(_stored(url)) == n and not where.exists()
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert "the stream now starts at seq 5" in out
    assert len(_stored(url)) == n - 4


# ---------------------------------------------------------------------- preemption plan


def test_plan_says_when_the_model_needs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = str(_drain_cluster().write(tmp_path / "log.jsonl"))

    def plan(model: str) -> tuple[str, dict[str, object]]:
        code, text, err = _run(capsys, "preemption", "plan", "--model", model, "--log", log)
        assert code == 0, err
        code, out, err = _run(
            capsys, "preemption", "plan", "--model", model, "--log", log, "--json"
        )
        assert code == 0, err
        return text, json.loads(out)

    text, d = plan("chat")  # 2 live, max 2
    assert "note      chat is at its max (2 live, max 2): this plans one more" in text
    assert d["note"] and "at its max" in str(d["note"])
    text, d = plan("web")  # 1 live, desired 1 (its min), max 2
    assert "web is already at its desired count (1 live, desired 1)" in text
    assert "plans one more replica" in text
    s = _drain_cluster()
    s.scale("web", 2)
    log = str(s.write(tmp_path / "scaled.jsonl"))
    text, d = plan("web")
    assert "note" not in text.split("\n", 2)[1] and d["note"] is None


# ---------------------------------------------------------------------- a failing engine


def _failing() -> Scenario:
    s = Scenario()
    s.node("n1", "2xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["one:1"])
    s.model("batch", min=0, max=1, profiles=["one:1"])
    s.replica("b1", "batch", on=("n1", [1]))
    for i in range(3):
        s.replica(f"c{i}", "chat", on=("n1", [0]), state="starting")
        s.emit(
            ev.ReplicaState(
                replica=f"c{i}",
                model="chat",
                profile="one",
                state="failed",
                shards=(ev.ShardSpec(node="n1", gpus=(0,)),),
                reason="engine vllm is not installed on this host",
            )
        )
        s.at("+10s")
    return s


CAUSE = (
    "chat is failing: engine vllm is not installed on this host (3 replicas failed and "
    "none was ever ready, the latest c2 at 2026-01-01T12:00:20Z)"
)


def test_status_and_explain_lead_with_the_cause(
    nats_server: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = str(_failing().write(tmp_path / "log.jsonl"))
    code, out, _ = _run(capsys, "status", "--log", log)
    assert code == 0 and out.splitlines()[0] == f"FAILING  {CAUSE}"
    chat = next(x for x in out.splitlines() if x.strip().startswith("chat "))
    assert chat.endswith("failing: engine vllm is not installed on this host")
    code, out, _ = _run(capsys, "status", "--log", log, "-o", "json")
    models = {m["model"]: m for m in json.loads(out)["models"]}
    assert models["chat"]["failing"]["reason"] == "engine vllm is not installed on this host"
    assert models["batch"]["failing"] is None
    # Live: explain model's first line is the cause, and describe's.
    url = nats_server.url
    _seed(url, _failing(), tmp_path)
    capsys.readouterr()
    for argv in (["explain", "model", "chat"], ["describe", "model/chat"]):
        code, out, err = _run(capsys, "--nats", url, *argv)
        assert code == 0, err
        assert out.splitlines()[0] == CAUSE
    # Once a replica is ready again, the model is not failing.
    s = _failing()
    s.replica("c9", "chat", on=("n1", [0]))
    log = str(s.write(tmp_path / "healed.jsonl"))
    code, out, _ = _run(capsys, "status", "--log", log)
    assert "FAILING" not in out


# ---------------------------------------------------------------------- a decision that stops nothing


def test_a_retry_that_fits_does_not_read_as_success(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario()
    s.node("n1", "2xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["one:1"])
    why = "no node has room (n1 backing off until 12:00:40 after 3 failed starts)"
    e = s.emit(
        ev.PlacementFailed(
            model="chat", profiles=("one",), live=0, desired=1, reason="no_fit", why={"one": why}
        )
    )
    assert isinstance(e, ev.PlacementFailedEvent)
    r = reaction.react(s.view(), e, s.now, Config())
    assert r.decision is not None and r.decision.outcome == "fits"
    decided = r.events[0][0]
    assert isinstance(decided, ev.PreemptionDecidedEvent)
    assert decided.data.outcome == "fits"  # the contract's value stays
    said = decided.data.reason
    assert said.startswith("no preemption, nothing stopped (") and said.endswith(
        f"still not placed: {why}"
    )
    _, line = eventline.describe(decided)
    assert "outcome=fits" not in line and "no preemption (room free, model still unplaced)" in line
    # The view's decision summary (status's LAST DECISIONS) says the same, and explain.
    s.emit(decided.data)
    assert s.view().state.decisions[-1].summary == said
    log = str(s.write(tmp_path / "log.jsonl"))
    code = cli.main(["explain", "model", "chat", "--log", log])
    out = capsys.readouterr().out
    assert code == 0 and f": {said} (reference)" in out
