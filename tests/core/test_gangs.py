"""Gangs as victims: a multi-node replica is one candidate of node-aware, stopped whole.

The issue's case first (a critical two-node model, an opportunistic two-node replica
holding exactly its room in one NVLink domain), then the rules one by one, then a
property over random clusters with domains and multi-node replicas (hypothesis,
derandomised): for every decision, no partial gang, no eviction after which the model
does not fit by the dry run, no more freed than needed plus the largest victim, and
the exhaustive oracle finds no set within the cap whenever node-aware says no_fit.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from services.core import placement, reaction
from services.core.policy import Config, Decision, plan
from services.core.policy.fast.narrow import Narrow
from services.core.policy.trials import Trials
from services.core.view import View
from services.sim import oracle
from tests.scenario import Scenario

REF = Config()
NA = Config(policy="node-aware")
NVL = ev.TopologySpec(level="nvlink_domain")


def pp(shards: int, gpus: int = 8, topology: ev.TopologySpec | None = NVL) -> ev.ProfileSpec:
    return ev.ProfileSpec(name=f"pp{shards}", gpus=gpus, shards=shards, topology=topology)


def domains(s: Scenario, layout: dict[str, list[str]]) -> Scenario:
    for d, names in layout.items():
        for n in names:
            s.node(n, 8, labels={"nvlink_domain": d, "rack": f"r-{d}"})
    return s


def issue_case() -> Scenario:
    """Two NVLink domains of two nodes. A: an opportunistic two-node replica on all of
    both nodes. B: critical replicas nobody may stop. A critical two-node model asks."""
    s = domains(Scenario(), {"A": ["a1", "a2"], "B": ["b1", "b2"]})
    s.model("big", cls="critical", min=1, profiles=[pp(2)])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=[pp(2)])
    s.model("keep", cls="critical", min=2, profiles=["one:8"])
    s.replica("g1", "batch", on=[("a1", range(8)), ("a2", range(8))], ready="-2h", used="-1h")
    s.replica("k1", "keep", on=("b1", range(8)), ready="-2h")
    s.replica("k2", "keep", on=("b2", range(8)), ready="-2h")
    return s


def test_a_critical_two_node_model_preempts_one_two_node_replica_whole() -> None:
    s = issue_case()
    v = s.view()
    ref = plan(v, "big", s.now, REF)
    assert ref.outcome == "no_candidates"  # the reference still skips a multi-node victim
    assert "g1" in {x.replica for x in ref.excluded if x.why == "multi_node"}
    na = plan(v, "big", s.now, NA)
    assert na.outcome == "preempted", na.reason
    assert [c.replica for c in na.victims] == ["g1"]
    assert na.victims[0].nodes == ("a1", "a2")
    assert na.placement is not None
    assert sorted(sh.node for sh in na.placement.shards) == ["a1", "a2"]
    assert na.domain == "nvlink_domain=A"
    data = na.to_event_data("t1")
    assert data.spans == {"g1": ("a1", "a2")} and data.domain == "nvlink_domain=A"
    # One decision, one drain per shard's node, each its own event id.
    trigger = ev.make(
        ev.PlacementFailed(
            model="big", profiles=("pp2",), avoid=(), live=0, desired=1, reason="no_fit"
        ),
        id="t1", time=s.now, source="test",
    )  # fmt: skip
    assert isinstance(trigger, ev.PlacementFailedEvent)
    out = reaction.decision_events(trigger, na, s.now)
    drains = [
        (e.data.replica, node, e.id) for e, node in out if isinstance(e, ev.ReplicaDrainEvent)
    ]
    assert [(r, n) for r, n, _ in drains] == [("g1", "a1"), ("g1", "a2")]
    assert len({i for _, _, i in drains}) == 2


def test_the_cap_counts_replicas_not_shards() -> None:
    s = issue_case()
    na = plan(s.view(), "big", s.now, Config(policy="node-aware", max_victims=1))
    assert na.outcome == "preempted" and [c.replica for c in na.victims] == ["g1"]


def test_a_gang_across_domains_frees_room_in_none() -> None:
    # The gang's shards are in A and B; the other node of each domain is held: stopping
    # it frees one node per domain, and the model must fit within one.
    s = domains(Scenario(), {"A": ["a1", "a2"], "B": ["b1", "b2"]})
    s.model("big", cls="critical", min=1, profiles=[pp(2)])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=[pp(2, topology=None)])
    s.model("keep", cls="critical", min=2, profiles=["one:8"])
    s.replica("g1", "batch", on=[("a1", range(8)), ("b1", range(8))], ready="-2h")
    s.replica("k1", "keep", on=("a2", range(8)), ready="-2h")
    s.replica("k2", "keep", on=("b2", range(8)), ready="-2h")
    v = s.view()
    na = plan(v, "big", s.now, NA)
    assert na.outcome == "no_fit"
    assert oracle.exists(v, na, NA.max_victims) is False
    # Without the topology the same stop would have been enough.
    s.model("big", cls="critical", min=1, profiles=[pp(2, topology=None)])
    assert plan(s.view(), "big", s.now, NA).outcome == "preempted"


def test_a_single_node_model_may_take_a_gangs_node() -> None:
    s = domains(Scenario(), {"A": ["a1", "a2"]})
    s.model("one", cls="critical", min=1, profiles=["one:8"])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=[pp(2)])
    s.replica("g1", "batch", on=[("a1", range(8)), ("a2", range(8))], ready="-2h")
    assert plan(s.view(), "one", s.now, REF).outcome == "no_candidates"
    na = plan(s.view(), "one", s.now, NA)
    assert na.outcome == "preempted" and na.victims[0].nodes == ("a1", "a2")
    assert na.domain == ""


# ------------------------------------------------------------------ property


@st.composite
def clusters(draw: st.DrawFn) -> tuple[Scenario, str]:
    n_dom = draw(st.integers(1, 3))
    per = draw(st.integers(1, 3))
    layout = {f"d{d}": [f"n{d}{i}" for i in range(per)] for d in range(n_dom)}
    s = domains(Scenario(), layout)
    nodes = [n for ns in layout.values() for n in ns]
    free = {n: list(range(8)) for n in nodes}
    want_shards = draw(st.integers(1, min(2, per)))
    want_gpus = draw(st.sampled_from([4, 8, 8]))
    mode = draw(st.sampled_from([None, "required"]))
    topo = None if mode is None else NVL
    s.model("want", cls="critical", min=1, profiles=[pp(want_shards, want_gpus, topo)])
    classes = ("opportunistic", "standard", "critical")
    for j in range(draw(st.integers(2, 10))):
        cls = draw(st.sampled_from(classes))
        shards = draw(st.integers(1, 2))
        gpus = draw(st.sampled_from([2, 4, 8]))
        name = f"m{j}"
        s.model(name, cls=cls, min=0, max=8, profiles=[pp(shards, gpus, None)])
        at = [n for n in nodes if len(free[n]) >= gpus]
        if len(at) < shards:
            continue
        chosen = draw(st.permutations(at))[:shards]
        on = []
        for n in chosen:
            on.append((n, free[n][:gpus]))
            free[n] = free[n][gpus:]
        s.replica(
            f"r{j}", name, on=on if shards > 1 else on[0], ready="-3h",
            used=draw(st.sampled_from(["-2h", "-1m"])),
        )  # fmt: skip
    return s, "want"


def _need(v: View, d: Decision) -> int:
    m = v.catalog.resolve(d.model)
    assert m is not None
    return min(p.gpus * p.shards for p in m.profiles)


@settings(
    max_examples=100, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
)
@given(clusters())
def test_every_decision_stops_whole_gangs_that_make_room(case: tuple[Scenario, str]) -> None:
    s, model = case
    v = s.view()
    d = plan(v, model, s.now, NA)
    if d.outcome == "no_fit":
        assert oracle.exists(v, d, NA.max_victims) is not True
        return
    if d.outcome != "preempted":
        return
    # 0 partial gangs: each victim's every shard is released and drained.
    trial = v.inventory.clone()
    for c in d.victims:
        r = v.state.replicas[c.replica]
        assert (c.nodes or (c.node,)) == r.nodes
        trial.release_replica(c.replica)
    m = v.catalog.resolve(model)
    assert m is not None
    # 0 evictions after which the model does not fit by the dry run.
    found = placement.place(trial, m.profiles)
    assert isinstance(found, placement.Placement)
    if m.profiles[0].topology_level:
        assert len({v.inventory.node(sh.node).labels["nvlink_domain"] for sh in found.shards}) == 1  # type: ignore[union-attr]
    freed = sum(c.gpus for c in d.victims)
    assert freed <= _need(v, d) + max(c.gpus for c in d.victims)
    # The reference never stops a gang.
    ref = plan(v, model, s.now, REF)
    assert all(not c.nodes for c in ref.victims)


@settings(
    max_examples=100, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
)
@given(clusters(), st.randoms(use_true_random=False))
def test_a_trial_within_the_victims_domains_is_the_whole_clusters(
    case: tuple[Scenario, str], rnd: random.Random
) -> None:
    """A trial for a model whose profiles of several shards are required in one domain
    places within the domains the victims are in (`Narrow.levels`): the same result,
    placement and all, as on a clone of the whole inventory, for the sets node-aware
    tried and for random sets of its candidates."""
    s, model = case
    v = s.view()
    d = plan(v, model, s.now, NA)
    m = v.catalog.resolve(model)
    assert m is not None
    profiles = [p for p in m.profiles if p.name in d.profiles]
    if d.outcome not in ("preempted", "no_fit") or not profiles:
        return
    by_id = {c.replica: c for c in d.candidates}
    sets = [[by_id[r] for r in t.victims] for t in d.trials]
    for _ in range(5):
        sets.append(rnd.sample(d.candidates, rnd.randint(1, min(3, len(d.candidates)))))
    narrow = Narrow(v, profiles, d.avoid)
    whole = Trials(v, profiles, d.avoid)
    for gone in sets:
        assert narrow.fits_without(gone) == whole.fits_without(gone)
    assert narrow.trials == whole.trials
