"""The scheduler runs the autoscaler against a real broker: a demand wakes an on-demand
model and its replica is placed; a model nobody uses goes back to zero; a restarted
scheduler publishes nothing twice."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from schemas import events as ev
from services.core import autoscale
from tests.scheduler.conftest import FAST, Cluster
from tests.scheduler.helpers import eventually

pytestmark = pytest.mark.timeout(30)

Scale = ev.ScaleDesiredEvent
Decided = ev.PlacementDecidedEvent


async def _on_demand(cluster: Cluster, idle_after_s: float = 900.0) -> None:
    await cluster.node("gpu-a1")
    await cluster.emit(
        ev.ModelDeclared(
            name="od",
            min=0,
            max=3,
            target_inflight=2,
            idle_after_s=idle_after_s,
            profiles=(ev.ProfileSpec(name="tp1", gpus=1),),
        )
    )


async def _scaled(cluster: Cluster) -> list[ev.ScaleDesiredEvent]:
    return [e for e in await cluster.of(Scale, "od") if isinstance(e, Scale)]


async def test_demand_wakes_a_model_at_zero_and_it_is_placed(
    cluster: Cluster, start_scheduler
) -> None:
    await _on_demand(cluster)
    s = start_scheduler()
    now = datetime.now(UTC)
    await cluster.emit(ev.ModelDemanded(model="od", waiting=5, since=now - timedelta(seconds=1)))
    await eventually(lambda: _count(cluster, Decided, 3), within=10)
    (scale,) = await _scaled(cluster)
    demand = (await cluster.of(ev.ModelDemandedEvent))[0]
    assert scale.data.replicas == 3  # 5 waiting at 2 a replica
    assert scale.data.reason == (
        f"demand: 5 waiting since {autoscale.clock(now - timedelta(seconds=1))}"
    )
    assert scale.causation == demand.id == scale.correlation
    assert scale.source.startswith("scheduler/")
    assert s.scheduler.stats.scaled == 1
    # The same demand, folded again by a restarted scheduler, decides nothing new: it was
    # answered by the scale.
    await s.crash()
    again = start_scheduler(holder="test-again")
    await again.scheduler.follower.caught_up(5)
    await eventually(lambda: again.scheduler.stats.passes > 2, within=10)
    assert len(await _scaled(cluster)) == 1


async def test_a_model_nobody_calls_goes_back_to_zero(cluster: Cluster, start_scheduler) -> None:
    """Short idle time, the scheduler's clock ahead of the broker's: the replica it woke
    is never used, and once idle_after_s has passed the model is scaled to zero and its
    replica drained."""
    await _on_demand(cluster, idle_after_s=30.0)
    clock = {"ahead": 0.0}

    def now() -> datetime:
        return datetime.now(UTC) + timedelta(seconds=clock["ahead"])

    s = start_scheduler(config=dataclasses.replace(FAST))
    s.scheduler.clock = now
    await cluster.emit(ev.ModelDemanded(model="od", waiting=1, since=datetime.now(UTC)))
    await eventually(lambda: _count(cluster, Decided, 1), within=10)
    assert [e.data.replicas for e in await _scaled(cluster)] == [1]
    clock["ahead"] = 31.0
    await eventually(lambda: _count(cluster, ev.ReplicaDrainEvent, 1), within=10)
    scales = await _scaled(cluster)
    assert [(e.data.replicas, e.data.reason) for e in scales][-1] == (0, "idle 30s")
    (drain,) = await cluster.of(ev.ReplicaDrainEvent)
    assert drain.data.reason == "scale_down"


async def test_a_model_in_use_stays(cluster: Cluster, start_scheduler) -> None:
    await _on_demand(cluster, idle_after_s=30.0)
    clock = {"ahead": 0.0}
    s = start_scheduler()
    s.scheduler.clock = lambda: datetime.now(UTC) + timedelta(seconds=clock["ahead"])
    await cluster.emit(ev.ModelDemanded(model="od", waiting=1, since=datetime.now(UTC)))
    await eventually(lambda: _count(cluster, Decided, 1), within=10)
    (placed,) = await cluster.of(Decided)
    # The gateway says, 25 s from now, that it served the replica then: 31 s from now it
    # is 6 s idle. (A use is bounded by its report's time, which the log bounds by when
    # it stored it plus MAX_SKEW.)
    used_at = datetime.now(UTC) + timedelta(seconds=25)
    await cluster.emit(
        ev.ReplicaUsed(replica=placed.data.replica, at=used_at, requests=4),
        node=placed.data.shards[0].node,
        time=used_at,
    )
    await s.scheduler.follower.caught_up(5)
    clock["ahead"] = 31.0
    passes = s.scheduler.stats.passes
    await eventually(lambda: s.scheduler.stats.passes > passes + 3, within=10)
    assert [e.data.replicas for e in await _scaled(cluster)] == [1]


async def test_autoscale_off_leaves_demand_alone(cluster: Cluster, start_scheduler) -> None:
    await _on_demand(cluster)
    s = start_scheduler(config=dataclasses.replace(FAST, autoscale=False))
    await cluster.emit(ev.ModelDemanded(model="od", waiting=5, since=datetime.now(UTC)))
    await s.scheduler.follower.caught_up(5)
    passes = s.scheduler.stats.passes
    await eventually(lambda: s.scheduler.stats.passes > passes + 3, within=10)
    assert await _scaled(cluster) == []


async def _count(cluster: Cluster, kind: type[ev.Envelope], n: int) -> bool:
    return len(await cluster.of(kind)) >= n
