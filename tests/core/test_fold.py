"""Table tests for the fold's rules, one rule a case, named by the rule."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from schemas import events as ev
from schemas import subjects
from services.core import fold
from services.core.view import View, encode_state

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


class Log:
    """Builds a view event by event; each event gets the next seq and `minutes` time."""

    def __init__(self) -> None:
        self.view = View()
        self.seq = 0
        self.rejections: list[str] = []

    def add(
        self, data: ev.Data, minutes: float = 0, *, node: str | None = None, eid: str | None = None
    ) -> str | None:
        self.seq += 1
        e = ev.make(data, id=eid or f"e{self.seq}", time=at(minutes), source="test")
        subject = subjects.subject_for(e, node=node or "n1")
        r = fold.apply(self.view, e, seq=self.seq, subject=subject)
        if r is not None:
            self.rejections.append(r.reason)
            return r.reason
        return None


def inventory(node: str = "n1", gpus: int = 4) -> ev.NodeInventory:
    return ev.NodeInventory(
        node=node,
        gpus=tuple(
            ev.GpuInfo(index=i, uuid=f"{node}-{i}", model="H100", memory_gb=80) for i in range(gpus)
        ),
        cpu_cores=64,
        memory_gb=512,
    )


MODEL = ev.ModelDeclared(
    name="m", profiles=(ev.ProfileSpec(name="p", gpus=2, cpu_cores=4, memory_gb=32),)
)
SHARDS = (ev.ShardSpec(node="n1", gpus=(0, 1)),)


def placed(log: Log, rid: str = "r1", minutes: float = 1) -> None:
    assert log.add(MODEL) is None
    assert log.add(inventory()) is None
    assert (
        log.add(
            ev.PlacementDecided(replica=rid, model="m", profile="p", shards=SHARDS, reason="fit"),
            minutes,
        )
        is None
    )


def state(rid: str, st: str, shards: tuple[ev.ShardSpec, ...] = SHARDS) -> ev.ReplicaState:
    return ev.ReplicaState(replica=rid, model="m", profile="p", state=st, shards=shards)  # type: ignore[arg-type]


def inventory_replaces_the_last(log: Log) -> None:
    log.add(inventory(gpus=4))
    log.add(inventory(gpus=2))
    assert [g.index for g in log.view.state.nodes["n1"].report.gpus] == [0, 1]
    assert log.view.inventory.free_gpus("n1") == [0, 1]


def lost_node_releases_capacity(log: Log) -> None:
    placed(log)
    assert log.view.inventory.free_gpus("n1") == [2, 3]
    assert log.add(ev.NodeLost(node="n1", reason="gone"), 5) is None
    r = log.view.replicas["r1"]
    assert r.state == "failed" and not r.holds_capacity
    assert log.view.inventory.allocation("r1") is None
    # Found again by a fresh report, with every GPU free.
    log.add(inventory(), 6)
    assert not log.view.state.nodes["n1"].lost
    assert log.view.inventory.free_gpus("n1") == [0, 1, 2, 3]


def cordon_outlives_reports(log: Log) -> None:
    log.add(inventory())
    log.add(ev.NodeCordoned(node="n1"))
    log.add(inventory())
    assert log.view.state.nodes["n1"].cordoned
    assert not log.view.inventory.schedulable("n1")
    log.add(ev.NodeUncordoned(node="n1"))
    assert log.view.inventory.schedulable("n1")


def state_going_backwards_is_rejected(log: Log) -> None:
    placed(log)
    assert log.add(state("r1", "ready"), 2) is None
    why = log.add(state("r1", "loading"), 3)
    assert why is not None and "cannot go from ready to loading" in why
    assert log.view.replicas["r1"].state == "ready"


def agent_on_the_wrong_node_is_rejected(log: Log) -> None:
    placed(log)
    log.add(inventory("n2"))
    why = log.add(state("r1", "ready"), 2, node="n2")
    assert why is not None and "agent on n2" in why
    assert log.view.replicas["r1"].state == "pending"
    why = log.add(ev.ReplicaUsed(replica="r1", at=at(2)), 2, node="n2")
    assert why is not None and "agent on n2" in why


def drain_for_unknown_replica_is_rejected(log: Log) -> None:
    why = log.add(ev.ReplicaDrain(replica="ghost", model="m", reason="scale_down"), node="n1")
    assert why == "drain for unknown replica ghost"
    assert log.view.state.rejected == 1


def times_are_derived_from_events(log: Log) -> None:
    placed(log, minutes=1)
    log.add(state("r1", "starting"), 2)
    log.add(state("r1", "ready"), 3)
    log.add(state("r1", "ready"), 4)
    log.add(ev.ReplicaUsed(replica="r1", at=at(10)), 10)
    log.add(ev.ReplicaUsed(replica="r1", at=at(8)), 11)  # late report: older use
    r = log.view.replicas["r1"]
    assert r.created_at == at(1)
    assert r.ready_at == at(3)
    assert r.last_used_at == at(10)
    assert r.retiring_at is None and r.preempted_for is None
    log.add(ev.ReplicaDrain(replica="r1", model="m", reason="scale_down"), 12, node="n1")
    assert r.retiring_at == at(12) and not r.live


def unknown_use_is_not_idle(log: Log) -> None:
    placed(log)
    r = log.view.replicas["r1"]
    assert r.last_used_at is None and r.idle_s(at(100)) is None


def preempted_for_comes_from_the_drain(log: Log) -> None:
    placed(log)
    log.add(
        ev.ReplicaDrain(replica="r1", model="m", reason="preempted", for_model="big"), 5, node="n1"
    )
    log.add(
        ev.ReplicaDrain(replica="r1", model="m", reason="scale_down"), 6, node="n1"
    )  # the first reason stands
    r = log.view.replicas["r1"]
    assert r.preempted_for == "big" and r.retiring_at is None and r.drain_reason == "preempted"


def created_at_from_the_placement(log: Log) -> None:
    placed(log, "r9", 7)
    log.add(state("r9", "loading"), 8)
    r = log.view.replicas["r9"]
    assert r.created_at == at(7) and r.ready_at is None
    assert log.view.inventory.allocation("r9") is not None


def duplicates_are_harmless(log: Log) -> None:
    placed(log)
    once = None
    for _ in range(2):
        log.add(state("r1", "ready"), 2, eid="dup-ready")
        log.add(ev.ReplicaUsed(replica="r1", at=at(3)), 3, eid="dup-used")
        log.add(inventory(), 4, eid="dup-inv")
        s = log.view.state
        now = encode_state(type(s)(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "seq": 0}))
        once = once or now
        assert now == once
    assert log.rejections == []


def placement_decided_twice_is_one_replica(log: Log) -> None:
    placed(log)
    dec = ev.PlacementDecided(replica="r1", model="m", profile="p", shards=SHARDS, reason="fit")
    assert log.add(dec, 2) is None
    assert len(log.view.replicas) == 1
    assert len(log.view.inventory.allocations()) == 1


def stopped_releases_capacity(log: Log) -> None:
    placed(log)
    log.add(state("r1", "draining"), 2)
    assert log.view.inventory.free_gpus("n1") == [2, 3]
    log.add(state("r1", "stopped"), 3)
    assert log.view.inventory.free_gpus("n1") == [0, 1, 2, 3]
    assert log.add(state("r1", "ready"), 4) is not None  # no resurrection


def holds_are_created_and_released(log: Log) -> None:
    log.add(ev.HoldCreated(model="small", for_model="big", until=at(30)), 1)
    h = log.view.state.holds["small"]
    assert h.for_model == "big" and h.until == at(30) and h.created_by == "e1"
    assert log.view.active_hold("small", at(10)) is h
    # Expiry is a query with now; at `until` exactly the hold is still on.
    assert log.view.active_hold("small", at(30)) is h
    assert log.view.active_hold("small", at(31)) is None
    log.add(ev.HoldReleased(model="small", reason="satisfied"), 2)
    assert "small" not in log.view.state.holds


def preempting_waits_for_victims(log: Log) -> None:
    placed(log)
    victim = ev.Victim(replica="r1", model="m", cls="standard", tier=2, above_min=True, gpus=2)
    log.add(ev.PreemptionDecided(for_model="big", outcome="preempted", victims=(victim,)), 5)
    assert log.view.awaiting("big") == ("r1",)
    d = log.view.state.decisions[-1]
    assert d.outcome == "preempted" and d.model == "big" and d.seq == log.seq
    log.add(state("r1", "stopped"), 6)
    assert log.view.awaiting("big") == ()


def decisions_carry_their_own_sequence(log: Log) -> None:
    placed(log)
    placement = log.view.state.decisions[-1]
    assert placement.seq == 3 and placement.outcome == "placed"
    log.add(ev.PlacementFailed(model="m", profiles=("p",), live=1, desired=2, reason="no_fit"), 4)
    assert log.view.state.decisions[-1].seq == 4


def model_removed_unknown_is_rejected(log: Log) -> None:
    assert log.add(ev.ModelRemoved(name="nope")) == "model nope is not declared"


def ready(log: Log, rid: str = "r1", shards: tuple[ev.ShardSpec, ...] = SHARDS) -> None:
    for st in ("starting", "ready"):
        assert log.add(state(rid, st, shards), 2) is None


def lost_with_a_grace_keeps_its_replicas_until_a_loss_without_one(log: Log) -> None:
    placed(log)
    ready(log)
    assert log.add(ev.NodeLost(node="n1", reason="no heartbeat", grace_s=60), 5) is None
    rec = log.view.state.nodes["n1"]
    assert rec.lost and not log.view.inventory.schedulable("n1")
    assert rec.failing_at == at(6)
    r = log.view.replicas["r1"]
    assert r.state == "ready" and log.view.inventory.allocation("r1") is not None
    # A second word of the loss does not stretch the grace.
    assert log.add(ev.NodeLost(node="n1", reason="no heartbeat", grace_s=60), 5.5) is None
    assert log.view.state.nodes["n1"].failing_at == at(6)
    # The grace passed: a node.lost without one fails them.
    assert log.add(ev.NodeLost(node="n1", reason="not heard from within the grace"), 6) is None
    assert log.view.state.nodes["n1"].failing_at is None
    r = log.view.replicas["r1"]
    assert r.state == "failed" and r.reason == "node lost: not heard from within the grace"
    assert log.view.inventory.allocation("r1") is None


def found_brings_a_lost_node_back_with_its_replicas(log: Log) -> None:
    placed(log)
    ready(log)
    log.add(ev.NodeLost(node="n1", reason="no heartbeat", grace_s=60), 5)
    assert log.add(ev.NodeFound(node="n1", reason="heartbeat heard again"), 5.2) is None
    rec = log.view.state.nodes["n1"]
    assert not rec.lost and rec.failing_at is None and rec.lost_reason is None
    assert log.view.inventory.schedulable("n1")
    assert log.view.replicas["r1"].state == "ready"
    assert log.view.inventory.free_gpus("n1") == [2, 3]
    # Found when not lost: nothing to do; found when never known: rejected.
    assert log.add(ev.NodeFound(node="n1"), 5.3) is None
    assert log.add(ev.NodeFound(node="n9"), 5.3) == "unknown node n9"


def a_report_within_the_grace_brings_it_back_too(log: Log) -> None:
    placed(log)
    ready(log)
    log.add(ev.NodeLost(node="n1", reason="no heartbeat", grace_s=60), 5)
    assert log.add(inventory(), 5.5) is None
    assert not log.view.state.nodes["n1"].lost
    assert log.view.state.nodes["n1"].failing_at is None
    assert log.view.replicas["r1"].state == "ready"


def found_after_the_grace_leaves_failed_replicas_failed(log: Log) -> None:
    placed(log)
    ready(log)
    log.add(ev.NodeLost(node="n1", reason="gone"), 5)
    assert log.add(ev.NodeFound(node="n1"), 6) is None
    assert log.view.inventory.schedulable("n1")
    assert log.view.replicas["r1"].state == "failed"
    assert log.view.inventory.free_gpus("n1") == [0, 1, 2, 3]
    assert log.add(state("r1", "ready"), 7) == "replica r1 cannot go from failed to ready"


def a_smaller_report_fails_the_replicas_on_gpus_gone(log: Log) -> None:
    placed(log)
    ready(log)
    other = (ev.ShardSpec(node="n1", gpus=(2, 3)),)
    log.add(ev.PlacementDecided(replica="r2", model="m", profile="p", shards=other, reason="f"))
    ready(log, "r2", other)
    assert log.add(inventory(gpus=2), 5) is None
    r2 = log.view.replicas["r2"]
    assert r2.state == "failed" and not r2.holds_capacity
    assert r2.reason == "node n1 no longer has its GPUs: GPU 2, 3 are gone"
    assert log.view.replicas["r1"].state == "ready"
    # GPUs in use never exceed GPUs present.
    held = {i for a in log.view.inventory.allocations() for sh in a.shards for i in sh.gpus}
    assert held == {0, 1} and log.view.inventory.free_gpus("n1") == []
    # What it reports later is a state going backwards.
    assert log.add(state("r2", "ready", other), 6) == "replica r2 cannot go from failed to ready"


def another_gpu_model_fails_a_replica_of_a_profile_that_names_one(log: Log) -> None:
    asks = ev.ModelDeclared(
        name="m", profiles=(ev.ProfileSpec(name="p", gpus=2, gpu_model="H100"),)
    )
    log.add(asks)
    log.add(inventory())
    log.add(ev.PlacementDecided(replica="r1", model="m", profile="p", shards=SHARDS, reason="f"))
    ready(log)
    l4 = msgspec.structs.replace(
        inventory(),
        gpus=tuple(msgspec.structs.replace(g, model="L4") for g in inventory().gpus),
    )
    assert log.add(l4, 5) is None
    r = log.view.replicas["r1"]
    assert (
        r.state == "failed"
        and r.reason == "node n1 no longer has its GPUs: GPU 0 is a L4, not a H100"
    )


def less_gpu_memory_than_the_profile_fails_its_replica(log: Log) -> None:
    asks = ev.ModelDeclared(
        name="m", profiles=(ev.ProfileSpec(name="p", gpus=2, gpu_memory_gb=80),)
    )
    log.add(asks)
    log.add(inventory())
    log.add(ev.PlacementDecided(replica="r1", model="m", profile="p", shards=SHARDS, reason="f"))
    small = msgspec.structs.replace(
        inventory(),
        gpus=tuple(msgspec.structs.replace(g, memory_gb=24) for g in inventory().gpus),
    )
    assert log.add(small, 5) is None
    r = log.view.replicas["r1"]
    assert (
        r.state == "failed"
        and r.reason == "node n1 no longer has its GPUs: GPU 0 has 24 GB, not 80"
    )
    # A report that still covers it (more GPUs, the same ones) changes nothing.
    assert log.add(inventory(gpus=8), 6) is None
    assert log.view.inventory.free_gpus("n1") == list(range(8))


CASES: list[Callable[[Log], None]] = [
    inventory_replaces_the_last,
    lost_node_releases_capacity,
    lost_with_a_grace_keeps_its_replicas_until_a_loss_without_one,
    found_brings_a_lost_node_back_with_its_replicas,
    a_report_within_the_grace_brings_it_back_too,
    found_after_the_grace_leaves_failed_replicas_failed,
    a_smaller_report_fails_the_replicas_on_gpus_gone,
    another_gpu_model_fails_a_replica_of_a_profile_that_names_one,
    less_gpu_memory_than_the_profile_fails_its_replica,
    cordon_outlives_reports,
    state_going_backwards_is_rejected,
    agent_on_the_wrong_node_is_rejected,
    drain_for_unknown_replica_is_rejected,
    times_are_derived_from_events,
    unknown_use_is_not_idle,
    preempted_for_comes_from_the_drain,
    created_at_from_the_placement,
    duplicates_are_harmless,
    placement_decided_twice_is_one_replica,
    stopped_releases_capacity,
    holds_are_created_and_released,
    preempting_waits_for_victims,
    decisions_carry_their_own_sequence,
    model_removed_unknown_is_rejected,
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", [pytest.param(c, id=c.__name__.replace("_", " ")) for c in CASES])
def test_fold_rule(case: Callable[[Log], None]) -> None:
    case(Log())
