"""The Grafana dashboard under deploy/ asks only for metrics `/metrics` exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.dashboard import metrics
from services.gateway import metrics as gateway_metrics
from tests.replay.conftest import preemption_story

pytestmark = pytest.mark.timeout(30)

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmgw.json"


def test_every_panel_queries_an_exported_metric() -> None:
    s, _ = preemption_story()
    view = s.view()
    health = {
        "last_seq": 10,
        "projector": {"seq": 9, "lag_events": 1, "lag_s": 0.5},
        "dead_letters": {"projector": 2},
        "plane": {
            "running": True,
            "leaders": {
                "scheduler": {"holder": "h", "since": None, "renewed_s_ago": 1.0, "live": True},
                "preemption": None,
            },
            "projector": {"commit_age_s": 2.0},
        },
    }
    beats = {n: view.state.time for n in view.state.nodes}
    m = metrics.Metrics(
        lambda: view, lambda: health, beats=lambda: beats, now=lambda: view.state.time
    )
    for seq, (_, _, e) in enumerate(s.events(), 1):
        from services.replay.subscribe import Changes

        m.observe(seq, Changes(type="x", keys=frozenset(), view=view, event=e))
    # The gateway's panels ask for its own /metrics (each gateway is scraped too).
    g = gateway_metrics.Metrics()
    g.requests.labels("chat", "503").inc()
    g.errors.labels("chat", "no_replica").inc()
    exported = {
        line.split("{")[0].split(" ")[0]
        for text in (m.render(), g.render())
        for line in text.decode().splitlines()
        if line and not line.startswith("#")
    }
    doc = json.loads(GRAFANA.read_text())
    asked = {
        name
        for p in doc["panels"]
        for t in p["targets"]
        for name in re.findall(r"\bllmgw_\w+", t["expr"])
    }
    assert asked, "no queries found"
    assert asked <= exported, asked - exported


def _samples(m: metrics.Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (smp.name, tuple(sorted(smp.labels.items()))): smp.value
        for fam in text_string_to_metric_families(m.render().decode())
        for smp in fam.samples
    }


def test_the_series_alerts_are_written_on() -> None:
    """Per model desired/min/max/live and below its min; per node its state and heartbeat
    age; holds in force and their age; the leaders and the projector's last commit. Ages
    count from the scrape's `now`, a parameter."""
    from datetime import timedelta

    from schemas import events as ev
    from tests.scenario import Scenario

    s = Scenario()
    s.node("n1", "2xH100-80GB")
    s.node("n2", "2xH100-80GB")
    s.model("chat", cls="critical", min=2, max=3, profiles=["one:1"])
    s.model("batch", cls="opportunistic", min=0, max=2, profiles=["one:1"])
    s.replica("c1", "chat", on=("n1", [0]))
    s.replica("b1", "batch", on=("n2", [0]))
    s.hold("batch", "chat", "+60s")
    s.emit(ev.NodeLost(node="n2", reason="heartbeats stopped"))
    v = s.view()
    now = v.state.time + timedelta(seconds=20)
    health = {
        "plane": {
            "running": False,
            "leaders": {
                "scheduler": None,
                "preemption": {"holder": "p", "live": True, "renewed_s_ago": 0.5},
            },
            "projector": {"commit_age_s": 75.0},
        }
    }
    m = metrics.Metrics(
        lambda: v,
        lambda: health,
        beats=lambda: {"n1": now - timedelta(seconds=3)},
        now=lambda: now,
    )
    got = _samples(m)

    def at(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert at("llmgw_model_live_replicas", model="chat") == 1
    assert at("llmgw_model_desired_replicas", model="chat") == 2
    assert (
        at("llmgw_model_min_replicas", model="chat"),
        at("llmgw_model_max_replicas", model="chat"),
    ) == (2, 3)
    assert at("llmgw_model_below_min", model="chat", **{"class": "critical"}) == 1
    assert at("llmgw_model_below_min", model="batch", **{"class": "opportunistic"}) == 0
    assert at("llmgw_node_state", node="n2", state="lost") == 1
    assert at("llmgw_node_state", node="n2", state="ready") == 0
    assert at("llmgw_node_state", node="n1", state="ready") == 1
    assert at("llmgw_node_heartbeat_age_seconds", node="n1") == 3
    assert ("llmgw_node_heartbeat_age_seconds", (("node", "n2"),)) not in got  # never heard
    assert at("llmgw_holds_active") == 1
    assert at("llmgw_hold_age_seconds", model="batch", for_model="chat") == 20
    assert at("llmgw_leader", role="scheduler") == 0
    assert at("llmgw_leader", role="preemption") == 1
    assert at("llmgw_leader_info", role="preemption", holder="p") == 1
    assert at("llmgw_projector_commit_age_seconds") == 75
    assert at("llmgw_plane_running") == 0
    # Once the hold has passed, it is not in force.
    m.now = lambda: now + timedelta(seconds=60)
    assert _samples(m)[("llmgw_holds_active", ())] == 0
