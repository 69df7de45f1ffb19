"""A multi-node replica's shards stop one by one: `replica.state`'s `node`.

The agent of one shard of a multi-node replica names its node in its reports; the fold
frees that shard's GPUs at its `stopped` and keeps the others held, and the replica is
stopped at the last shard's. A report without `node` is about the whole replica, as
every report was before the field: an old log folds as it always did (checked against
the canonical view of a seeded mix as the fold made it before the field existed).
"""

from __future__ import annotations

import hashlib
import json

from schemas import events as ev
from schemas import subjects
from services.core import fold, reaction
from services.core.ingest import Ingest
from services.core.policy import Config
from services.core.view import View, decode_state, encode_state
from tests.projector import mix
from tests.scenario import Scenario

NVL = ev.TopologySpec(level="nvlink_domain")
GANG = (("a1", range(8)), ("a2", range(8)))


def gang() -> Scenario:
    """Two nodes of one domain, a two-node replica g1 on all of both, drained on both."""
    s = Scenario()
    for n in ("a1", "a2", "b1"):
        s.node(n, 8, labels={"nvlink_domain": "A" if n.startswith("a") else "B"})
    s.model("batch", cls="opportunistic", min=0, max=2, profiles=[_pp2()])
    s.replica("g1", "batch", on=GANG, ready="-1h")
    s.drain("g1", reason="preempted", for_model="big")
    s.emit(
        ev.ReplicaDrain(replica="g1", model="batch", reason="preempted", for_model="big"),
        node="a2",
    )
    return s


def _pp2() -> ev.ProfileSpec:
    return ev.ProfileSpec(name="pp2", gpus=8, shards=2, topology=NVL)


def report(view: View, state: str, node: str | None, *, subject_node: str | None = None) -> str:
    """Fold g1's `state` said by the agent of `subject_node` (default `node`, else a1),
    naming `node`; the rejection's reason, or "" when applied."""
    r = view.state.replicas["g1"]
    data = ev.ReplicaState(
        replica="g1",
        model="batch",
        profile="pp2",
        state=state,  # type: ignore[arg-type]
        shards=r.shards,
        node=node,
    )
    e = ev.make(data, id=f"s{view.seq + 1}", time=view.state.time, source="agent")  # type: ignore[arg-type]
    subject = subjects.replica_subject(subject_node or node or "a1", "g1")
    got = fold.apply(view, e, seq=view.seq + 1, subject=subject)
    return "" if got is None else got.reason


def free(view: View, node: str) -> int:
    return len(view.inventory.free_gpus(node))


def test_one_shard_stopped_frees_its_gpus_and_holds_the_others() -> None:
    v = gang().view()
    assert v.state.replicas["g1"].drained_on == ("a1", "a2")
    for n in ("a1", "a2"):
        assert report(v, "draining", n) == ""
    assert report(v, "stopped", "a1") == ""
    r = v.state.replicas["g1"]
    assert (r.state, r.stopped_on) == ("draining", ("a1",))
    assert r.holds_capacity and not r.live
    assert (free(v, "a1"), free(v, "a2")) == (8, 0)
    assert v.inventory.holder("a2", 0) == "g1" and v.inventory.holder("a1", 0) is None
    assert [x.id for x in v.current()] == ["g1"]
    # Said again, the same shard's stop changes nothing.
    assert report(v, "stopped", "a1") == ""
    assert v.state.replicas["g1"].stopped_on == ("a1",) and free(v, "a2") == 0


def test_the_last_shard_stops_the_replica() -> None:
    v = gang().view()
    report(v, "draining", "a1")
    assert report(v, "stopped", "a2") == ""
    assert report(v, "stopped", "a1") == ""
    r = v.state.replicas["g1"]
    assert (r.state, r.stopped_on) == ("stopped", ("a2", "a1"))
    assert (free(v, "a1"), free(v, "a2")) == (8, 8)
    assert list(v.current()) == []
    # A late report of the first shard is a state gone nowhere: same state, accepted.
    assert report(v, "stopped", "a2") == ""


def test_a_report_about_the_whole_replica_stops_it_at_once_as_before() -> None:
    v = gang().view()
    assert report(v, "stopped", None, subject_node="a2") == ""
    r = v.state.replicas["g1"]
    assert (r.state, r.stopped_on) == ("stopped", ())
    assert (free(v, "a1"), free(v, "a2")) == (8, 8)
    # And so does a whole report after a shard's.
    v = gang().view()
    report(v, "stopped", "a1")
    assert report(v, "stopped", None, subject_node="a2") == ""
    assert v.state.replicas["g1"].state == "stopped" and free(v, "a2") == 8


def test_a_failed_shard_fails_the_whole_replica() -> None:
    # A gang with a failed shard cannot serve: `failed` is about the replica, whichever
    # node says it (the shards still running are its agents' to stop).
    v = gang().view()
    report(v, "stopped", "a1")
    assert report(v, "failed", "a2") == ""
    assert v.state.replicas["g1"].state == "failed"
    assert (free(v, "a1"), free(v, "a2")) == (8, 8)


def test_a_shard_the_replica_has_not_or_another_agents_is_refused() -> None:
    v = gang().view()
    assert report(v, "stopped", "b1", subject_node="b1").endswith("which has no shard there")
    assert report(v, "stopped", "a2", subject_node="a1") == (
        "agent on a1 reports the shard of replica g1 on a2"
    )
    # Without a subject to check (a test's fold), the shards are checked all the same.
    e = ev.make(
        ev.ReplicaState(replica="g1", model="batch", profile="pp2", state="stopped", node="c1"),
        id="c",
        time=v.state.time,  # type: ignore[arg-type]
        source="agent/c1",
    )
    got = fold.apply(v, e, seq=v.seq + 1)
    assert got is not None and got.reason == "replica g1 has no shard on c1"
    assert v.state.replicas["g1"].state == "ready"
    assert free(v, "a1") == 0 and free(v, "a2") == 0


def test_a_view_rebuilt_from_its_snapshot_holds_only_the_running_shards() -> None:
    v = gang().view()
    report(v, "stopped", "a2")
    again = View(decode_state(encode_state(v.state)))
    assert again.state.replicas == v.state.replicas
    assert (free(again, "a1"), free(again, "a2")) == (0, 8)
    assert again.inventory.allocations() == v.inventory.allocations()
    # The rebuilt view folds the last shard's stop as the live one does.
    report(v, "stopped", "a1")
    report(again, "stopped", "a1")
    assert again.state.replicas == v.state.replicas
    assert again.inventory.allocations() == v.inventory.allocations() == ()


def test_the_ingest_step_rewrites_the_gpu_rows_of_the_stopped_shards_node() -> None:
    s = gang()
    step = Ingest()
    for seq, subject, e in s.events():
        step.event(seq, subject, e)
    step.touched.clear()
    e = ev.make(
        ev.ReplicaState(
            replica="g1",
            model="batch",
            profile="pp2",
            state="stopped",
            shards=step.view.state.replicas["g1"].shards,
            node="a2",
        ),
        id="x",
        time=s.now,
        source="agent/a2",
    )
    step.event(step.seq + 1, subjects.replica_subject("a2", "g1"), e)
    assert step.verdict is None
    assert "g1" in step.touched.replicas and "a2" in step.touched.nodes


def test_drains_record_their_nodes_and_a_crash_between_them_is_completed() -> None:
    """A gang's drains are one per shard's node: `missing` names the nodes not asked yet."""
    s = Scenario()
    for n in ("a1", "a2"):
        s.node(n, 8, labels={"nvlink_domain": "A"})
    s.model("batch", cls="opportunistic", min=0, max=2, profiles=[_pp2()])
    s.model("big", cls="critical", min=1, profiles=[_pp2()])
    s.replica("g1", "batch", on=GANG, ready="-2h", used="-1h")
    t = s.emit(
        ev.PlacementFailed(model="big", profiles=("pp2",), live=0, desired=1, reason="no_fit")
    )
    assert isinstance(t, ev.PlacementFailedEvent)
    v = s.view()
    first = reaction.react(v, t, s.now, Config(policy="node-aware"))
    assert [type(e).__name__ for e, _ in first.events][:3] == [
        "PreemptionDecidedEvent",
        "ReplicaDrainEvent",
        "ReplicaDrainEvent",
    ]
    for e, node in first.events[:2]:  # the decision and the first drain only
        fold.apply(v, e, seq=v.seq + 1, subject=subjects.subject_for(e, "llmgw", node))
    assert v.state.replicas["g1"].drained_on == ("a1",)
    decided = first.events[0][0]
    assert isinstance(decided, ev.PreemptionDecidedEvent)
    rest = reaction.missing(v, decided, s.now)
    assert [(e.id, n) for e, n in rest] == [(e.id, n) for e, n in first.events[2:]]


# ------------------------------------------------------------------ old logs

# The canonical view of a seeded mix (nodes, placements through their states, two-node
# replicas, drains, stops, failures, preemptions, lost nodes, bad input), as the fold made
# it before `node` and the fields it derives existed: its hash with the schema number and
# the new fields left out. Worked out once on the fold of then; a change here is a change
# of how an old log folds. Changed once, on purpose (schema 8): a two-node replica of the
# mix whose node is lost keeps its other shard's GPUs until that one stops (`failed_on`)
# instead of freeing them under a server still running, and the mix's agents say so (a
# `stopped` about the whole replica from the other shard's node, which leaves it failed).
# Before, 4c274d05... and 906fbcfc...; the fold alone moved them to e031743e... and
# ca9310dc..., the mix's stops to these.
OLD_MIX = {
    3: "e2880794d5b1fd6ead3725e0df6df295",
    17: "500d344c622ab7e31f2694bbad8aca48",
}


def _as_before(seed: int) -> str:
    step = Ingest()
    for i, (subject, body, _) in enumerate(mix.items(seed, 20_000, nodes=12, bad=True), 1):
        step.raw(i, subject, body)
    s = json.loads(encode_state(step.view.state))
    del s["schema"]
    for r in s["replicas"].values():
        assert r.pop("stopped_on") == []
        r.pop("drained_on")
        r.pop("ready_on")
        r.pop("failed_on")
        r.pop("failed_by")
        assert r.pop("engine") is None
    for n in s["nodes"].values():
        assert n["report"].pop("address") == ""
    for m in s["models"].values():
        assert m.pop("shared") is None
    return hashlib.blake2b(json.dumps(s, sort_keys=True).encode(), digest_size=16).hexdigest()


def test_an_old_log_folds_as_it_did_before_the_field() -> None:
    for seed, want in OLD_MIX.items():
        assert _as_before(seed) == want, seed
    # The mix has two-node replicas stopped by one report about the whole replica.
    items = mix.items(3, 20_000, nodes=12, bad=True)
    assert any(b'"profile":"tp8x2","state":"stopped"' in body for _, body, _ in items)
