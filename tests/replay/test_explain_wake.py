"""`explain model` tells a critical on-demand model's wake-up by demand as one chain:
demand -> the autoscaler's scale -> placement.failed -> preemption.decided -> drain ->
placed -> ready, each step the log's own event. The log is made by the core's own
decisions (the autoscaler, a scheduler's pass, the policy's reaction) on one GPU held
by an idle opportunistic replica."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas import events as ev
from services import cli
from services.core import autoscale, reaction, scheduling
from services.core.policy import Config
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(30)


def _woken(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    s = Scenario("2026-01-01T12:00:00Z")
    s.node("n1", "1xH100-80GB")
    s.model("batch", cls="opportunistic", min=0, max=1)
    s.model("urgent", cls="critical", min=0, max=1)
    s.scale("batch", 1)
    s.replica("batch-1", "batch", on=("n1", [0]), ready="-1h", used="-30m")
    s.at("+1s")
    demand = s.emit(ev.ModelDemanded(model="urgent", waiting=2, since=s.time("-1s")))
    ids = {"demand": demand.id}
    # The autoscaler wakes it.
    s.at("+0.1s")
    (woke,) = autoscale.decide(s.view(), s.now).decisions
    ids["scale"] = s.put(woke.event).id
    # The scheduler finds no room; the policy stops the idle batch replica for it.
    s.at("+0.1s")
    out = scheduling.plan(s.view(), s.now, scheduling.Config())
    (failed,) = [o.event for o in out.outputs if isinstance(o.event, ev.PlacementFailedEvent)]
    ids["failed"] = s.put(failed).id
    r = reaction.react(s.view(), failed, s.now, Config(eviction_grace_s=0, min_lifetime_s=0))
    for e, node in r.events:
        s.put(e, node)
        if isinstance(e, ev.PreemptionDecidedEvent):
            ids["decision"] = e.id
        if isinstance(e, ev.ReplicaDrainEvent):
            ids["drain"] = e.id
    s.at("+2s")
    s.state("batch-1", "draining")
    s.state("batch-1", "stopped")
    # The next pass places it; its agent reports it ready.
    s.at("+0.1s")
    out = scheduling.plan(s.view(), s.now, scheduling.Config())
    placed = None
    for o in out.outputs:
        s.put(o.event, o.node)
        if isinstance(o.event, ev.PlacementDecidedEvent):
            placed = o.event
    assert placed is not None
    ids["placed"] = placed.id
    s.at("+3s")
    s.state(placed.data.replica, "ready")
    ids["replica"] = placed.data.replica
    ids["ready"] = s.events()[-1][2].id
    return s.write(tmp_path / "woken.jsonl"), ids


def test_explain_model_tells_the_wake_up_as_one_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, ids = _woken(tmp_path)
    assert cli.main(["explain", "model", "urgent", "--log", str(path)]) == 0
    out = capsys.readouterr().out
    chain = out[out.index("woken by demand") :].split("\n\n")[0].splitlines()[1:]
    labels = [line.split()[0] for line in chain]
    assert labels == ["demand", "scale", "no", "preemption", "drain", "placed", "ready"], out
    for line, key in zip(
        chain, ("demand", "scale", "failed", "decision", "drain", "placed"), strict=False
    ):
        assert ids[key] in line, (key, line)
    assert "2 requests waiting since 2026-01-01T12:00:00Z" in chain[0]
    assert "demand: 2 waiting since 12:00:00" in chain[1]
    assert "batch-1 (batch, tier 0: idle on-demand replica of a lower class)" in chain[3]
    assert ids["replica"] in chain[-1] and "5.3s after the demand" in chain[-1]
    assert "demand: 2 requests waiting since" in out.splitlines()[2], out
    assert cli.main(["explain", "model", "urgent", "--log", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    woken = doc["woken"]
    assert woken["demand"] == ids["demand"] and woken["ready"] == ids["ready"]
    assert woken["drains"] == [ids["drain"]]
    assert doc["demand"]["answered_by"] == ids["scale"]


def test_a_model_never_woken_by_demand_says_nothing_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = _woken(tmp_path)
    assert cli.main(["explain", "model", "batch", "--log", str(path)]) == 0
    out = capsys.readouterr().out
    assert "woken by demand" not in out and "demand:" not in out


def test_view_shows_the_demand_and_the_autoscalers_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, ids = _woken(tmp_path)
    assert cli.main(["view", "--log", str(path)]) == 0
    out = capsys.readouterr().out
    (urgent,) = [line for line in out.splitlines() if line.startswith("  urgent  (")]
    assert "demand: 2 waiting since 2026-01-01T12:00:00Z" in urgent
    assert "scaled: demand: 2 waiting since 12:00:00" in urgent
    (batch,) = [line for line in out.splitlines() if line.startswith("  batch  (")]
    assert "demand" not in batch and "scaled" not in batch
    assert cli.main(["view", "--log", str(path), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)["models"]
    assert doc["urgent"]["demand"]["answered_by"] == ids["scale"]
    assert doc["urgent"]["scaled_reason"] == "demand: 2 waiting since 12:00:00"
    assert doc["batch"]["demand"] is None and doc["batch"]["scaled_reason"] is None
