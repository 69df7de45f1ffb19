"""The preemption service's reactions in core: the events of a decision, what a crashed
decision left unpublished, and when a hold ends (`View.hold_end`, the one rule).

Each test builds a small cluster as an event log (tests/scenario.py), asks the core, and
folds what it returned back into the view, as the service's publish would.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from schemas import events as ev
from schemas import ids, subjects
from services.core import fold, reaction
from services.core.policy import Config
from services.core.view import View
from tests.scenario import Scenario

CFG = Config(hold_s=60.0)


def full_cluster() -> Scenario:
    """Two 4-GPU nodes full of idle `batch` replicas; `chat` needs four GPUs on one node.
    The policy stops b1 and b2 (the longest idle, both on n1)."""
    s = Scenario()
    s.node("n1", "4xH100-80GB").node("n2", "4xH100-80GB")
    s.model("batch", cls="opportunistic", min=0, max=8, profiles=["two:2"])
    s.model("chat", cls="critical", min=1, profiles=["tp4:4"])
    s.replica("b1", "batch", on=("n1", [0, 1]), ready="-3h", used="-50m")
    s.replica("b2", "batch", on=("n1", [2, 3]), ready="-3h", used="-40m")
    s.replica("b3", "batch", on=("n2", [0, 1]), ready="-3h", used="-30m")
    s.replica("b4", "batch", on=("n2", [2, 3]), ready="-3h", used="-20m")
    return s


def trigger(s: Scenario, reason: str = "no_fit") -> ev.PlacementFailedEvent:
    e = s.emit(
        ev.PlacementFailed(model="chat", profiles=("tp4",), live=0, desired=1, reason=reason)
    )
    assert isinstance(e, ev.PlacementFailedEvent)
    return e


def publish(view: View, outgoing: tuple[reaction.Outgoing, ...] | list[ev.Event]) -> None:
    """Fold what the service would publish, in order."""
    for item in outgoing:
        e, node = item if isinstance(item, tuple) else (item, None)
        fold.apply(view, e, seq=view.seq + 1, subject=subjects.subject_for(e, "llmgw", node))


def test_a_decision_is_its_event_then_a_drain_per_victim_then_a_hold() -> None:
    s = full_cluster()
    t = trigger(s)
    r = reaction.react(s.view(), t, s.now, CFG, drain_grace_s=7.0)
    assert r.kind == "decided" and r.decision is not None
    assert r.decision.outcome == "preempted"
    kinds = [type(e) for e, _ in r.events]
    assert kinds == [
        ev.PreemptionDecidedEvent,
        ev.ReplicaDrainEvent,
        ev.ReplicaDrainEvent,
        ev.HoldCreatedEvent,
    ]
    decided, drain1, drain2, hold = (e for e, _ in r.events)
    assert decided.id == ids.derived(t.id, "decided")
    assert (decided.causation, decided.correlation) == (t.id, t.id)
    assert [(e.data.replica, node) for e, node in r.events[1:3]] == [("b1", "n1"), ("b2", "n1")]  # type: ignore[attr-defined]
    assert drain1.id == ids.derived(t.id, "drain:b1")
    assert {drain1.data.grace_s, drain2.data.grace_s} == {7.0}  # type: ignore[attr-defined]
    assert hold.id == ids.derived(t.id, "hold:batch")
    assert hold.data.until == s.now + timedelta(seconds=CFG.hold_s)  # type: ignore[attr-defined]
    assert {drain1.causation, hold.causation} == {decided.id}
    # The same trigger on the same view is the same events: a retry is a duplicate.
    again = reaction.react(s.view(), t, s.now, CFG, drain_grace_s=7.0)
    assert [e.id for e, _ in again.events] == [e.id for e, _ in r.events]


def test_other_reasons_are_ignored() -> None:
    s = full_cluster()
    r = reaction.react(s.view(), trigger(s, "quota_limit"), s.now, CFG)
    assert (r.kind, r.events, r.decision) == ("ignored", (), None)


def test_a_later_triggers_decision_supersedes() -> None:
    s = full_cluster()
    first, second = trigger(s), trigger(s)
    view = s.view()
    later = reaction.react(view, second, s.now, CFG)
    publish(view, later.events)
    decided = later.events[0][0]
    assert isinstance(decided, ev.PreemptionDecidedEvent)
    r = reaction.react(view, first, s.now, CFG, answered=decided)
    assert (r.kind, r.events, r.earlier) == ("superseded", (), decided)


@pytest.mark.parametrize("stored", [1, 2, 3, 4], ids=["decided", "one drain", "drains", "all"])
def test_a_crashed_decision_is_completed_with_what_it_left_unpublished(stored: int) -> None:
    s = full_cluster()
    t = trigger(s)
    view = s.view()
    first = reaction.react(view, t, s.now, CFG)
    publish(view, first.events[:stored])
    decided = first.events[0][0]
    assert isinstance(decided, ev.PreemptionDecidedEvent)
    later = s.now + timedelta(seconds=5)
    r = reaction.react(view, t, later, CFG, answered=decided)
    assert r.kind == "completed" and r.decision is None
    # Exactly the suffix the crash left out, with the same ids.
    assert [e.id for e, _ in r.events] == [e.id for e, _ in first.events[stored:]]
    publish(view, r.events)
    assert reaction.missing(view, decided, later) == ()


def test_a_missing_hold_that_has_ended_is_not_published() -> None:
    s = full_cluster()
    t = trigger(s)
    view = s.view()
    first = reaction.react(view, t, s.now, CFG)
    publish(view, first.events[:3])  # the decision and the drains, not the hold
    decided = first.events[0][0]
    assert isinstance(decided, ev.PreemptionDecidedEvent)
    assert len(reaction.missing(view, decided, s.now)) == 1
    until = s.now + timedelta(seconds=CFG.hold_s)
    assert len(reaction.missing(view, decided, until)) == 1  # still on at `until`
    assert reaction.missing(view, decided, until + timedelta(microseconds=1)) == ()


def test_hold_end_is_one_rule_for_the_policy_and_the_releases() -> None:
    s = full_cluster()
    s.hold("batch", "chat", until="+10m")
    view = s.view()
    h = view.state.holds["batch"]
    assert view.hold_end("chat", h.until, s.now) is None
    assert view.active_hold("batch", s.now) is h
    assert reaction.releases(view, s.now) == []
    # Still on at its `until` exactly; expired once past it.
    assert view.hold_end("chat", h.until, h.until) is None
    assert reaction.releases(view, h.until) == []
    past = h.until + timedelta(microseconds=1)
    assert view.hold_end("chat", h.until, past) == "expired"
    assert view.active_hold("batch", past) is None
    [released] = reaction.releases(view, past)
    assert released.data.reason == "expired"
    assert released.id == ids.derived(h.created_by, "released")
    assert released.causation == h.created_by
    # A release already sent and not yet folded is not sent again.
    assert reaction.releases(view, past, pending={released.id}) == []
    # Satisfied early once chat has what it asked for.
    s.node("n3", "4xH100-80GB")
    s.replica("c1", "chat", on=("n3", [0, 1, 2, 3]), ready="-1m")
    view = s.view()
    assert view.hold_end("chat", h.until, s.now) == "satisfied"
    assert view.active_hold("batch", s.now) is None
    [released] = reaction.releases(view, s.now)
    assert released.data.reason == "satisfied"
    publish(view, [released])
    assert "batch" not in view.state.holds


def test_a_published_decision_lists_a_victim_past_the_first_shown_candidates() -> None:
    """Node-aware may stop a replica far down the order: the event lists the first SHOWN
    candidates and then that victim, so `llmgw explain` of it finds its own row."""
    s = Scenario()
    s.node("h1", "1xH100-80GB")
    s.model("whisper", cls="opportunistic", min=0, max=99, profiles=["l4:1"])
    s.model("small", cls="opportunistic", min=0, max=1, profiles=["one:1"])
    s.model(
        "big", cls="critical", min=1, profiles=[ev.ProfileSpec(name="h", gpus=1, gpu_model="H100")]
    )
    n = reaction.SHOWN + 6
    for i in range(n // 4):
        s.node(f"l{i}", "4xL4-24GB")
        for g in range(4):
            # Idle for hours: tier 0, ahead of every other candidate, and on L4s.
            s.replica(f"w{i}-{g}", "whisper", on=(f"l{i}", [g]), ready="-5h", used="-3h")
    s.replica("h1-a", "small", on=("h1", [0]), ready="-5h", used="-1m")
    e = s.emit(ev.PlacementFailed(model="big", profiles=("h",), live=0, desired=1, reason="no_fit"))
    assert isinstance(e, ev.PlacementFailedEvent)
    view = s.view()

    ref = reaction.react(view, e, s.now, CFG)
    assert ref.decision is not None and ref.decision.outcome == "no_fit"

    r = reaction.react(view, e, s.now, Config(hold_s=60.0, policy="node-aware"))
    d = r.decision
    assert d is not None and d.outcome == "preempted"
    assert [v.replica for v in d.victims] == ["h1-a"]
    # The decision itself lists the first SHOWN and the victim past them, and counts all.
    assert d.candidates[-1].replica == "h1-a" and len(d.candidates) == reaction.SHOWN + 1
    assert d.considered == n + 1
    decided = r.events[0][0]
    assert isinstance(decided, ev.PreemptionDecidedEvent)
    listed = [c.replica for c in decided.data.candidates]
    assert listed == [c.replica for c in d.candidates[: reaction.SHOWN]] + ["h1-a"]
    assert decided.data.considered == n + 1
    # The cut of a whole decision's data keeps the same.
    whole = reaction.bounded(d.to_event_data(e.id))
    assert whole == decided.data
