"""The README's five-minute tour, as a test, on a real broker with every service running.

A cluster full of opportunistic replicas; a critical model is declared; the preemption
service stops the victims the reference's rules pick (checked against the pure policy
on the view the service decided on), holds their model, the critical model comes up,
the hold is released once it is satisfied, and a replay of the log gives exactly the
view the live projector wrote.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.bus import Publisher, connect
from services.core import policy
from services.core.scheduling import Config as SchedulerConfig
from services.core.view import View, digest
from services.plane.follower import ViewFollower
from services.projector import store
from services.replay import rebuild
from services.up import Running, UpOptions, run

pytestmark = pytest.mark.timeout(90)

POLICY = policy.Config(hold_s=30.0, eviction_grace_s=600.0, min_lifetime_s=0.0, max_victims=3)


@dataclass
class Cluster:
    running: Running
    follower: ViewFollower
    publisher: Publisher
    js: Any
    stop: asyncio.Event
    # nc is the test's own connection, for a test that waits on the broker's coming and going.
    nc: Any = None

    @property
    def view(self) -> View:
        return self.follower.view

    async def publish(self, data: ev.Data) -> int:
        now = datetime.now(UTC)
        from services.clock import new_id

        out = await self.publisher.publish(
            ev.make(data, id=new_id(now), time=now, source="test/operator")
        )
        return out.seq

    async def until(self, what: str, cond: Callable[[View], bool], within: float = 20.0) -> None:
        """Wait for a condition on the live view (polled as the log grows), or fail saying what."""
        deadline = asyncio.get_running_loop().time() + within
        while not cond(self.view):
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"timed out waiting for: {what}")
            await asyncio.sleep(0.02)

    async def events(self, kind: str) -> list[tuple[int, ev.Event]]:
        """Every stored event of one type, with its sequence."""
        from services.bus import consume

        out = []
        async for batch in consume.read_range(self.js, 1, None):
            for d in batch:
                e = codec.decode(d.data)
                if ev.type_of(type(e)) == kind:
                    out.append((d.seq, e))
        return out


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    opts = UpOptions(
        data=tmp_path / "data",
        simulate="2x8xH100-80GB",
        policy=POLICY,
        scheduler=SchedulerConfig(
            tick_s=0.2, failed_backoff_s=2.0, node_timeout_s=30.0, drain_grace_s=1.0
        ),
        start_delay_s=0.02,
        load_delay_s=0.1,
        stop_delay_s=0.05,
        heartbeat_s=0.5,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run(opts, stop, on_ready=ready.set_result))
    running = await asyncio.wait_for(ready, 20)
    nc = await connect(running.url, "tour")
    js = nc.jetstream()
    follower = ViewFollower(js, consumer="tour")
    follower.start()
    try:
        yield Cluster(running, follower, Publisher(js), js, stop, nc)
    finally:
        await follower.stop()
        await nc.close()
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


async def test_the_readme_tour(cluster: Cluster) -> None:
    view = lambda: cluster.view  # noqa: E731
    # 1. Two nodes full of opportunistic replicas: 8 of `batch`, two GPUs each.
    await cluster.publish(
        ev.ModelDeclared(
            name="batch",
            cls="opportunistic",
            min=0,
            max=8,
            profiles=(ev.ProfileSpec(name="tp2", gpus=2),),
        )
    )
    await cluster.publish(ev.ScaleDesired(model="batch", replicas=8))
    await cluster.until(
        "8 batch replicas ready",
        lambda v: sum(1 for r in v.replicas_of("batch") if r.state == "ready") == 8,
    )
    assert view().inventory.free_gpus("sim-0") == [] and view().inventory.free_gpus("sim-1") == []

    # 2. A critical model that needs four GPUs on one node.
    await cluster.publish(
        ev.ModelDeclared(
            name="chat", cls="critical", min=1, profiles=(ev.ProfileSpec(name="tp4", gpus=4),)
        )
    )
    await cluster.until(
        "chat ready", lambda v: any(r.state == "ready" for r in v.replicas_of("chat"))
    )

    # 3. One decision, the one the reference's rules give on the view it was taken on.
    decided = [
        (s, e)
        for s, e in await cluster.events("preemption.decided")
        if e.data.outcome == "preempted"
    ]
    assert len(decided) == 1, decided
    seq, decision = decided[0]
    assert isinstance(decision, ev.PreemptionDecidedEvent)
    victims = [v.replica for v in decision.data.victims]
    at_decision = await rebuild.from_stream(cluster.js, until_seq=seq - 1, use_snapshot=False)
    expected = policy.plan(at_decision.view, "chat", decision.time, POLICY)
    assert expected.outcome == "preempted"
    assert victims == [v.replica for v in expected.victims]
    # Two batch replicas, two GPUs each, on one node: exactly the room tp4 needs.
    assert len(victims) == 2 and {v.model for v in decision.data.victims} == {"batch"}
    assert len({view().replicas[r].shards[0].node for r in victims}) == 1
    assert all(v.tier == 2 for v in decision.data.victims), "lower class above its minimum"

    # Each victim drained once, for chat; its model held.
    drains = [e for _, e in await cluster.events("replica.drain")]
    assert sorted(d.data.replica for d in drains) == sorted(victims)
    assert all(d.data.reason == "preempted" and d.data.for_model == "chat" for d in drains)
    # The chain of causation: placement.failed -> preemption.decided -> replica.drain.
    assert all(d.causation == decision.id for d in drains)
    assert decision.data.trigger == decision.causation
    holds = [e for _, e in await cluster.events("hold.created")]
    assert [(h.data.model, h.data.for_model) for h in holds] == [("batch", "chat")]

    # 4. chat has what it asked for, so the hold ends early: released as satisfied.
    await cluster.until("hold released", lambda v: "batch" not in v.state.holds)
    released = [e for _, e in await cluster.events("hold.released")]
    assert [(r.data.model, r.data.reason) for r in released] == [("batch", "satisfied")]
    await cluster.until(
        "victims stopped", lambda v: all(v.replicas[r].state == "stopped" for r in victims)
    )
    assert view().live_count("chat") == 1 == view().desired_for("chat")

    # 5. The live projector's view and a replay of the log are the same view.
    info = await cluster.js.stream_info(subjects.STREAM)
    last = info.state.last_seq
    projector = cluster.running.projector
    assert projector is not None
    await projector.wait_for(last, timeout=20)
    replayed = await rebuild.from_stream(
        cluster.js, until_seq=projector.committed, use_snapshot=False
    )
    db = await store.open_db(cluster.running.db_path)
    try:
        live = await store.load_view(db)
    finally:
        await db.close()
    assert live.seq == replayed.view.seq
    assert digest(live.state) == digest(replayed.view.state)


async def test_up_joins_an_existing_broker(nats_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    opts = UpOptions(
        data=tmp_path / "data",
        nats_url=nats_server.url,
        simulate="1x8xH100-80GB",
        scheduler=SchedulerConfig(tick_s=0.2),
        start_delay_s=0.01,
        load_delay_s=0.05,
        heartbeat_s=0.5,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run(opts, stop, on_ready=ready.set_result))
    running = await asyncio.wait_for(ready, 20)
    assert running.broker is None and running.url == nats_server.url
    assert not (opts.data / "nats.url").exists(), "a joined broker is not ours to record"
    nc = await connect(nats_server.url, "join")
    follower = ViewFollower(nc.jetstream(), consumer="join")
    follower.start()
    c = Cluster(running, follower, Publisher(nc.jetstream()), nc.jetstream(), stop)
    try:
        await c.publish(
            ev.ModelDeclared(name="m", min=2, profiles=(ev.ProfileSpec(name="tp1", gpus=1),))
        )
        await c.until(
            "2 replicas ready",
            lambda v: sum(1 for r in v.replicas_of("m") if r.state == "ready") == 2,
        )
    finally:
        await follower.stop()
        await nc.close()
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
    assert nats_server.running, "stopping llmgw up leaves a joined broker running"
