"""Use makes idleness real: the gateway's `replica.used` (with its request counts) is
what the policy's eviction grace and the autoscaler's `idle_after_s` read. An on-demand
replica nobody calls after its wake-up becomes tier 0 once the grace has passed, then
goes to zero; one the gateway keeps reporting served stays out of tier 0 and awake."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from schemas import events as ev
from schemas import subjects
from services.core import autoscale, fold
from services.core.policy import Config, plan
from services.core.view import View

T0 = datetime(2026, 1, 1, 12, tzinfo=UTC)
GRACE = 300.0
IDLE = 900.0
CFG = Config(eviction_grace_s=GRACE, min_lifetime_s=0)
ONE = (ev.ProfileSpec(name="one", gpus=1),)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def _cluster(last_used: float) -> View:
    """One GPU; `od` (opportunistic, on demand) woken by a demand at 0 and served through
    the gateway, last at `last_used` s; `chat` (critical) declared and wanting room."""
    v = View()
    n = 0

    def put(data: ev.Data, s: float, source: str, node: str | None = None) -> None:
        nonlocal n
        n += 1
        e = ev.make(data, id=f"e{n}", time=at(s), source=source)
        assert fold.apply(v, e, seq=n, subject=subjects.subject_for(e, node=node)) is None

    gpu = ev.GpuInfo(index=0, uuid="g0", model="H100", memory_gb=80)
    put(ev.NodeInventory(node="n1", gpus=(gpu,), cpu_cores=8, memory_gb=64), 0, "agent/n1")
    put(
        ev.ModelDeclared(
            name="od", cls="opportunistic", min=0, max=1, idle_after_s=IDLE, profiles=ONE
        ),
        0,
        "operator",
    )
    put(ev.ModelDeclared(name="chat", cls="critical", min=0, max=1, profiles=ONE), 0, "operator")
    put(ev.ModelDemanded(model="od", waiting=1, since=at(0)), 0, "gateway")
    put(
        ev.ScaleDesired(model="od", replicas=1, reason="demand: 1 waiting since 12:00:00"),
        0,
        "scheduler",
    )
    shards = (ev.ShardSpec(node="n1", gpus=(0,)),)
    put(
        ev.PlacementDecided(replica="od-1", model="od", profile="one", shards=shards, reason="x"),
        0,
        "scheduler",
    )
    put(
        ev.ReplicaState(replica="od-1", model="od", profile="one", state="ready", shards=shards),
        10,
        "agent/n1",
        "n1",
    )
    # The gateway's reports, at most one per interval, each with what it served.
    t = 10.0
    while t <= last_used:
        put(
            ev.ReplicaUsed(replica="od-1", at=at(t), requests=3, tokens_in=30, tokens_out=90),
            t,
            "gateway",
            "n1",
        )
        t += 30.0
    put(ev.ScaleDesired(model="chat", replicas=1), last_used + 1, "operator/me")
    return v


def _tier(v: View, now: float) -> int | None:
    d = plan(v, "chat", at(now), CFG)
    got = [c.tier for c in d.candidates if c.replica == "od-1"]
    return got[0] if got else None


@pytest.mark.parametrize(
    ("last_used", "now", "tier", "awake"),
    [
        pytest.param(10, 10 + GRACE - 1, 2, True, id="nobody calls: within the grace, not tier 0"),
        pytest.param(10, 10 + GRACE, 0, True, id="nobody calls: past the grace, tier 0"),
        pytest.param(10, 10 + IDLE, 0, False, id="nobody calls: past idle_after_s, to zero"),
        pytest.param(2980, 2980 + 60, 2, True, id="serves: used a minute ago, not tier 0"),
        pytest.param(2980, 2980 + IDLE - 1, 0, True, id="serves: idle past the grace only"),
    ],
)
def test_use_from_the_gateway_is_what_idleness_reads(
    last_used: float, now: float, tier: int, awake: bool
) -> None:
    v = _cluster(last_used)
    rec = v.state.replicas["od-1"]
    assert rec.last_used_at == at(last_used)
    assert _tier(v, now) == tier
    scaled = autoscale.decide(v, at(now)).decisions
    assert (scaled == []) is awake
    if not awake:
        assert [(d.model, d.replicas, d.reason) for d in scaled] == [("od", 0, "idle 15m")]


def test_a_report_older_than_the_last_does_not_make_it_idle() -> None:
    """Reports from the agent (its server's metrics) and the gateway interleave: the
    latest `at` of either is kept, so a late report of an older use does not move the
    replica's last use back."""
    v = _cluster(610)
    e = ev.make(
        ev.ReplicaUsed(replica="od-1", at=at(100)), id="late", time=at(700), source="agent/n1"
    )
    assert fold.apply(v, e, seq=999, subject=subjects.subject_for(e, node="n1")) is None
    assert v.state.replicas["od-1"].last_used_at == at(610)
