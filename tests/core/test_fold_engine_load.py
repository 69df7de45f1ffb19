"""An engine's load, as its agent read it from the server's metrics and `replica.used`
carries it: kept on the replica in the view (the latest in the log), without moving its
last use, and said by the view's JSON (what the dashboard and explain show)."""

from __future__ import annotations

import pytest

from schemas import events as ev
from services.dashboard import state as dashboard
from services.replay import render
from tests.core.test_fold import Log, at, placed

pytestmark = pytest.mark.timeout(30)


def _load(minutes: float, **kw: int | float) -> ev.EngineLoad:
    return ev.EngineLoad(at=at(minutes), **kw)  # type: ignore[arg-type]


def test_the_latest_engine_load_is_the_replicas_and_its_use_stays_its_own() -> None:
    log = Log()
    placed(log)
    r = log.view.replicas["r1"]
    assert r.engine is None
    first = _load(5, running=2, waiting=1, kv_cache_usage=0.5, prompt_tokens=600)
    assert log.add(ev.ReplicaUsed(replica="r1", at=at(5), engine=first), 5, node="n1") is None
    assert r.engine == first and r.last_used_at == at(5)
    # A report whose use is older (the agent says the last use it reported) still brings
    # the engine's newer load; the last use stays where it was.
    later = _load(
        9,
        running=0,
        waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=2415,
        prefix_cache_hits=1152,
        prompt_tokens=2415,
        generation_tokens=12,
    )
    assert log.add(ev.ReplicaUsed(replica="r1", at=at(5), engine=later), 9, node="n1") is None
    assert r.engine == later and r.last_used_at == at(5)
    # A gateway's report (no engine) leaves it.
    gw = ev.ReplicaUsed(replica="r1", at=at(10), requests=1, tokens_in=3, tokens_out=1)
    assert log.add(gw, 10, node="n1") is None
    assert r.engine == later and r.last_used_at == at(10)

    said = render.replica_json(r, at(11))["engine"]
    assert said == {
        "running": 0,
        "waiting": 0,
        "kv_cache_usage": 0.0,
        "prefix_cache_queries": 2415,
        "prefix_cache_hits": 1152,
        "prompt_tokens": 2415,
        "generation_tokens": 12,
        "at": "2026-01-01T00:09:00Z",
        "prefix_cache_hit_rate": 0.477,
    }
    doc = dashboard.replica_json(log.view, "r1")
    assert doc is not None and doc["engine"] == said


def test_a_replica_no_engine_spoke_of_says_none() -> None:
    log = Log()
    placed(log)
    assert render.replica_json(log.view.replicas["r1"], at(2))["engine"] is None
    load = render.engine_json(_load(1, prefix_cache_queries=0, prefix_cache_hits=0))
    assert load["prefix_cache_hit_rate"] is None and load["running"] is None
