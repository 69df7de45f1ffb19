"""Scenarios shared by the replay tests: a small cluster, and a preemption told in full."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas import events as ev
from services.core.policy import Config, plan
from tests.scenario import Scenario


def cluster() -> Scenario:
    """Two nodes, a model per class, and a few replicas with a life."""
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "4xH100-80GB")
    s.node("n2", "4xH100-80GB", unhealthy=[3])
    s.model("chat", cls="critical", min=1, profiles=["two:2"])
    s.model("lab", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.replica("c1", "chat", on=("n2", [0, 1]), ready="-2h", created="-2h")
    s.replica("l1", "lab", on=("n1", [0]), ready="-1h", used="-1m")
    s.at("+1m")
    s.replica("l2", "lab", on=("n1", [1]), ready="+0s")
    s.at("+1m")
    s.scale("lab", 1)
    s.drain("l2", "scale_down")
    s.state("l2", "draining")
    s.at("+30s")
    s.state("l2", "stopped")
    s.emit(ev.NodeCordoned(node="n2"))
    return s


def preemption_story() -> tuple[Scenario, dict[str, object]]:
    """The preemption tests' shape: a node full of opportunistic replicas, a critical
    model's placement.failed, the policy's decision, the drains, the holds, and the
    victims going draining -> stopped."""
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "4xH100-80GB")
    s.node("n2", "2xH100-80GB")
    s.model("crit", cls="critical", min=1, profiles=["two:2"])
    s.model("chat", cls="critical", min=1, profiles=["two:2"])
    s.model("lab", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    s.replica("c1", "chat", on=("n2", [0, 1]), ready="-3h", created="-3h")
    for i in range(4):
        s.replica(f"l{i + 1}", "lab", on=("n1", [i]), ready="-2h", created="-2h", used="-1m")
    s.at("+1m")
    failed = s.emit(
        ev.PlacementFailed(
            model="crit",
            profiles=("two",),
            live=0,
            desired=1,
            reason="no_fit",
            why={"two": "no node has 2 free GPUs"},
        )
    )
    decision = plan(s.view(), "crit", s.now, Config())
    assert decision.outcome == "preempted", decision.reason
    decided = s.emit(decision.to_event_data(failed.id))
    victims = [v.replica for v in decision.victims]
    for v in victims:
        s.drain(v, "preempted", for_model="crit")
    for h in decision.holds:
        s.hold(h.model, h.for_model, h.until)
    s.at("+5s")
    for v in victims:
        s.state(v, "draining")
    s.at("+20s")
    for v in victims:
        s.state(v, "stopped")
    facts = {
        "trigger": failed.id,
        "decision": decided.id,
        "victims": victims,
        "candidates": [c.replica for c in decision.candidates],
        "excluded": {x.replica: x.why for x in decision.excluded},
        "tier": decision.victims[0].tier,
    }
    return s, facts


@pytest.fixture
def cluster_bundle(tmp_path: Path) -> tuple[Scenario, Path]:
    s = cluster()
    return s, s.write(tmp_path / "cluster.jsonl")


@pytest.fixture
def preemption_bundle(tmp_path: Path) -> tuple[Scenario, Path, dict[str, object]]:
    s, facts = preemption_story()
    return s, s.write(tmp_path / "preempt.jsonl"), facts
