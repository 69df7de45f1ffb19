"""The Grafana dashboard under deploy/ asks only for metrics `/metrics` exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.dashboard import metrics
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
    }
    m = metrics.Metrics(lambda: view, lambda: health)
    for seq, (_, _, e) in enumerate(s.events(), 1):
        from services.replay.subscribe import Changes

        m.observe(seq, Changes(type="x", keys=frozenset(), view=view, event=e))
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in m.render().decode().splitlines()
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
