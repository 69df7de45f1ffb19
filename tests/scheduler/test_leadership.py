"""Two schedulers at once: one placement per missing replica; a dead leader's standby
takes over within the lease TTL and places only what is missing; a deposed leader
publishes nothing more."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from schemas import events as ev
from services.bus import Publisher
from services.core import fold
from services.core import scheduling as planner
from services.core.view import View
from tests.scheduler.conftest import FAST, Cluster, Running
from tests.scheduler.helpers import eventually

pytestmark = pytest.mark.timeout(30)

Decided = ev.PlacementDecidedEvent
TTL = FAST.lease_ttl_s


async def decided(cluster: Cluster, model: str | None = None) -> list[ev.Event]:
    return await cluster.of(Decided, model)


async def n_decided(cluster: Cluster, n: int) -> bool:
    return len(await decided(cluster)) >= n


async def two(start_scheduler) -> tuple[Running, Running]:  # type: ignore[no-untyped-def]
    """Two schedulers; the first leads once both run."""
    a = start_scheduler(holder="a")
    await eventually(lambda: a.scheduler.is_leader)
    b = start_scheduler(holder="b")
    await eventually(lambda: b.scheduler.follower.seq >= a.scheduler.follower.seq)
    assert not b.scheduler.is_leader
    return a, b


async def test_two_schedulers_one_placement_per_missing_replica(
    cluster: Cluster, start_scheduler
) -> None:
    for n in ("gpu-a1", "gpu-a2", "gpu-a3"):
        await cluster.node(n)
    a, b = await two(start_scheduler)
    await cluster.declare("m", gpus=2, min=3, max=8)
    await eventually(lambda: n_decided(cluster, 3))
    await cluster.scale("m", 7)
    await eventually(lambda: n_decided(cluster, 7))
    # Both settle on the same view; neither places more.
    for r in (a, b):
        await r.scheduler.follower.caught_up(5)
    passes = a.scheduler.stats.passes
    await eventually(lambda: a.scheduler.stats.passes >= passes + 5)
    got = await decided(cluster, "m")
    assert len(got) == 7
    assert len({d.data.replica for d in got}) == 7
    assert b.scheduler.stats.published == 0
    assert a.scheduler.view.live_count("m") == b.scheduler.view.live_count("m") == 7


async def test_same_view_same_ids_so_the_stream_keeps_one(cluster: Cluster) -> None:
    """Two schedulers that both decide on one view (a lease handover at just the wrong
    moment) publish the same ids, and JetStream stores each decision once."""
    await cluster.node("gpu-a1")
    await cluster.declare("m", gpus=2, min=3)
    view = View()
    for seq, subject, e in await cluster.events():
        fold.apply(view, e, seq=seq, subject=subject)
    now = datetime.now(UTC)
    one = planner.plan(view, now, FAST, source="scheduler/a")
    other = planner.plan(view, now, FAST, source="scheduler/b")
    assert [o.event.id for o in one.outputs] == [o.event.id for o in other.outputs]
    assert one.placed == 3
    pub = Publisher(cluster.js)
    for out in (one, other):
        for o in out.outputs:
            await pub.publish(o.event, node=o.node)
    assert len(await decided(cluster)) == 3
    assert len(await cluster.of(ev.ReplicaStartEvent)) == 3


@pytest.mark.parametrize("how", ["crash", "clean stop"])
async def test_standby_takes_over_and_places_only_what_is_missing(
    cluster: Cluster, start_scheduler, how: str
) -> None:
    for n in ("gpu-a1", "gpu-a2"):
        await cluster.node(n)
    a, b = await two(start_scheduler)
    await cluster.declare("m", gpus=2, min=2, max=8)
    await eventually(lambda: n_decided(cluster, 2))
    if how == "crash":
        await a.crash()  # no release: the entry must expire on the server
    else:
        await a.stop_clean()  # releases the lease
    killed = time.monotonic()
    await cluster.scale("m", 5)
    await eventually(lambda: b.scheduler.is_leader, within=TTL + 3)
    took = time.monotonic() - killed
    await eventually(lambda: n_decided(cluster, 5), within=5)
    await b.scheduler.follower.caught_up(5)
    passes = b.scheduler.stats.passes
    await eventually(lambda: b.scheduler.stats.passes >= passes + 5)
    got = await decided(cluster)
    assert len(got) == 5, "the new leader placed again what the old one had placed"
    assert sum(d.source == "scheduler/b" for d in got) == 3
    assert b.scheduler.view.live_count("m") == 5
    if how == "crash":
        assert took <= TTL + 1.0
    else:
        assert took < TTL  # a release hands over on the standby's next attempt


async def test_deposed_leader_publishes_nothing_more(
    cluster: Cluster, start_scheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    for n in ("gpu-a1", "gpu-a2"):
        await cluster.node(n)
    a, b = await two(start_scheduler)
    await cluster.declare("m", gpus=2, min=1, max=8)
    await eventually(lambda: n_decided(cluster, 1))

    # A partition between a and the lease bucket: a keeps running, following the log and
    # waking for every event, but its renewals never reach the server.
    async def cut_off() -> bool:
        return a.scheduler.lease.is_leader

    monkeypatch.setattr(a.scheduler.lease, "acquire", cut_off)
    cut = time.monotonic()
    await eventually(lambda: not a.scheduler.is_leader, within=TTL + 1)
    believed = time.monotonic() - cut
    published_by_a = a.scheduler.stats.published
    await eventually(lambda: b.scheduler.is_leader, within=TTL + 3)
    # a stopped believing before b could take over.
    assert believed < time.monotonic() - cut
    await cluster.scale("m", 4)
    await eventually(lambda: n_decided(cluster, 4))
    await a.scheduler.follower.caught_up(5)
    passes = a.scheduler.stats.passes
    await eventually(lambda: a.scheduler.follower.seq >= b.scheduler.leader.own_last())
    assert a.scheduler.stats.published == published_by_a
    assert a.scheduler.stats.passes == passes  # it does not even run a pass
    got = await decided(cluster)
    assert [d.source for d in got] == ["scheduler/a"] + ["scheduler/b"] * 3
