"""The pure pass, without a broker: ids, multi-shard starts, scale-down order, and the
rule that an unchanged failure is reported once per backoff period."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from schemas import events as ev
from services.core import fold
from services.core import scheduling as planner
from services.core.view import View
from tests.core.test_fold import inventory

pytestmark = pytest.mark.timeout(10)

T0 = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)
CONFIG = planner.Config()


class Log:
    def __init__(self) -> None:
        self.view = View()
        self.n = 0

    def add(self, data: ev.Data, at: datetime = T0) -> None:
        self.n += 1
        fold.apply(self.view, ev.make(data, id=f"e{self.n}", time=at, source="t"), seq=self.n)

    def apply(self, out: planner.Plan) -> None:
        for o in out.outputs:
            self.n += 1
            fold.apply(self.view, o.event, seq=self.n)

    def node(self, name: str, gpus: int = 8) -> None:
        self.add(inventory(name, gpus))

    def model(self, name: str, gpus: int, shards: int = 1, min: int = 1, max: int = 4) -> None:
        p = ev.ProfileSpec(name="p", gpus=gpus, shards=shards)
        self.add(ev.ModelDeclared(name=name, min=min, max=max, profiles=(p,)))


def of(out: planner.Plan, kind: type[ev.Envelope]) -> list[planner.Output]:
    return [o for o in out.outputs if isinstance(o.event, kind)]


def test_multi_shard_replica_gets_a_start_on_each_node() -> None:
    log = Log()
    log.node("a")
    log.node("b")
    log.model("m", gpus=8, shards=2)
    out = planner.plan(log.view, T0, CONFIG)
    (d,) = of(out, ev.PlacementDecidedEvent)
    starts = of(out, ev.ReplicaStartEvent)
    assert sorted(o.node for o in starts if o.node) == ["a", "b"]
    assert len({o.event.id for o in starts}) == 2
    assert all(o.event.causation == d.event.id for o in starts)


def test_scale_down_prefers_not_ready_then_least_recently_used_then_newest() -> None:
    log = Log()
    log.node("a")
    log.model("m", gpus=1, min=0, max=8)
    log.add(ev.ScaleDesired(model="m", replicas=4))
    out = planner.plan(log.view, T0, CONFIG)
    log.apply(out)
    reps = [o.event.data for o in of(out, ev.ReplicaStartEvent)]
    # r0, r1 ready and used (r1 longer ago); r2 ready, never reported used; r3 loading.
    for i, d in enumerate(reps):
        state = "loading" if i == 3 else "ready"
        log.add(
            ev.ReplicaState(
                replica=d.replica, model="m", profile="p", state=state, shards=d.shards
            ),
            at=T0 + timedelta(seconds=i),
        )
    log.add(ev.ReplicaUsed(replica=reps[0].replica, at=T0 + timedelta(minutes=5)))
    log.add(ev.ReplicaUsed(replica=reps[1].replica, at=T0 + timedelta(minutes=1)))
    order = []
    for n in (3, 2, 1):
        log.add(ev.ScaleDesired(model="m", replicas=n))
        out = planner.plan(log.view, T0 + timedelta(minutes=10), CONFIG)
        (drain,) = of(out, ev.ReplicaDrainEvent)
        assert drain.event.data.reason == "scale_down"
        order.append(drain.event.data.replica)
        log.apply(out)
    assert order == [reps[3].replica, reps[1].replica, reps[0].replica]


def test_unchanged_failure_is_reported_once_per_growing_backoff() -> None:
    log = Log()
    log.node("a", gpus=4)
    log.model("big", gpus=8)
    memory: dict[str, planner.Failure] = {}
    base, quiet = CONFIG.failed_backoff_s, CONFIG.failed_quiet_s

    def run(at: float) -> int:
        now = T0 + timedelta(seconds=at)
        nonlocal memory
        out = planner.plan(log.view, now, CONFIG, failures=memory)
        for o in out.outputs:
            if o.failure:
                memory[o.failure[0]] = o.failure[1]
        memory = planner.remember(memory, out.satisfied, now, CONFIG)
        log.apply(out)
        return out.failed

    assert run(0) == 1
    assert run(1) == 0
    log.add(ev.ScaleDesired(model="unrelated", replicas=3))  # not an input of big's failure
    assert run(2) == 0
    assert run(base + 1) == 1
    # Unchanged, the period doubles: not again at 2 x base, but at 3 x base.
    assert run(2 * base + 2) == 0
    assert run(3 * base + 1) == 1
    # The cluster changes a second after the report: said once the quiet period is over.
    log.node("b", gpus=4)
    assert run(3 * base + 2) == 0
    assert run(3 * base + 1 + quiet) == 1
    log.node("c", gpus=4)
    assert run(3 * base + 2 + quiet) == 0
    assert run(3 * base + 1 + 2 * quiet) == 1
    assert run(3 * base + 1 + 2 * quiet + base) == 1  # a change starts the period again


def test_lost_node_is_reported_alone_and_once() -> None:
    log = Log()
    log.node("a")
    log.model("m", gpus=1, min=2)
    config = dataclasses.replace(CONFIG, node_timeout_s=5)
    out = planner.plan(log.view, T0, config, silent={"a": 6.0})
    assert [type(o.event) for o in out.outputs] == [ev.NodeLostEvent]
    again = planner.plan(log.view, T0, config, silent={"a": 7.0})
    assert again.outputs[0].event.id == out.outputs[0].event.id
    log.apply(out)
    after = planner.plan(log.view, T0, config, silent={"a": 8.0})
    assert of(after, ev.NodeLostEvent) == []


def _one_replica_on_a() -> tuple[Log, planner.Config]:
    """Node a with one replica of m placed on it, under a node timeout of 5 s and a grace
    of 30 s after the first node.lost."""
    log = Log()
    log.node("a")
    log.model("m", gpus=1, min=1)
    config = dataclasses.replace(CONFIG, node_timeout_s=5, lost_grace_s=30)
    log.apply(planner.plan(log.view, T0, config))
    return log, config


def test_a_lost_node_s_replicas_fail_only_once_its_grace_has_passed() -> None:
    log, config = _one_replica_on_a()
    (rid,) = log.view.replicas
    out = planner.plan(log.view, T0, config, silent={"a": 6.0})
    lost = of(out, ev.NodeLostEvent)[0].event
    assert isinstance(lost, ev.NodeLostEvent) and lost.data.grace_s == 30
    log.apply(out)
    # Within the grace: no second loss, and the replica still counts (nothing placed).
    within = planner.plan(log.view, T0 + timedelta(seconds=29), config)
    assert within.outputs == []
    assert log.view.replicas[rid].holds_capacity
    # Past it: the second node.lost, without a grace, alone; the same from any scheduler.
    past = planner.plan(log.view, T0 + timedelta(seconds=31), config)
    final = of(past, ev.NodeLostEvent)[0].event
    assert [type(o.event) for o in past.outputs] == [ev.NodeLostEvent]
    assert isinstance(final, ev.NodeLostEvent) and final.data.grace_s == 0
    assert final.data.reason == (
        "not heard from within the grace, over at 14:00:30Z (it was lost for: no heartbeat for 6s)"
    )
    again = planner.plan(log.view, T0 + timedelta(seconds=40), config)
    assert of(again, ev.NodeLostEvent)[0].event.id == final.id
    log.apply(past)
    assert log.view.replicas[rid].state == "failed"
    assert of(planner.plan(log.view, T0 + timedelta(seconds=50), config), ev.NodeLostEvent) == []


def test_a_lost_node_heard_again_is_found_not_failed() -> None:
    log, config = _one_replica_on_a()
    log.apply(planner.plan(log.view, T0, config, silent={"a": 6.0}))
    assert log.view.state.nodes["a"].lost
    # Heard again, even past the grace: found, and no loss without a grace.
    out = planner.plan(log.view, T0 + timedelta(seconds=31), config, heard=["a"])
    assert [type(o.event) for o in out.outputs] == [ev.NodeFoundEvent]
    log.apply(out)
    assert not log.view.state.nodes["a"].lost
    assert all(r.holds_capacity for r in log.view.replicas.values())
    # A grace of 0 is the old rule: the first node.lost fails them at once.
    now = dataclasses.replace(config, lost_grace_s=0)
    lost = of(planner.plan(log.view, T0, now, silent={"a": 6.0}), ev.NodeLostEvent)[0].event
    assert isinstance(lost, ev.NodeLostEvent) and lost.data.grace_s == 0
