"""A gang's life is its shards' lives: a replica with shards on several nodes is ready
when its last shard is, answers at its head shard's endpoint, and when one shard fails
(its node lost past the grace, its GPUs gone, its server failed) the shards still
running are drained (`replica.drain`, `shard_failed`, one per node) and hold their GPUs
in the view until each says `stopped`, so no start is placed under a server still
running.

The table tests walk one gang through each way of breaking; a property (hypothesis,
derandomised) runs the scheduler's passes, the loss and the surviving agent in random
orders against a model of the world's servers and counts the double bookings: none.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from schemas import subjects
from services.core import fold, routing, scheduling
from services.core.ingest import Ingest
from services.core.view import View, decode_state, encode_state
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(120)

NVL = ev.TopologySpec(level="nvlink_domain")
PP2 = ev.ProfileSpec(name="pp2", gpus=8, shards=2, topology=NVL)
GANG = (("a1", range(8)), ("a2", range(8)))
CONFIG = scheduling.Config()


class Plane:
    """A view folded event by event, as the projector folds the log (with subjects)."""

    def __init__(self, s: Scenario) -> None:
        self.view = View()
        self.seq = 0
        self.now = s.now
        for seq, subject, e in s.events():
            assert fold.apply(self.view, e, seq=seq, subject=subject) is None, e
            self.seq = seq

    def put(self, data: ev.Data, node: str | None = None, *, eid: str | None = None) -> str:
        """Fold `data` (from `node`'s agent, or to its command subject); the rejection's
        reason, or "" when applied."""
        self.seq += 1
        e = ev.make(data, id=eid or f"x{self.seq:06d}", time=self.now, source="test")
        subject = subjects.subject_for(e, "llmgw", node=node)
        got = fold.apply(self.view, e, seq=self.seq, subject=subject)
        return "" if got is None else got.reason

    def shard(
        self, state: str, node: str, endpoint: str | None = None, reason: str | None = None
    ) -> str:
        """g1's shard on `node` says `state`, as its agent does."""
        r = self.view.state.replicas["g1"]
        return self.put(
            ev.ReplicaState(
                replica="g1",
                model="big",
                profile="pp2",
                state=state,  # type: ignore[arg-type]
                shards=r.shards,
                node=node,
                endpoint=endpoint,
                reason=reason,
            ),
            node,
        )

    def plan(self, **kw: object) -> scheduling.Plan:
        return scheduling.plan(self.view, self.now, CONFIG, **kw)  # type: ignore[arg-type]

    def publish(self, p: scheduling.Plan) -> list[ev.Event]:
        """Fold a pass's outputs, as the scheduler publishes them."""
        out = []
        for o in p.outputs:
            self.seq += 1
            subject = subjects.subject_for(o.event, "llmgw", node=o.node)
            if fold.apply(self.view, o.event, seq=self.seq, subject=subject) is None:
                out.append(o.event)
        return out


def cluster(gang_state: str | None = "ready") -> Plane:
    """Nodes a1, a2, a3 of one NVLink domain; critical two-node model `big` (min 1) with
    g1 placed on all of a1 and a2; with `gang_state`, both shards said it."""
    s = Scenario()
    for n in ("a1", "a2", "a3"):
        s.node(n, 8, labels={"nvlink_domain": "A"})
    s.model("big", cls="critical", min=1, profiles=[PP2])
    s.emit(
        ev.PlacementDecided(
            replica="g1",
            model="big",
            profile="pp2",
            shards=tuple(ev.ShardSpec(node=n, gpus=tuple(g)) for n, g in GANG),
            reason="test",
        )
    )
    p = Plane(s)
    if gang_state is not None:
        for n in ("a1", "a2"):
            assert p.shard(gang_state, n, f"http://{n}:8000") == ""
    return p


def free(v: View, node: str) -> int:
    return len(v.inventory.free_gpus(node))


def drains(p: scheduling.Plan) -> list[tuple[str, str | None]]:
    return [
        (o.event.data.reason, o.node)
        for o in p.outputs
        if isinstance(o.event, ev.ReplicaDrainEvent)
    ]


def placed_on(events: Iterable[ev.Event]) -> list[tuple[str, int]]:
    return [
        (sh.node, g)
        for e in events
        if isinstance(e, ev.PlacementDecidedEvent)
        for sh in e.data.shards
        for g in sh.gpus
    ]


# ------------------------------------------------------------------ ready


def test_a_gang_is_loading_until_its_last_shard_is_ready_and_answers_at_its_head() -> None:
    p = cluster(gang_state=None)
    v = p.view
    m = v.catalog.resolve("big")
    assert m is not None
    assert p.shard("loading", "a2") == ""
    assert p.shard("ready", "a1", "http://a1:8000") == ""
    r = v.state.replicas["g1"]
    assert (r.state, r.ready_at) == ("loading", None)
    assert r.ready_on == ("a1",)
    assert routing.candidates(v, m) == []
    # The other shard's ready makes it ready; the endpoint stays the head's (shard 0).
    p.now += timedelta(seconds=5)
    assert p.shard("ready", "a2", "http://a2:8000") == ""
    assert (r.state, r.endpoint, r.ready_at) == ("ready", "http://a1:8000", p.now)
    assert routing.candidates(v, m) == [r]


def test_a_gang_whose_head_says_ready_last_answers_there() -> None:
    p = cluster(gang_state=None)
    assert p.shard("ready", "a2", "http://a2:8000") == ""
    r = p.view.state.replicas["g1"]
    assert (r.state, r.endpoint) == ("loading", None)
    assert p.shard("ready", "a1", "http://a1:8000") == ""
    assert (r.state, r.endpoint) == ("ready", "http://a1:8000")


# ------------------------------------------------------------------ a shard fails


@pytest.mark.parametrize(
    "breaks",
    [
        pytest.param("lost", id="its node lost past the grace"),
        pytest.param("failed", id="its agent says it failed"),
        pytest.param("gpus", id="its node reports its GPUs gone"),
    ],
)
def test_a_failed_shard_drains_the_others_which_hold_their_gpus_until_stopped(
    breaks: str,
) -> None:
    p = cluster()
    v = p.view
    if breaks == "lost":
        assert p.put(ev.NodeLost(node="a1", reason="no heartbeat for 16s")) == ""
    elif breaks == "failed":
        assert p.shard("failed", "a1", reason="server exited 1") == ""
    else:
        rec = v.state.nodes["a1"].report
        assert p.put(ev.NodeInventory(node="a1", gpus=(), cpu_cores=96, memory_gb=1024), "a1") == ""
        assert rec.node == "a1"
    r = v.state.replicas["g1"]
    # The surviving shard's server still runs: its GPUs stay held.
    assert free(v, "a2") == 0 and v.inventory.holder("a2", 0) == "g1"
    assert r.state == "draining" and not r.live and r.holds_capacity
    assert r.failed_on == ("a1",)
    assert routing.candidates(v, v.catalog.resolve("big")) == []  # type: ignore[arg-type]

    # The scheduler drains the surviving shard, on its own node only, and places nothing
    # on its GPUs: `big` needs two free nodes of the domain and has one (a3; a1 too when
    # it is not lost).
    first = p.plan()
    assert drains(first) == [("shard_failed", "a2")]
    out = p.publish(first)
    assert ("a2", 0) not in placed_on(out)
    assert r.drained_on == ("a2",) and r.drain_reason == "shard_failed"
    # Asked once: the next pass does not ask again, and still places nothing there.
    again = p.plan()
    assert drains(again) == []
    assert all(n != "a2" for n, _ in placed_on(p.publish(again)))

    # The agent drains it, then says stopped: the gang failed, and its GPUs are free.
    assert p.shard("draining", "a2") == ""
    assert free(v, "a2") == 0
    assert p.shard("stopped", "a2") == ""
    assert (r.state, r.stopped_on, free(v, "a2")) == ("failed", ("a2",), 8)
    # The reason is the failure's, not the stop's.
    assert r.reason is not None and r.reason.startswith(("node lost", "server", "node a1"))
    assert list(v.broken()) == []
    # A late word from either shard changes nothing.
    assert p.shard("stopped", "a2") == ""
    assert p.shard("failed", "a1") == ""
    assert r.state == "failed"


def test_a_node_lost_with_a_grace_keeps_the_gang_whole_until_the_grace_ends() -> None:
    p = cluster()
    v = p.view
    assert p.put(ev.NodeLost(node="a1", reason="no heartbeat", grace_s=60)) == ""
    r = v.state.replicas["g1"]
    assert (r.state, free(v, "a1"), free(v, "a2")) == ("ready", 0, 0)
    assert not any(isinstance(o.event, ev.ReplicaDrainEvent) for o in p.plan().outputs)
    # The grace passes unheard: the scheduler says so, the fold fails the lost shard.
    p.now += timedelta(seconds=61)
    lost = p.plan()
    assert [type(o.event) for o in lost.outputs] == [ev.NodeLostEvent]
    p.publish(lost)
    assert (r.state, free(v, "a2")) == ("draining", 0)
    assert r.failed_on == ("a1",)
    assert drains(p.plan()) == [("shard_failed", "a2")]


def test_the_drain_is_the_same_whoever_decides_it() -> None:
    """Two schedulers on the same view send the same drain: its id is derived from the
    event that failed the shard, which it names as its cause."""
    p = cluster()
    p.put(ev.NodeLost(node="a1", reason="no heartbeat"), eid="lost-a1")
    assert p.view.state.replicas["g1"].failed_by == "lost-a1"
    got = [
        [o.event for o in x.outputs if isinstance(o.event, ev.ReplicaDrainEvent)]
        for x in (p.plan(source="one"), p.plan(source="two"))
    ]
    assert len(got[0]) == 1 and [e.id for e in got[0]] == [e.id for e in got[1]]
    assert got[0][0].causation == "lost-a1"


def test_a_gang_preempted_then_broken_is_not_asked_twice() -> None:
    p = cluster()
    for n in ("a1", "a2"):
        assert p.put(ev.ReplicaDrain(replica="g1", model="big", reason="preempted"), n) == ""
    p.put(ev.NodeLost(node="a1", reason="no heartbeat"))
    r = p.view.state.replicas["g1"]
    assert (r.state, r.drain_reason) == ("draining", "preempted")
    assert drains(p.plan()) == []
    assert free(p.view, "a2") == 0


def test_a_snapshot_of_a_broken_gang_holds_what_the_live_view_holds() -> None:
    p = cluster()
    p.put(ev.NodeLost(node="a1", reason="no heartbeat"))
    again = p.view.copy()
    assert (free(again, "a1"), free(again, "a2")) == (8, 0)
    assert again.inventory.allocations() == p.view.inventory.allocations()
    assert [r.id for r in again.broken()] == ["g1"]


# ------------------------------------------------------------------ no double booking

STEP = st.sampled_from(("pass", "agent", "tick", "tick", "pass"))


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    how=st.sampled_from(("silent", "lost", "failed")),
    steps=st.lists(STEP, min_size=4, max_size=30),
    fill=st.booleans(),
)
def test_no_start_is_placed_on_a_surviving_shards_gpus_while_it_runs(
    how: str, steps: list[str], fill: bool
) -> None:
    """The world: the servers running on each node's GPUs. A placement on a GPU whose
    server still runs is a double booking; the surviving shard's server stops only when
    its agent, having taken the drain, says stopped. Whatever the order of passes, the
    agent and the clock, none happens, and the gang's model is placed again once the
    room is free."""
    p = cluster()
    v = p.view
    if fill:
        # A second model that fits any one node, for the freed GPUs to be wanted twice.
        p.put(ev.ModelDeclared(name="one", min=1, profiles=(ev.ProfileSpec(name="x8", gpus=8),)))
    running: dict[tuple[str, int], str] = {(n, g): "g1" for n, gs in GANG for g in gs}
    silent: dict[str, float] = {}
    if how == "silent":
        silent["a1"] = 1e9  # its agent is gone: the scheduler's own loss, with a grace
    elif how == "lost":
        p.put(ev.NodeLost(node="a1", reason="no heartbeat"))
    else:
        p.put(
            ev.ReplicaState(
                replica="g1",
                model="big",
                profile="pp2",
                state="failed",
                shards=v.state.replicas["g1"].shards,
                node="a1",
                reason="exit 1",
            ),
            "a1",
        )
    # The shard on a1 is gone with its node or its server.
    for g in range(8):
        running.pop(("a1", g))
    inbox: list[ev.ReplicaDrainEvent] = []  # drains on a2's subject, not yet taken
    doubles = []
    placed = []  # the models placed, in order
    for step in [*steps, *["tick", "pass", "pass", "agent"] * 3, "pass"]:
        if step == "tick":
            p.now += timedelta(seconds=CONFIG.lost_grace_s / 2 + 1)
        elif step == "agent":
            for d in inbox:
                if running.get(("a2", 0)) == d.data.replica:
                    p.shard("draining", "a2")
                    p.shard("stopped", "a2")
                    for g in range(8):
                        running.pop(("a2", g))
            inbox.clear()
        else:
            plan = p.plan(silent={n: s for n, s in silent.items() if not v.state.nodes[n].lost})
            for o in plan.outputs:
                if isinstance(o.event, ev.ReplicaDrainEvent) and o.node == "a2":
                    inbox.append(o.event)
            for e in p.publish(plan):
                if isinstance(e, ev.PlacementDecidedEvent):
                    placed.append(e.data.model)
                    for sh in e.data.shards:
                        for g in sh.gpus:
                            if (sh.node, g) in running:
                                doubles.append((e.data.replica, sh.node, g, running[(sh.node, g)]))
                            running[(sh.node, g)] = e.data.replica
    assert doubles == []
    # In the end the surviving shard was drained and stopped, and big placed again (when
    # `one` did not take the room first: then it waits for the preemption service).
    r = v.state.replicas["g1"]
    assert r.state == "failed" and "g1" not in running.values()
    assert fill or "big" in placed


def test_the_ingest_step_rewrites_the_rows_of_a_gang_broken_by_a_lost_node() -> None:
    """The store rewrites the replica (now draining) and the GPU rows of both its nodes."""
    p = cluster()
    step = Ingest(View(decode_state(encode_state(p.view.state))))
    step.touched.clear()
    e = ev.make(ev.NodeLost(node="a1", reason="no heartbeat"), id="l", time=p.now, source="s")
    step.event(p.seq + 1, subjects.subject_for(e, "llmgw"), e)
    assert step.verdict is None
    assert "g1" in step.touched.replicas and {"a1", "a2"} <= step.touched.nodes


def test_a_shards_ready_refused_records_nothing() -> None:
    """A shard's late ready to a gang already draining is refused, and its `ready_on` is
    as it was: a rejected event changes nothing."""
    p = cluster(gang_state=None)
    assert p.shard("ready", "a1", "http://a1:8000") == ""
    for n in ("a1", "a2"):
        assert p.put(ev.ReplicaDrain(replica="g1", model="big", reason="scale_down"), n) == ""
    assert p.shard("draining", "a1") == ""
    assert p.shard("ready", "a2") == "replica g1 cannot go from draining to ready"
    assert p.view.state.replicas["g1"].ready_on == ("a1",)
