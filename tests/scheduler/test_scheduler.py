"""The scheduler against a real broker, driven by publishing events and read back from
the stream: placement, scale, no fit, quota, holds, lost nodes, removed models,
placement timeouts."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from datetime import timedelta

import pytest

from schemas import events as ev
from services.bus import EmbeddedBroker
from tests.scheduler.conftest import FAST, Cluster, Running
from tests.scheduler.helpers import Clock, eventually

pytestmark = pytest.mark.timeout(30)

Decided = ev.PlacementDecidedEvent
Failed = ev.PlacementFailedEvent
Start = ev.ReplicaStartEvent
Drain = ev.ReplicaDrainEvent


async def count(cluster: Cluster, kind: type[ev.Envelope], model: str | None = None) -> int:
    return len(await cluster.of(kind, model))


async def settle(s: Running) -> None:
    """Wait until the scheduler's view holds everything in the stream and its own last
    publish (so "nothing more happened" is checked on a settled scheduler)."""
    await s.scheduler.follower.caught_up(5)
    await eventually(lambda: s.scheduler.follower.seq >= s.scheduler.leader.own_last())


async def test_places_min_replicas_on_declare(cluster: Cluster, start_scheduler) -> None:
    await cluster.node("gpu-a1")
    await cluster.node("gpu-a2")
    s = start_scheduler()
    await cluster.declare("meta/llama-3.1-8b", gpus=4, min=2, max=4)
    await eventually(lambda: count(cluster, Decided, "meta/llama-3.1-8b"), within=5)
    await eventually(lambda: _at_least(cluster, Decided, 2, "meta/llama-3.1-8b"), within=5)
    decided = await cluster.of(Decided)
    starts = await cluster.with_subjects(Start)
    assert len(decided) == 2
    assert {d.data.replica for d in decided} == {e.data.replica for _, e in starts}
    for subject, e in starts:
        (shard,) = e.data.shards
        assert subject == f"llmgw.cmd.{shard.node}.replica.start"
        assert e.causation in {d.id for d in decided}
    for d in decided:
        assert d.data.replica.startswith("meta-llama-3-1-8b-")
        assert d.data.reason.startswith("best fit: tp4 on gpu-a")
    # Best fit: both on one node, the other stays whole.
    assert {d.data.shards[0].node for d in decided} == {"gpu-a1"}
    await settle(s)
    assert s.scheduler.view.live_count("meta/llama-3.1-8b") == 2
    assert await count(cluster, Decided) == 2


async def _at_least(
    cluster: Cluster, kind: type[ev.Envelope], n: int, model: str | None = None
) -> bool:
    return await count(cluster, kind, model) >= n


async def test_scale_up_then_down_drains_newest(cluster: Cluster, start_scheduler) -> None:
    await cluster.node("gpu-a1")
    await cluster.node("gpu-a2")
    s = start_scheduler()
    await cluster.declare("m", gpus=2, min=1, max=4)
    await eventually(lambda: _at_least(cluster, Decided, 1))
    await settle(s)
    await cluster.scale("m", 3)
    await eventually(lambda: _at_least(cluster, Decided, 3))
    await settle(s)
    _first, *later = await cluster.of(Decided)
    await cluster.scale("m", 1)
    await eventually(lambda: _at_least(cluster, Drain, 2))
    await settle(s)
    drains = await cluster.with_subjects(Drain)
    assert len(drains) == 2
    assert all(e.data.reason == "scale_down" for _, e in drains)
    assert {e.data.replica for _, e in drains} == {d.data.replica for d in later}
    by_replica = {d.data.replica: d.data.shards[0].node for d in later}
    for subject, e in drains:
        assert subject == f"llmgw.cmd.{by_replica[e.data.replica]}.replica.drain"
    assert s.scheduler.view.live_count("m") == 1
    assert await count(cluster, Decided) == 3


async def test_no_fit_reports_once_until_something_changes(
    cluster: Cluster, start_scheduler
) -> None:
    await cluster.node("gpu-a1", gpus=4)
    s = start_scheduler()
    await cluster.declare("big", gpus=8, min=1)
    await eventually(lambda: _at_least(cluster, Failed, 1))
    # Many passes (tick 0.1 s, plus one per event below), one report.
    for _ in range(5):
        await cluster.scale("other", 1)  # an event that wakes a pass, changes nothing
    await eventually(lambda: s.scheduler.stats.passes >= 15, within=5)
    await settle(s)
    (f,) = await cluster.of(Failed)
    assert f.data.reason == "no_fit"
    assert f.data.profiles == ("tp8",)
    assert f.data.live == 0 and f.data.desired == 1
    assert "tp8" in f.data.why and "best had 4" in f.data.why["tp8"]
    # The cluster changes (a node appears that still does not fit): a new report.
    await cluster.node("gpu-a2", gpus=4)
    await eventually(lambda: _at_least(cluster, Failed, 2))
    await settle(s)
    assert await count(cluster, Failed) == 2
    # A node that fits: placed.
    await cluster.node("gpu-a3", gpus=8)
    await eventually(lambda: _at_least(cluster, Decided, 1))
    (d,) = await cluster.of(Decided)
    assert d.data.shards[0].node == "gpu-a3"


async def test_no_fit_repeats_after_the_backoff(cluster: Cluster, start_scheduler) -> None:
    await cluster.node("gpu-a1", gpus=4)
    clock = Clock()
    s = start_scheduler(dataclasses.replace(FAST, failed_backoff_s=0.5), clock=clock)
    await cluster.declare("big", gpus=8, min=1)
    await eventually(lambda: _at_least(cluster, Failed, 1))
    passes = s.scheduler.stats.passes
    await eventually(lambda: s.scheduler.stats.passes >= passes + 3)  # within the backoff
    await settle(s)
    assert await count(cluster, Failed) == 1
    clock.advance(0.5)
    await eventually(lambda: _at_least(cluster, Failed, 2))
    first, second = await cluster.of(Failed)
    assert (second.time - first.time).total_seconds() == pytest.approx(0.5)


async def test_quota_limit(cluster: Cluster, start_scheduler) -> None:
    await cluster.node("gpu-a1")
    await cluster.emit(
        ev.QuotaSet(
            owners=(ev.OwnerQuota(name="team-a", limit=ev.Resources(gpus=4)),),
        )
    )
    start_scheduler()
    await cluster.declare("m", gpus=4, min=2, owner="team-a")
    await eventually(lambda: _at_least(cluster, Failed, 1))
    assert await count(cluster, Decided) == 1
    (f,) = await cluster.of(Failed)
    assert f.data.reason == "quota_limit"
    assert f.data.live == 1 and f.data.desired == 2
    assert "team-a" in f.data.why["tp4"]


async def test_held_model_is_not_placed(cluster: Cluster, start_scheduler) -> None:
    await cluster.node("gpu-a1")
    # The model the hold is for wants a GPU nobody has, so the hold does not end early.
    await cluster.declare(
        "critical-m",
        cls="critical",
        profiles=(ev.ProfileSpec(name="b200", gpus=8, gpu_model="B200"),),
    )
    clock = Clock()
    until = clock.wall() + timedelta(seconds=1.5)
    await cluster.emit(ev.HoldCreated(model="opp", for_model="critical-m", until=until))
    s = start_scheduler(clock=clock)
    await cluster.declare("opp", gpus=4, min=1, cls="opportunistic")
    await eventually(lambda: s.scheduler.stats.passes >= 5)
    await settle(s)
    assert await count(cluster, Decided) == 0
    assert await count(cluster, Failed, "opp") == 0
    assert await count(cluster, Failed, "critical-m") == 1
    # The hold ends past its `until` (at it exactly, it is still on): then it is placed,
    # with no event to wake it (the tick).
    for step in (1.4, 0.1):
        clock.advance(step)
        passes = s.scheduler.stats.passes
        await eventually(lambda: s.scheduler.stats.passes >= passes + 3)  # noqa: B023
        await settle(s)
        assert await count(cluster, Decided) == 0
    assert clock.wall() == until
    clock.advance(0.1)
    await eventually(lambda: _at_least(cluster, Decided, 1))
    (d,) = await cluster.of(Decided)
    assert d.data.model == "opp"
    assert d.time == until + timedelta(seconds=0.1)


# QUIET_S: the quiet after taking the lead (one heartbeat period), when no node is
# timed; SILENT_S: past the node timeout (0.6 s), how long a node says nothing to be lost.
QUIET_S = 1.0
SILENT_S = 0.7


async def _one_replica_a_node(
    cluster: Cluster, start_scheduler: Callable[..., Running], lost_grace_s: float
) -> tuple[Running, Clock, list[str]]:
    """gpu-a1 and gpu-a2 (8 GPUs each) with a replica of m on each, under a scheduler that
    loses a node silent for 0.6 s, with `lost_grace_s`, on a clock the test moves: the
    scheduler, its clock, and the replicas on gpu-a2.

    Its passes run when an event wakes one (`_pass`), never on a tick: between moving
    the clock and hearing a node's heartbeat at the new time, no pass may look."""
    await cluster.node("gpu-a1")
    await cluster.node("gpu-a2")
    clock = Clock()
    config = dataclasses.replace(FAST, tick_s=3600.0, node_timeout_s=0.6, lost_grace_s=lost_grace_s)
    s = start_scheduler(config, clock=clock)
    await cluster.declare("m", gpus=8, min=2)
    await eventually(lambda: _at_least(cluster, Decided, 2))
    on_a2 = [d.data.replica for d in await cluster.of(Decided) if d.data.shards[0].node == "gpu-a2"]
    # The quiet over, a pass starts timing both nodes from now.
    clock.advance(QUIET_S)
    await _beat(cluster, s, clock, "gpu-a1")
    await _pass(cluster, s)
    assert await count(cluster, ev.NodeLostEvent) == 0
    return s, clock, on_a2


async def _beat(cluster: Cluster, s: Running, clock: Clock, *nodes: str) -> None:
    """One heartbeat of each of `nodes`, once the scheduler has heard it at the clock's
    time now."""
    for node in nodes:
        await cluster.heartbeat(node)
    at = clock.monotonic()
    await eventually(lambda: all(s.scheduler._heard.get(n) == at for n in nodes))


async def _pass(cluster: Cluster, s: Running, within: float = 5.0) -> None:
    """One more pass at the clock's time now, and what it published folded: an event that
    changes nothing (a scale of a model nobody declared) wakes it."""
    passes = s.scheduler.stats.passes
    await cluster.scale("nobody", 1)
    await eventually(lambda: s.scheduler.stats.passes > passes, within=within)
    await settle(s)


async def test_node_lost_after_missed_heartbeats(cluster: Cluster, start_scheduler) -> None:
    s, clock, on_a2 = await _one_replica_a_node(cluster, start_scheduler, lost_grace_s=0.5)
    # gpu-a2 is silent; gpu-a1 beats at every moment the clock is moved to. Lost with a
    # grace, then, the grace passed and the node still silent, lost for good: two
    # node.lost, and no more after more passes.
    clock.advance(SILENT_S)
    await _beat(cluster, s, clock, "gpu-a1")
    await _pass(cluster, s)
    assert await count(cluster, ev.NodeLostEvent) == 1
    clock.advance(0.4)  # within the grace: nothing more
    await _beat(cluster, s, clock, "gpu-a1")
    await _pass(cluster, s)
    assert await count(cluster, ev.NodeLostEvent) == 1
    clock.advance(0.2)
    await _beat(cluster, s, clock, "gpu-a1")
    await _pass(cluster, s)
    for _ in range(5):
        await _pass(cluster, s)
    first, second = await cluster.of(ev.NodeLostEvent)
    assert first.data.node == second.data.node == "gpu-a2"
    assert first.data.reason.startswith("no heartbeat for ")
    assert first.data.grace_s == 0.5
    assert second.data.grace_s == 0
    assert second.data.reason.startswith("not heard from within the grace")
    # The replicas kept their state through the grace, and failed only at the second.
    assert (second.time - first.time).total_seconds() == pytest.approx(0.6)
    view = s.scheduler.view
    assert view.state.nodes["gpu-a2"].lost
    assert view.state.nodes["gpu-a2"].failing_at is None
    assert all(view.replicas[r].state == "failed" for r in on_a2)
    # Its replica's capacity was released; gpu-a1 is full, so the replacement cannot fit.
    await eventually(lambda: _at_least(cluster, Failed, 1))


async def test_a_lost_node_heard_again_is_found_with_its_replicas(
    cluster: Cluster, start_scheduler
) -> None:
    """Its agent never reconnected (nor sent a report): a heartbeat after the node.lost
    is what brings it back, within the grace, its replicas as they were."""
    s, clock, on_a2 = await _one_replica_a_node(cluster, start_scheduler, lost_grace_s=60.0)
    clock.advance(SILENT_S)
    await _beat(cluster, s, clock, "gpu-a1")
    await _pass(cluster, s)
    assert await count(cluster, ev.NodeLostEvent) == 1
    assert s.scheduler.view.state.nodes["gpu-a2"].lost
    assert all(s.scheduler.view.replicas[r].state != "failed" for r in on_a2)
    # A heartbeat no later than the loss was seen brings nothing back; one after it does.
    await _beat(cluster, s, clock, "gpu-a1", "gpu-a2")
    await _pass(cluster, s)
    assert await count(cluster, ev.NodeFoundEvent) == 0
    clock.advance(0.1)
    await _beat(cluster, s, clock, "gpu-a1", "gpu-a2")
    await _pass(cluster, s)
    assert await count(cluster, ev.NodeFoundEvent) == 1
    view = s.scheduler.view
    rec = view.state.nodes["gpu-a2"]
    assert not rec.lost and rec.failing_at is None
    assert all(view.replicas[r].state != "failed" for r in on_a2)
    assert len(await cluster.of(ev.NodeLostEvent)) == 1


async def test_a_broker_outage_past_the_node_timeout_loses_no_node(
    cluster: Cluster, start_scheduler, nats_server: EmbeddedBroker
) -> None:
    """Cut off from the broker, the scheduler hears no heartbeat: that is its own deafness,
    not the nodes' silence. Back, it gives the agents a heartbeat period to be heard again
    before it times any node; one that stays silent past that is lost as ever."""
    s, clock, _ = await _one_replica_a_node(cluster, start_scheduler, lost_grace_s=60.0)
    await asyncio.to_thread(nats_server.kill)
    await eventually(lambda: not s.scheduler.nc.is_connected)
    clock.advance(4 * SILENT_S)  # the outage, well past the node timeout
    await asyncio.to_thread(nats_server.start)
    await eventually(lambda: s.scheduler.nc.is_connected, within=10)
    # The first pass back, before any agent is heard again: no node is lost.
    await _pass(cluster, s, within=10)
    assert await count(cluster, ev.NodeLostEvent) == 0
    # Both heard again within the heartbeat period: none is lost once it is over.
    for _ in range(2):
        clock.advance(QUIET_S / 2)
        await _beat(cluster, s, clock, "gpu-a1", "gpu-a2")
        await _pass(cluster, s)
    assert await count(cluster, ev.NodeLostEvent) == 0
    # gpu-a2 silent from then on: lost past the node timeout.
    clock.advance(SILENT_S)
    await _beat(cluster, s, clock, "gpu-a1")
    await _pass(cluster, s)
    (lost,) = await cluster.of(ev.NodeLostEvent)
    assert lost.data.node == "gpu-a2"


async def test_model_removed_drains_it(cluster: Cluster, start_scheduler) -> None:
    await cluster.node("gpu-a1")
    s = start_scheduler()
    await cluster.declare("m", gpus=2, min=2)
    await eventually(lambda: _at_least(cluster, Decided, 2))
    await settle(s)
    await cluster.emit(ev.ModelRemoved(name="m"))
    await eventually(lambda: _at_least(cluster, Drain, 2))
    await settle(s)
    drains = await cluster.of(Drain)
    assert len(drains) == 2
    assert {e.data.reason for e in drains} == {"model_removed"}
    assert await count(cluster, Decided) == 2


async def test_placement_timeout_is_drained_and_placed_elsewhere(
    cluster: Cluster, start_scheduler
) -> None:
    await cluster.node("gpu-a1", gpus=8)
    await cluster.node("gpu-a2", gpus=4)
    clock = Clock()
    s = start_scheduler(dataclasses.replace(FAST, start_timeout_s=0.5), clock=clock)
    await cluster.declare("m", gpus=4, min=1)
    await eventually(lambda: _at_least(cluster, Decided, 1))
    (first,) = await cluster.of(Decided)
    assert first.data.shards[0].node == "gpu-a2"  # best fit
    # Nobody reports `starting`: after the timeout, drained and placed on the other node.
    passes = s.scheduler.stats.passes
    await eventually(lambda: s.scheduler.stats.passes >= passes + 3)  # within the timeout
    await settle(s)
    assert await count(cluster, Drain) == 0
    clock.advance(0.5)
    await eventually(lambda: _at_least(cluster, Decided, 2))
    await settle(s)
    drains = await cluster.of(Drain)
    assert [(e.data.replica, e.data.reason) for e in drains] == [
        (first.data.replica, "placement_timeout")
    ]
    second = (await cluster.of(Decided))[1]
    assert second.data.shards[0].node == "gpu-a1"
    assert "avoiding gpu-a2" in second.data.reason
    # This one reports back in time: no more drains.
    start = next(e for e in await cluster.of(Start) if e.data.replica == second.data.replica)
    await cluster.state(start.data, "starting")
    await settle(s)
    clock.advance(0.6)  # past its timeout
    passes = s.scheduler.stats.passes
    await eventually(lambda: s.scheduler.stats.passes >= passes + 3)
    await settle(s)
    assert await count(cluster, Drain) == 1
    assert s.scheduler.view.live_count("m") == 1
