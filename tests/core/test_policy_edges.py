"""The reference policy at its edges: where the Go reference (reference/preempt.go) and
the port were found to choose differently, each pinned as a table under its rule.

Run side by side on 2,000 random clusters, the two agreed everywhere but at three
edges, where the port had decided differently from the reference's own code: the
instant a hold ends, a use stamped after the decision's `now`, and an eviction grace
of zero. Each table reproduces the repro of the report exactly, with its neighbours.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from schemas import events as ev
from services.cli import status
from services.core import fold, reaction
from services.core.policy import Config, plan
from services.replay import explain
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(60)

T0 = datetime.fromisoformat("2026-01-01T12:00:00+00:00")
TICK = timedelta(microseconds=1)


# ---------------------------------------------------------------- hold end
#
# A hold ends only after its `until`. The reference: "hold keeps a model that gave up
# room from taking it back", and "isHeld reports whether a model gave up room and may
# not take it back yet"; it drops the hold only `if r.now().After(h.Until)`, so at
# `now == until` exactly the model is still held. The same instant everywhere a hold's
# end is judged, or the service would release a hold the policy still honours.


def held_m4(until: datetime) -> Scenario:
    """A node with one free GPU, and a hold on m4 for m3 until `until`."""
    s = Scenario(T0)
    s.node("n1", "2xH100-80GB")
    s.model("m1", cls="standard", min=1, profiles=["one:1"])
    s.model("m3", cls="critical", min=1, profiles=["two:2"])
    s.model("m4", cls="critical", min=1, profiles=["one:1"])
    s.replica("m1-r1", "m1", on=("n1", [0]), ready="-3h", created="-3h")
    s.hold("m4", "m3", until=until)
    return s


@pytest.mark.parametrize(
    ("until", "outcome", "released"),
    [
        pytest.param(T0 + TICK, "held", None, id="before until: held"),
        pytest.param(T0, "held", None, id="at until exactly: still held (the repro)"),
        pytest.param(T0 - TICK, "fits", "expired", id="after until: over"),
    ],
)
def test_a_hold_ends_only_after_its_until(
    until: datetime, outcome: str, released: str | None
) -> None:
    s = held_m4(until)
    view = s.view()
    now = T0
    d = plan(view, "m4", now, Config())
    assert d.outcome == outcome
    # The same boundary wherever a hold's end is decided: the rule itself, the
    # service's release of holds, and `llmgw status` (`llmgw explain` reads
    # `View.active_hold` too).
    assert view.hold_end("m3", until, now) == released
    assert (view.active_hold("m4", now) is None) == (released is not None)
    assert [e.data.reason for e in reaction.releases(view, now)] == ([released] if released else [])
    st = status.summary(view, now=now)
    [hold] = st["holds"]
    assert hold["on"] == (released is None)
    [m4] = [m for m in st["models"] if m["model"] == "m4"]
    assert m4["held_for"] == (None if released else "m3")
    # `llmgw explain` judges a hold at the time of the view's last event (the hold's).
    assert view.state.time == now
    seq, _, created = s.events()[-1]
    assert isinstance(created, ev.HoldCreatedEvent)
    state, _ = explain.Explainer("m4", kind="model").hold_state(seq, created, view)
    assert state == ("over" if released else "still on")


@pytest.mark.parametrize(
    ("after_until", "published"),
    [
        pytest.param(-TICK, 1, id="before until: published"),
        pytest.param(timedelta(0), 1, id="at until exactly: still on, published"),
        pytest.param(TICK, 0, id="after until: over, not published"),
    ],
)
def test_a_hold_ends_only_after_its_until_for_a_hold_a_crash_left_out(
    after_until: timedelta, published: int
) -> None:
    s = Scenario(T0)
    s.node("n1", "1xH100-80GB")
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.model("m3", cls="critical", min=1, profiles=["one:1"])
    s.replica("l1", "lab", on=("n1", [0]), ready="-3h", used="-1h")
    e = s.emit(
        ev.PlacementFailed(model="m3", profiles=("one",), live=0, desired=1, reason="no_fit")
    )
    assert isinstance(e, ev.PlacementFailedEvent)
    view = s.view()
    r = reaction.react(view, e, T0, Config(hold_s=60))
    [decided, drain, hold] = [x for x, _ in r.events]
    assert isinstance(decided, ev.PreemptionDecidedEvent)
    assert isinstance(hold, ev.HoldCreatedEvent)
    for x in (decided, drain):  # a crash before the hold was published
        fold.apply(view, x, seq=view.seq + 1)
    now = hold.data.until + after_until
    assert len(reaction.missing(view, decided, now)) == published


# ---------------------------------------------------------------- order: longest idle first
#
# Within a tier, the longest unused first. The reference: "idleFor is how long a replica
# has gone unused; zero when nobody has said, which is not the same as idle." It is
# `now.Sub(rep.LastUsedAt)`, unclamped: a use stamped after the decision's now (clock
# skew between hosts, `--now` in the past) is a negative idle time, and that replica
# sorts after an equal one never reported used, before size and id are looked at.


def skewed(used: str | None) -> Scenario:
    """n1: m1-r1 on GPUs 0-3, m2-r1 on GPU 4 (used at `used`), m2-r2 on GPU 5 (never
    used); m2 standard with min 2."""
    s = Scenario(T0)
    s.node("n1", "6xH100-80GB")
    s.model("m1", cls="critical", min=1, profiles=["one:1", "four:4"])
    s.model("m2", cls="standard", min=2, profiles=["one:1"])
    s.replica("m1-r1", "m1", on=("n1", [0, 1, 2, 3]), ready="-3h", created="-3h")
    s.replica("m2-r1", "m2", on=("n1", [4]), ready="-3h", created="-3h")
    s.replica("m2-r2", "m2", on=("n1", [5]), ready="-2h", created="-2h")
    if used is not None:
        s.used("m2-r1", used)
    return s


@pytest.mark.parametrize(
    ("used", "idle_s", "victim", "order"),
    [
        pytest.param(
            "+59s", -59.0, "m2-r2", ["m2-r2", "m2-r1"], id="used after now: sorts last (the repro)"
        ),
        pytest.param(None, None, "m2-r1", ["m2-r1", "m2-r2"], id="both unknown: by id"),
        pytest.param("+0s", 0.0, "m2-r1", ["m2-r1", "m2-r2"], id="used at now: equal, by id"),
        pytest.param("-1s", 1.0, "m2-r1", ["m2-r1", "m2-r2"], id="used before now: first"),
    ],
)
def test_order_a_use_reported_after_now_is_a_negative_idle_time(
    used: str | None, idle_s: float | None, victim: str, order: list[str]
) -> None:
    s = skewed(used)
    d = plan(s.view(), "m1", T0, Config())
    assert d.outcome == "preempted"
    assert [c.replica for c in d.candidates] == order
    assert {c.replica: c.tier for c in d.candidates} == {"m2-r1": 4, "m2-r2": 4}
    assert {c.replica: c.idle_s for c in d.candidates}["m2-r1"] == idle_s
    assert [v.replica for v in d.victims] == [victim]
    # The event contract carries the negative idle time as it is.
    assert [v.idle_s for v in d.to_event_data().candidates] == [c.idle_s for c in d.candidates]


# ---------------------------------------------------------------- tier 0: idle on-demand
#
# Tier 0: "idle on-demand ones first". The reference's test is
# `idleFor(rep, now) >= r.cfg.EvictionGrace` for an on-demand replica of a lower class,
# and idleFor is zero for a replica never reported used. With a grace of zero that holds
# (0 >= 0): on-demand replicas go first however recently they served, and one never
# reported used is no exception.


def on_demand(grace: float, od_used: str | None) -> tuple[Scenario, Config]:
    """n1 holds od-1 (opportunistic, min 0) and opp-2 (opportunistic, min 1, idle
    5,000 s), n2 holds opp-1; crit (critical, 1 GPU) is to be placed."""
    s = Scenario(T0)
    s.node("n1", "2xH100-80GB")
    s.node("n2", "1xH100-80GB")
    s.model("crit", cls="critical", min=1, profiles=["one:1"])
    s.model("od", cls="opportunistic", min=0, profiles=["one:1"])
    s.model("opp", cls="opportunistic", min=1, profiles=["one:1"])
    s.replica("opp-1", "opp", on=("n2", [0]), ready="-3h", created="-3h")
    s.replica("od-1", "od", on=("n1", [0]), ready="-3h", created="-3h", used=od_used)
    s.replica("opp-2", "opp", on=("n1", [1]), ready="-2h", created="-2h", used="-5000s")
    return s, Config(eviction_grace_s=grace)


@pytest.mark.parametrize(
    ("grace", "od_used", "od_tier", "victim"),
    [
        pytest.param(0.0, None, 0, "od-1", id="grace 0, never used: tier 0 (the repro)"),
        pytest.param(0.0, "+0s", 0, "od-1", id="grace 0, used at now: tier 0"),
        pytest.param(600.0, None, 2, "opp-2", id="grace 600, never used: not idle"),
        pytest.param(600.0, "-599s", 2, "opp-2", id="grace 600, inside it: not tier 0"),
        pytest.param(600.0, "-600s", 0, "od-1", id="grace 600, at it: tier 0"),
    ],
)
def test_tier0_an_eviction_grace_of_zero(
    grace: float, od_used: str | None, od_tier: int, victim: str
) -> None:
    s, cfg = on_demand(grace, od_used)
    d = plan(s.view(), "crit", T0, cfg)
    assert d.outcome == "preempted"
    tiers = {c.replica: c.tier for c in d.candidates}
    assert tiers == {"od-1": od_tier, "opp-2": 2, "opp-1": 4}
    assert [v.replica for v in d.victims] == [victim]
