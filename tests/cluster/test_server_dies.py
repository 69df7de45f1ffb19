"""The control plane on a three-server JetStream cluster goes on when a server dies.

`llmgw up --nats u1,u2,u3 --simulate 2x8xH100-80GB` is run against real nats-servers on
loopback. Mid-scale, one server is killed with kill -9: once the one that leads the log,
once the one the control plane's own connection (the projector's) is on. The lease is
taken again, the projector reads on, the scale completes; every acked event is stored
once with no sequence hole; the SQLite view equals an offline replay; and the killed
server, restarted on its store, rejoins and catches up.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.bus import Publisher, connect, consume
from services.clock import new_id
from services.core.scheduling import Config as SchedulerConfig
from services.core.view import digest
from services.follower import ViewFollower
from services.projector import store
from services.replay import rebuild
from services.up import Running, UpOptions, run
from tests.bus.cluster import Cluster

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

REPLICAS = 12


def _server_of(cluster: Cluster, name: str) -> int:
    return [b.server_name for b in cluster.brokers].index(name)


def _server_with_connection(cluster: Cluster, conn_name: str) -> int:
    """Which server holds the client connection named `conn_name` (its monitoring port)."""
    for i, b in enumerate(cluster.brokers):
        url = f"http://127.0.0.1:{b.monitor_port}/connz"
        with urllib.request.urlopen(url, timeout=5) as r:
            conns = json.load(r).get("connections") or []
        if any(c.get("name") == conn_name for c in conns):
            return i
    raise AssertionError(f"no server holds a connection named {conn_name!r}")


async def _until(what: str, cond, within: float = 40.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.1)


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[tuple[Cluster, Running]]:
    with Cluster(tmp_path / "nats", 3) as cluster:
        opts = UpOptions(
            data=tmp_path / "data",
            nats_url=",".join(cluster.urls),
            simulate="2x8xH100-80GB",
            scheduler=SchedulerConfig(tick_s=0.2, node_timeout_s=60.0, drain_grace_s=1.0),
            start_delay_s=0.05,
            load_delay_s=2.0,
            stop_delay_s=0.05,
            heartbeat_s=1.0,
        )
        stop = asyncio.Event()
        ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(run(opts, stop, on_ready=ready.set_result))
        try:
            yield cluster, await asyncio.wait_for(ready, 30)
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 40) == 0


@pytest.mark.parametrize("victim", ["stream leader", "projector's server"])
async def test_the_plane_survives_a_server_killed_mid_scale(
    plane: tuple[Cluster, Running], victim: str
) -> None:
    cluster, running = plane
    nc = await connect(cluster.urls, "test operator")
    js = nc.jetstream()
    follower = ViewFollower(js, consumer="cluster-test")
    follower.start()
    pub = Publisher(js)
    acked: dict[str, int] = {}

    async def publish(data: ev.Data) -> None:
        now = datetime.now(UTC)
        e = ev.make(data, id=new_id(now), time=now, source="test/operator")
        acked[e.id] = (await pub.publish(e)).seq

    try:
        info = await js.stream_info(subjects.STREAM)
        assert info.config.num_replicas == 3, "a cluster gets an R3 log by default"
        await publish(
            ev.ModelDeclared(
                name="m", min=0, max=16, profiles=(ev.ProfileSpec(name="tp1", gpus=1),)
            )
        )
        await publish(ev.ScaleDesired(model="m", replicas=REPLICAS))

        def ready() -> int:
            return sum(1 for r in follower.view.replicas_of("m") if r.state == "ready")

        async def placed() -> bool:
            return any(True for _ in follower.view.replicas_of("m"))

        await _until("the first placements", placed)
        assert ready() < REPLICAS, "the scale finished before the kill; slow the agents"
        if victim == "stream leader":
            leader = (await js.stream_info(subjects.STREAM)).cluster
            assert leader is not None and leader.leader is not None
            dead = _server_of(cluster, leader.leader)
        else:
            dead = _server_with_connection(cluster, "llmgw up")
        cluster.kill(dead)

        # The operator's own publish after the kill goes through the election.
        await publish(ev.ScaleDesired(model="m", replicas=REPLICAS + 2))

        async def scaled() -> bool:
            return ready() == REPLICAS + 2

        await _until(f"{REPLICAS + 2} replicas ready after the kill", scaled, 60)

        async def leading() -> bool:
            return running.scheduler.is_leader and running.preemption.is_leader

        await _until("the scheduler and preemption service lead", leading)

        # Every acked event stored, once, with no hole.
        last = (await js.stream_info(subjects.STREAM)).state.last_seq
        seqs: list[int] = []
        ids: list[str] = []
        async for batch in consume.read_range(js, 1, last):
            for d in batch:
                seqs.append(d.seq)
                ids.append(codec.decode(d.data).id)
        assert seqs == list(range(1, last + 1)), "a hole in the log"
        assert len(ids) == len(set(ids)), "an event stored twice"
        stored = dict(zip(ids, seqs, strict=True))
        assert all(stored.get(i) == s for i, s in acked.items()), "an acked event is missing"

        # The projector read on, and its view is what an offline replay gives.
        projector = running.projector
        assert projector is not None
        await projector.wait_for(last, timeout=30)
        replayed = await rebuild.from_stream(js, until_seq=projector.committed, use_snapshot=False)
        db = await store.open_db(running.db_path)
        try:
            live = await store.load_view(db)
        finally:
            await db.close()
        assert live.seq == replayed.view.seq
        assert digest(live.state) == digest(replayed.view.state)

        # The killed server comes back on its store and catches up.
        await asyncio.to_thread(cluster.brokers[dead].start, 30.0)
        name = cluster.brokers[dead].server_name

        async def caught_up() -> bool:
            c = (await js.stream_info(subjects.STREAM)).cluster
            peers = {p.name: p for p in (c.replicas or [])} if c is not None else {}
            p = peers.get(name)
            return c is not None and (
                c.leader == name or (p is not None and bool(p.current) and not p.lag)
            )

        await _until(f"{name} caught up", caught_up, 40)
    finally:
        await follower.stop()
        await nc.close()
