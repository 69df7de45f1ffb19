"""A target domain that stays: the pin of a preemptor's placement to the domain its
victims free (`View.pin`).

A `preemption.decided` (preempted, with a `domain`) pins the model's placement to that
domain until a replica of it is placed or the decision's hold ends; the scheduler then
places it only there, even when another domain has room (Kueue #15036: a target domain
that moves between cycles wastes the evictions). A decision without a domain (every
decision from before the field) pins nothing, and folds as it did.
"""

from __future__ import annotations

from datetime import timedelta

from schemas import events as ev
from services.core import fold, reaction, scheduling
from services.core.policy import Config, plan
from services.core.view import View, encode_state
from tests.scenario import Scenario

NA = Config(policy="node-aware")
NVL = ev.TopologySpec(level="nvlink_domain")
PP2 = ev.ProfileSpec(name="pp2", gpus=8, shards=2, topology=NVL)


def _labelled(s: Scenario, name: str, domain: str) -> None:
    s.node(name, 8, labels={"nvlink_domain": domain})


def decided(*, domain: bool = True) -> tuple[Scenario, ev.PreemptionDecidedEvent]:
    """Domain A (a1, a2 under an opportunistic two-node replica, a3 half held) and B
    (critical replicas). A critical two-node model asks; node-aware stops the gang in A,
    and the victims stop. Then domain C joins, two empty nodes: best fit alone would take
    C (left with 0 free GPUs, against A's 4). `domain=False` publishes the decision as a
    log from before the field would have it."""
    s = Scenario()
    for n in ("a1", "a2", "a3"):
        _labelled(s, n, "A")
    for n in ("b1", "b2"):
        _labelled(s, n, "B")
    s.model("big", cls="critical", min=0, max=4, profiles=[PP2])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=[PP2])
    s.model("keep", cls="critical", min=3, profiles=["one:8", "half:4"])
    s.replica("g1", "batch", on=[("a1", range(8)), ("a2", range(8))], ready="-2h", used="-1h")
    s.replica("k0", "keep", on=("a3", range(4)), profile="half", ready="-2h")
    s.replica("k1", "keep", on=("b1", range(8)), ready="-2h")
    s.replica("k2", "keep", on=("b2", range(8)), ready="-2h")
    s.scale("big", 1)
    d = plan(s.view(), "big", s.now, NA)
    assert d.outcome == "preempted" and d.domain == "nvlink_domain=A", d.reason
    trigger = s.emit(
        ev.PlacementFailed(
            model="big", profiles=("pp2",), avoid=(), live=0, desired=1, reason="no_fit"
        )
    )
    assert isinstance(trigger, ev.PlacementFailedEvent)
    out = reaction.decision_events(trigger, d, s.now)
    first = out[0][0]
    assert isinstance(first, ev.PreemptionDecidedEvent)
    if not domain:
        data = ev.PreemptionDecided(**{
            f: getattr(first.data, f) for f in first.data.__struct_fields__ if f != "domain"
        })  # fmt: skip
        first = ev.make(data, id=first.id, time=first.time, source=first.source)  # type: ignore[assignment]
        out = ((first, None), *out[1:])
    for e, node in out:
        s.put(e, node)
    s.at("+30s")
    s.state("g1", "stopped")
    s.at("+1s")
    _labelled(s, "c1", "C")
    _labelled(s, "c2", "C")
    return s, first  # type: ignore[return-value]


def placed(v: View, s: Scenario) -> list[ev.PlacementDecided]:
    p = scheduling.plan(v, s.now, scheduling.Config())
    return [o.event.data for o in p.outputs if isinstance(o.event, ev.PlacementDecidedEvent)]


def test_a_pinned_model_is_placed_only_inside_the_pinned_domain() -> None:
    s, d = decided()
    v = s.view()
    pin = v.pin("big", s.now)
    assert pin is not None and pin.domain == "nvlink_domain=A" and pin.decision == d.id
    (p,) = placed(v, s)
    assert sorted(sh.node for sh in p.shards) == ["a1", "a2"]
    assert "pinned to nvlink_domain=A" in p.reason and d.id in p.reason


def test_without_a_domain_nothing_is_pinned_and_best_fit_moves_on() -> None:
    # The same log with the decision as an older policy wrote it: no pin, and best fit
    # takes domain C, leaving the room the eviction freed in A to others.
    s, _ = decided(domain=False)
    v = s.view()
    assert v.pin("big", s.now) is None
    (p,) = placed(v, s)
    assert sorted(sh.node for sh in p.shards) == ["c1", "c2"]
    assert "pinned" not in p.reason


def test_the_pin_ends_when_a_replica_of_the_model_is_placed() -> None:
    s, _ = decided()
    s.scale("big", 2)
    v = s.view()
    plan_ = scheduling.plan(v, s.now, scheduling.Config())
    got = [o.event for o in plan_.outputs if isinstance(o.event, ev.PlacementDecidedEvent)]
    # The first replica goes to the pinned domain, the second wherever it fits.
    assert [sorted(sh.node for sh in e.data.shards) for e in got] == [["a1", "a2"], ["c1", "c2"]]
    s.put(got[0])
    v = s.view()
    assert v.pin("big", s.now) is None
    p = v.state.preempting["big"]
    assert p.domain == "" and p.until is None and p.victims == ("g1",)


def test_the_pin_ends_with_the_decisions_hold() -> None:
    s, d = decided()
    v = s.view()
    pin = v.pin("big", s.now)
    assert pin is not None and pin.until == d.time + timedelta(seconds=NA.hold_s)
    assert v.pin("big", pin.until) is not None  # at `until` exactly a hold is still on
    later = pin.until + timedelta(seconds=1)
    assert v.pin("big", later) is None
    s.at(later)
    (p,) = placed(s.view(), s)
    assert sorted(sh.node for sh in p.shards) == ["c1", "c2"]


def test_the_pin_ends_once_the_model_has_what_it_asked_for() -> None:
    s, _ = decided()
    s.scale("big", 0)
    assert s.view().pin("big", s.now) is None


def test_a_pinned_domain_without_room_fails_saying_so() -> None:
    s, _ = decided()
    # Someone else's replica took a1 meanwhile: the model does not fit in A, and waits
    # there rather than going to C while its hold is on.
    s.model("other", cls="critical", min=1, profiles=["one:8"])
    s.replica("o1", "other", on=("a1", range(8)))
    v = s.view()
    p = scheduling.plan(v, s.now, scheduling.Config())
    assert not [o for o in p.outputs if isinstance(o.event, ev.PlacementDecidedEvent)]
    (f,) = [o.event.data for o in p.outputs if isinstance(o.event, ev.PlacementFailedEvent)]
    assert f.why["pp2"].startswith("pinned to nvlink_domain=A: ")
    # The policy does not stop more for a model that fits elsewhere; it says why not.
    d = plan(v, "big", s.now, NA)
    assert d.outcome == "fits"
    assert "but not in nvlink_domain=A, where its placement is pinned" in d.reason


def test_a_decision_without_a_domain_folds_as_before() -> None:
    # An old log's decision: the preemption entry encodes as it did, with no pin fields.
    s, _ = decided(domain=False)
    v = s.view()
    p = v.state.preempting["big"]
    assert p.domain == "" and p.until is None
    raw = encode_state(v.state)
    assert b'"preempting":{"big":{"at":' in raw
    assert b'"domain"' not in raw and b'"until":null' not in raw
    # And the fold ends no pin of its own accord on a placement: the entry is untouched.
    s.put(
        ev.make(
            ev.PlacementDecided(
                replica="x1", model="big", profile="pp2", reason="by hand",
                shards=(ev.ShardSpec(node="c1", gpus=tuple(range(8))),
                        ev.ShardSpec(node="c2", gpus=tuple(range(8)))),
            ),
            id="x1", time=s.now, source="test",
        )
    )  # fmt: skip
    w = View()
    for seq, subject, e in s.events():
        assert fold.apply(w, e, seq=seq, subject=subject) is None
    assert w.state.preempting["big"] == p
