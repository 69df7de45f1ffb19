"""The preemption policy, one test per rule of the reference, each from a small scenario.

Every scenario is an event log (tests/scenario.py) folded into a view, so the policy is
tested on exactly what the fold gives it. Invariants over random clusters are at the end.
"""

from __future__ import annotations

from datetime import timedelta

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import codec
from schemas import events as ev
from services.core import fold, placement
from services.core.policy import Config, Decision, plan
from services.core.view import View
from tests.scenario import Scenario

CFG = Config()


def decide(s: Scenario, model: str = "chat", **kw: float) -> Decision:
    return plan(s.view(), model, s.now, Config(**kw) if kw else CFG)  # type: ignore[arg-type]


def ids(xs: tuple[object, ...]) -> list[str]:
    return [x.replica for x in xs]  # type: ignore[attr-defined]


def tiers(d: Decision) -> dict[str, int]:
    return {c.replica: c.tier for c in d.candidates}


def why(d: Decision) -> dict[str, str]:
    return {x.replica: x.why for x in d.excluded}


def full_node(s: Scenario, gpus: int = 8) -> Scenario:
    """One node of `gpus` GPUs, and a critical `chat` needing all of them on one node."""
    s.node("n1", f"{gpus}xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=[f"all:{gpus}"])
    return s


# ---------------------------------------------------------------- tiers


def test_tier0_idle_on_demand_lower_class_goes_first() -> None:
    s = full_node(Scenario(), 2)
    s.model("batch", cls="standard", min=1, max=3, profiles=["one:1"])
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.replica("b1", "batch", on=("n1", [0]), ready="-3h", created="-3h")
    s.replica("l1", "lab", on=("n1", [1]), ready="-2h", used="-11m")
    d = decide(s)
    assert tiers(d) == {"l1": 0, "b1": 4}
    assert ids(d.candidates) == ["l1", "b1"]


def test_tier0_needs_a_known_idle_time_unless_the_grace_is_zero() -> None:
    s = full_node(Scenario(), 1)
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.replica("l1", "lab", on=("n1", [0]), ready="-5h")  # never reported used
    (c,) = decide(s).candidates
    assert c.idle_s is None
    assert c.tier == 2  # above its minimum of 0, but not idle
    # Unknown counts as 0 against the grace, as the reference's idleFor: 0 >= 0.
    # (The edges are in test_policy_edges.py.)
    (c,) = decide(s, eviction_grace_s=0).candidates
    assert (c.idle_s, c.tier) == (None, 0)
    s.used("l1", "-10m")
    assert tiers(decide(s)) == {"l1": 0}


def test_tier1_reclaims_borrowed_across_owners_whatever_the_classes() -> None:
    s = Scenario()
    s.node("n1", "6xH100-80GB")
    s.model("chat", cls="standard", min=1, profiles=["two:2"], owner="team-a")
    s.model("crit", cls="critical", min=1, max=3, profiles=["two:2"], owner="team-b")
    s.quota({"team-a": {"gpus": 8}, "team-b": {"gpus": 2}})
    s.replica("c1", "crit", on=("n1", [0, 1]), ready="-3h", created="-3h")
    s.replica("c2", "crit", on=("n1", [2, 3]), ready="-2h", created="-2h")
    s.replica("c3", "crit", on=("n1", [4, 5]), ready="-1h", created="-1h")
    d = decide(s)
    # c1 is within team-b's guarantee; c2 and c3 were borrowed past it.
    assert why(d) == {"c1": "guaranteed"}
    assert tiers(d) == {"c2": 1, "c3": 1}
    assert d.reclaim
    assert d.outcome == "preempted"
    assert ids(d.victims) == ["c2"]


def test_tier1_never_takes_a_critical_minimum() -> None:
    s = Scenario()
    s.node("n1", "2xH100-80GB")
    s.model("chat", cls="standard", min=1, profiles=["two:2"], owner="team-a")
    s.model("crit", cls="critical", min=1, profiles=["two:2"], owner="team-b")
    s.quota({"team-a": {"gpus": 8}})  # team-b has no guarantee: all it holds is borrowed
    s.replica("c1", "crit", on=("n1", [0, 1]), ready="-3h")
    d = decide(s)
    assert why(d) == {"c1": "critical_minimum"}
    assert d.outcome == "no_candidates"
    assert d.victims == ()


def test_tier2_lower_class_above_its_minimum() -> None:
    s = full_node(Scenario(), 2)
    s.model("batch", cls="standard", min=1, max=2, profiles=["one:1"])
    s.replica("b1", "batch", on=("n1", [0]), ready="-3h", created="-3h")
    s.replica("b2", "batch", on=("n1", [1]), ready="-2h", created="-2h")
    d = decide(s)
    # Newest first: b2 is above batch's minimum, b1 is the minimum.
    assert tiers(d) == {"b2": 2, "b1": 4}
    assert {c.replica: c.above_min for c in d.candidates} == {"b2": True, "b1": False}


def test_tier3_same_class_above_min_only_while_model_below_its_own_min() -> None:
    s = Scenario()
    s.node("n1", "2xH100-80GB")
    s.model("chat", cls="standard", min=1, profiles=["one:1"])
    s.model("peer", cls="standard", min=1, max=2, profiles=["one:1"])
    s.replica("p1", "peer", on=("n1", [0]), ready="-3h", created="-3h")
    s.replica("p2", "peer", on=("n1", [1]), ready="-2h", created="-2h")
    d = decide(s)
    assert d.below_min
    assert tiers(d) == {"p2": 3}
    assert why(d) == {"p1": "not_lower_class"}  # the same class's minimum
    assert ids(d.victims) == ["p2"]

    # Once chat has its minimum, room peer grew into is no longer taken for it.
    s.node("n2", "1xH100-80GB")
    s.replica("c1", "chat", on=("n2", [0]), ready="-1h")
    d = decide(s)
    assert not d.below_min
    assert d.candidates == ()
    assert why(d) == {"c1": "same_model", "p1": "not_lower_class", "p2": "not_lower_class"}
    assert d.outcome == "no_candidates"


def test_tier4_lower_class_minimums_but_never_a_critical_one() -> None:
    s = full_node(Scenario(), 2)
    s.model("batch", cls="standard", min=1, profiles=["one:1"])
    s.model("other", cls="critical", min=1, profiles=["one:1"])
    s.replica("b1", "batch", on=("n1", [0]), ready="-3h")
    s.replica("o1", "other", on=("n1", [1]), ready="-3h")
    d = decide(s)
    assert tiers(d) == {"b1": 4}
    assert why(d) == {"o1": "critical_minimum"}
    assert d.outcome == "no_fit"  # b1 alone does not free both GPUs
    assert d.victims == ()


def test_higher_class_is_never_taken_without_a_reclaim() -> None:
    s = Scenario()
    s.node("n1", "1xH100-80GB")
    s.model("chat", cls="opportunistic", min=1, profiles=["one:1"])
    s.model("web", cls="standard", min=0, max=2, profiles=["one:1"])
    s.replica("w1", "web", on=("n1", [0]), ready="-3h", used="-2h")
    d = decide(s)
    assert why(d) == {"w1": "not_lower_class"}
    assert "ranks above" in d.excluded[0].detail


# ---------------------------------------------------------------- guarantees


def test_guaranteed_replica_never_taken_for_another_owners_model() -> None:
    s = Scenario()
    s.node("n1", "1xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["one:1"], owner="team-a")
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"], owner="team-b")
    s.quota({"team-b": {"gpus": 4}})
    s.replica("l1", "lab", on=("n1", [0]), ready="-3h", used="-2h")
    d = decide(s)
    assert why(d) == {"l1": "guaranteed"}
    assert d.outcome == "no_candidates"


def test_same_owner_may_take_within_its_own_guarantee() -> None:
    s = Scenario()
    s.node("n1", "1xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["one:1"], owner="team-b")
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"], owner="team-b")
    s.quota({"team-b": {"gpus": 4}})
    s.replica("l1", "lab", on=("n1", [0]), ready="-3h", used="-2h")
    d = decide(s)
    assert tiers(d) == {"l1": 0}
    assert ids(d.victims) == ["l1"]


# ---------------------------------------------------------------- skipped


def test_young_replicas_spared_for_min_lifetime() -> None:
    s = full_node(Scenario(), 1)
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.replica("l1", "lab", on=("n1", [0]), ready="-119s", created="-5m")
    d = decide(s)
    assert why(d) == {"l1": "young"}
    assert d.outcome == "no_candidates"
    s.at("+1s")
    assert ids(decide(s).victims) == ["l1"]


def test_not_yet_ready_replica_is_not_young() -> None:
    # The reference spares only what has been ready for a short while; a replica still
    # loading has cost nothing it would keep.
    s = full_node(Scenario(), 1)
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.replica("l1", "lab", on=("n1", [0]), state="loading", created="-5s")
    assert ids(decide(s).victims) == ["l1"]


def test_multi_node_replicas_skipped() -> None:
    s = Scenario()
    s.node("n1", "2xH100-80GB")
    s.node("n2", "2xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["two:2"])
    s.model("big", cls="opportunistic", min=0, profiles=["spread:2:2"])
    s.replica("g1", "big", on=[("n1", [0, 1]), ("n2", [0, 1])], ready="-3h", used="-2h")
    d = decide(s)
    assert why(d) == {"g1": "multi_node"}
    assert d.outcome == "no_candidates"


def test_replicas_on_their_way_out_and_the_models_own_are_not_candidates() -> None:
    s = Scenario()
    s.node("n1", "4xH100-80GB")
    s.model("chat", cls="critical", min=2, profiles=["two:2"])
    s.model("lab", cls="opportunistic", min=0, max=3, profiles=["one:1"])
    s.replica("c1", "chat", on=("n1", [0, 1]), ready="-3h")
    s.replica("l1", "lab", on=("n1", [2]), ready="-3h")
    s.replica("l2", "lab", on=("n1", [3]), ready="-3h")
    s.drain("l1", "scale_down")
    s.drain("l2", "preempted", for_model="web")
    d = decide(s)
    assert why(d) == {"c1": "same_model", "l1": "retiring", "l2": "already_preempted"}


# ---------------------------------------------------------------- order and choice


def test_order_tier_then_longest_idle_then_fewest_gpus_then_least_memory_then_id() -> None:
    s = full_node(Scenario(), 8)
    s.node("n2", "1xH100-80GB")
    s.model("lab", cls="opportunistic", min=0, max=9, profiles=["one:1@16", "fat:1@64", "two:2@16"])
    s.model("base", cls="standard", min=1, profiles=["one:1"])
    s.replica("t0", "lab", on=("n1", [0]), ready="-5h", used="-1h")
    s.replica("a", "lab", on=("n1", [1]), ready="-5h", used="-300s")
    s.replica("b", "lab", on=("n1", [2]), ready="-5h", used="-100s")
    s.replica("c", "lab", on=("n1", [3, 4]), ready="-5h")
    s.replica("d", "lab", on=("n1", [5]), profile="fat", ready="-5h")
    s.replica("f", "lab", on=("n1", [6]), ready="-5h")
    s.replica("e", "lab", on=("n1", [7]), ready="-5h")
    s.replica("z", "base", on=("n2", [0]), ready="-5h", used="-4h")
    d = decide(s)
    assert [(c.replica, c.tier) for c in d.candidates] == [
        ("t0", 0),  # idle on-demand first
        ("a", 2),  # then the longest idle
        ("b", 2),
        ("e", 2),  # unknown idle counts as 0; one GPU and 16 GB; e before f by id
        ("f", 2),
        ("d", 2),  # one GPU but 64 GB
        ("c", 2),  # two GPUs
        ("z", 4),  # a lower class's minimum last, however long idle
    ]


def test_idle_replica_on_the_wrong_node_is_tried_first_and_then_kept() -> None:
    s = Scenario()
    s.node("n1", "2xH100-80GB")
    s.node("n2", "2xH100-80GB")
    s.model("chat", cls="critical", min=1, profiles=["two:2"])
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    s.model("batch", cls="standard", min=0, max=2, profiles=["one:1"])
    s.model("core", cls="critical", min=1, profiles=["one:1"])
    s.replica("idle", "lab", on=("n2", [0]), ready="-5h", used="-4h")
    s.replica("core1", "core", on=("n2", [1]), ready="-5h")
    s.replica("busy", "batch", on=("n1", [1]), ready="-5h", used="-1s")
    d = decide(s)
    assert ids(d.candidates) == ["idle", "busy"]
    assert [(t.victims, t.fits) for t in d.trials] == [
        (("idle",), False),
        (("idle", "busy"), True),
        (("idle",), False),  # busy is needed
        (("busy",), True),  # idle is not: it is kept after all
    ]
    assert ids(d.victims) == ["busy"]
    assert [h.model for h in d.holds] == ["batch"]
    assert d.placement is not None and d.placement.shards[0].node == "n1"


def test_equally_idle_victims_smallest_first() -> None:
    # Idle times are unknown after a restart; the smaller of two equal victims is tried
    # first, not whichever the listing happened to give.
    s = full_node(Scenario(), 8)
    s.model("chat2", cls="critical", min=1, profiles=["one:1"])
    s.model("lab", cls="opportunistic", min=0, max=3, profiles=["four:4", "one:1"])
    s.model("core", cls="critical", min=3, profiles=["one:1"])
    s.replica("a-big", "lab", on=("n1", [0, 1, 2, 3]), ready="-5h")
    s.replica("z-small", "lab", on=("n1", [4]), ready="-5h")
    for i in (5, 6, 7):
        s.replica(f"core{i}", "core", on=("n1", [i]), ready="-5h")
    d = decide(s, "chat2")
    assert ids(d.candidates) == ["z-small", "a-big"]
    assert ids(d.victims) == ["z-small"]


def test_at_most_max_victims_and_no_fit_stops_nothing() -> None:
    s = full_node(Scenario(), 4)
    s.model("lab", cls="opportunistic", min=0, max=4, profiles=["one:1"])
    for i in range(4):
        s.replica(f"l{i}", "lab", on=("n1", [i]), ready="-5h", used="-2h")
    d = decide(s)
    assert len(d.candidates) == 4
    assert d.outcome == "no_fit"
    assert d.victims == () and d.holds == ()
    assert [len(t.victims) for t in d.trials] == [1, 2, 3]
    assert not any(t.fits for t in d.trials)
    # With a fourth victim allowed the same cluster makes room.
    d4 = decide(s, max_victims=4)
    assert d4.outcome == "preempted"
    assert len(d4.victims) == 4


def test_fits_without_preemption() -> None:
    s = full_node(Scenario(), 8)
    s.model("lab", cls="opportunistic", min=0, profiles=["one:1"])
    d = decide(s)
    assert d.outcome == "fits"
    assert d.placement is not None and d.placement.profile.name == "all"
    assert d.victims == () and d.trials == ()


def test_quota_limit_means_no_preemption() -> None:
    s = full_node(Scenario(), 2)
    s.model("chat2", cls="critical", min=1, profiles=["one:1"], owner="team-a")
    s.model("lab", cls="opportunistic", min=0, max=2, profiles=["one:1"])
    s.quota({"team-a": {"limit": {"gpus": 1}}})
    s.replica("c1", "chat2", on=("n1", [0]), ready="-5h")
    s.replica("l1", "lab", on=("n1", [1]), ready="-5h", used="-2h")
    d = decide(s, "chat2")
    assert d.outcome == "quota_limit"
    assert d.victims == () and d.candidates == ()


def test_unknown_model() -> None:
    d = decide(full_node(Scenario(), 1), "nope")
    assert d.outcome == "unknown_model"


# ---------------------------------------------------------------- after a choice


def one_lab_victim() -> Scenario:
    s = full_node(Scenario(), 2)
    s.model("lab", cls="opportunistic", min=0, max=2, profiles=["one:1"])
    s.model("web", cls="standard", min=0, max=2, profiles=["one:1"])
    s.replica("l1", "lab", on=("n1", [0]), ready="-5h", used="-2h")
    s.replica("w1", "web", on=("n1", [1]), ready="-5h", used="-2h")
    return s


def test_holds_for_each_victims_model_until_now_plus_hold() -> None:
    s = one_lab_victim()
    d = decide(s, hold_s=60)
    assert ids(d.victims) == ["l1", "w1"]
    assert [(h.model, h.for_model, h.until) for h in d.holds] == [
        ("lab", "chat", s.now + timedelta(seconds=60)),
        ("web", "chat", s.now + timedelta(seconds=60)),
    ]


def apply_decision(s: Scenario, d: Decision, trigger: str = "") -> None:
    """Publish what the preemption service would: the decision, drains and holds."""
    s.emit(d.to_event_data(trigger))
    for v in d.victims:
        s.drain(v.replica, "preempted", for_model=d.model)
    for h in d.holds:
        s.hold(h.model, h.for_model, h.until)


def place(s: Scenario, d: Decision, replica: str) -> None:
    assert d.placement is not None
    s.replica(
        replica,
        d.model,
        on=[(sh.node, list(sh.gpus)) for sh in d.placement.shards],
        profile=d.placement.profile.name,
    )


def test_awaiting_while_earlier_victims_drain() -> None:
    s = one_lab_victim()
    d = decide(s)
    apply_decision(s, d)
    s.at("+10s")
    d2 = decide(s)
    assert d2.outcome == "awaiting"
    assert d2.awaiting == ("l1", "w1")
    s.state("l1", "draining").state("l1", "stopped")
    assert decide(s).outcome == "awaiting"  # w1 still holds its GPU
    s.state("w1", "stopped")
    assert decide(s).outcome == "fits"


def test_held_model_may_not_take_its_room_back() -> None:
    s = one_lab_victim()
    s.scale("chat", 1)
    d = decide(s, hold_s=300)
    apply_decision(s, d)
    s.state("l1", "stopped").state("w1", "stopped")
    s.at("+1m")
    assert decide(s, "lab").outcome == "held"
    assert decide(s, "lab").reason.startswith("lab gave up room for chat")
    # The hold ends early once chat has what it asked for.
    place(s, decide(s), "c1")
    assert decide(s, "lab").outcome != "held"


def test_held_model_free_again_after_the_hold() -> None:
    s = one_lab_victim()
    apply_decision(s, decide(s, hold_s=300))
    s.at("+299s")
    assert decide(s, "web").outcome == "held"
    s.at("+1s")
    assert decide(s, "web").outcome == "held"  # at its `until` exactly: still on
    s.at("+0.000001s")
    assert decide(s, "web").outcome != "held"


def test_no_two_models_take_turns_stopping_each_other() -> None:
    # a is below its minimum and takes b's room above b's; b, now at its own minimum,
    # may not take it back, however long either waits.
    s = Scenario()
    s.node("n1", "3xH100-80GB")
    s.model("a", cls="standard", min=2, max=2, profiles=["one:1"])
    s.model("b", cls="standard", min=1, max=2, profiles=["one:1"])
    s.replica("a1", "a", on=("n1", [0]), ready="-5h", created="-5h")
    s.replica("b1", "b", on=("n1", [1]), ready="-5h", created="-5h")
    s.replica("b2", "b", on=("n1", [2]), ready="-4h", created="-4h")
    d = decide(s, "a")
    assert ids(d.victims) == ["b2"]
    apply_decision(s, d)
    s.state("b2", "stopped")
    place(s, decide(s, "a"), "a2")
    s.at("+1h")
    s.state("a2", "ready")
    d = decide(s, "b")
    assert d.outcome == "no_candidates"
    assert why(d) == {"a1": "not_lower_class", "a2": "not_lower_class", "b1": "same_model"}


def test_same_input_same_decision() -> None:
    s = one_lab_victim()
    v = s.view()
    a = plan(v, "chat", s.now, CFG)
    b = plan(s.view(), "chat", s.now, CFG)
    c = plan(v.copy(), "chat", s.now, CFG)
    assert a == b == c
    assert a.to_json() == b.to_json()
    assert plan(v, "chat", s.now, CFG) == a  # plan changed nothing in the view


def test_decision_becomes_a_valid_preemption_decided_event() -> None:
    s = one_lab_victim()
    d = decide(s)
    e = ev.make(d.to_event_data("trig"), id="x1", time=s.now, source="test")
    back = codec.decode(codec.encode(e))
    assert back == e
    data = d.to_event_data("trig")
    assert data.for_model == "chat" and data.outcome == "preempted" and data.trigger == "trig"
    assert data.considered == len(d.candidates)
    assert [t.fits for t in data.trials] == [t.fits for t in d.trials]
    assert set(d.to_json()) == {
        "model",
        "outcome",
        "victims",
        "holds",
        "candidates",
        "excluded",
        "trials",
        "engine",
    }


# ---------------------------------------------------------------- random clusters

CLASSES = ("opportunistic", "standard", "critical")


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Scenario, list[str]]:
    s = Scenario()
    for n in range(draw(st.integers(1, 6))):
        s.node(f"n{n}", "8xH100-80GB")
    owners = ["o0", "o1", "o2"]
    s.quota({o: {"gpus": draw(st.sampled_from([0, 4, 8, 16]))} for o in owners})
    models = []
    for i in range(draw(st.integers(2, 6))):
        name = f"m{i}"
        models.append(name)
        gpus = draw(st.sampled_from([1, 2, 4, 8]))
        s.model(
            name,
            cls=draw(st.sampled_from(CLASSES)),
            min=draw(st.integers(0, 3)),
            max=8,
            profiles=[f"p{gpus}:{gpus}"],
            owner=draw(st.sampled_from(owners)),
        )
    v = s.view()
    for r in range(draw(st.integers(0, 30))):
        model = draw(st.sampled_from(models))
        found = placement.place(v.inventory, v.catalog[model].profiles)
        if not isinstance(found, placement.Placement):
            continue
        before = len(s.events())
        s.replica(
            f"r{r:02d}",
            model,
            on=[(sh.node, list(sh.gpus)) for sh in found.shards],
            created=f"-{60 * (r + 1)}m",
            ready=draw(st.sampled_from(["-5h", "-3h", "-1m"])),
            used=draw(st.sampled_from([None, "-1h", "-20m", "-1m"])),
        )
        for seq, subject, e in s.events()[before:]:
            fold.apply(v, e, seq=seq, subject=subject)
    return s, models


def fits_without(v: View, d: Decision, gone: list[str]) -> bool:
    inv = v.inventory.clone()
    for r in gone:
        inv.release_replica(r)
    m = v.catalog[d.model]
    return isinstance(placement.place(inv, m.profiles), placement.Placement)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.data())
def test_invariants_on_random_clusters(
    cluster: tuple[Scenario, list[str]], data: st.DataObject
) -> None:
    s, models = cluster
    v = s.view()
    model = data.draw(st.sampled_from(models))
    d = plan(v, model, s.now, CFG)
    assert d == plan(s.view(), model, s.now, CFG)  # deterministic
    assert len(d.victims) <= CFG.max_victims
    m = v.catalog[model]
    for c in d.victims:
        assert not (c.cls == "critical" and not c.above_min)  # never a critical minimum
        if c.owner != m.owner:  # never within another owner's guarantee
            assert c.borrowed or not v.quota.has_guarantee(c.owner)
    if d.outcome == "preempted":
        gone = [c.replica for c in d.victims]
        assert fits_without(v, d, gone)
        for i in range(len(gone)):  # minimal: every victim is needed
            assert not fits_without(v, d, gone[:i] + gone[i + 1 :])
        assert {h.model for h in d.holds} == {c.model for c in d.victims}
    else:
        assert d.victims == () and d.holds == ()
    if d.outcome == "no_fit":
        assert not any(t.fits for t in d.trials)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.data())
def test_random_alternating_requests_never_stop_each_other(
    cluster: tuple[Scenario, list[str]], data: st.DataObject
) -> None:
    s, models = cluster
    a, b = data.draw(st.lists(st.sampled_from(models), min_size=2, max_size=2, unique=True))
    stopped: set[tuple[str, str]] = set()  # (for model, victim's model)
    for turn in range(6):
        model = (a, b)[turn % 2]
        # Past every hold and every young replica: only the tiers keep the two apart.
        s.at("+1h")
        d = plan(s.view(), model, s.now, CFG)
        if d.outcome != "preempted":
            continue
        apply_decision(s, d)
        for c in d.victims:
            s.state(c.replica, "stopped")
            stopped.add((model, c.model))
        place(s, d, f"t{turn}")
    assert not ((a, b) in stopped and (b, a) in stopped), stopped


def test_decision_encodes() -> None:
    d = decide(one_lab_victim())
    assert msgspec.json.decode(msgspec.json.encode(d), type=Decision) == d
