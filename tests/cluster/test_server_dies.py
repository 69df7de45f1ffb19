"""The control plane on a three-server JetStream cluster goes on when a server dies.

`llmgw up --nats u1,u2,u3 --simulate 2x8xH100-80GB` is run against real nats-servers on
loopback. Mid-scale, one server is killed with kill -9: once the one that leads the log,
once the one the projector's log reader is connected to (found on the reader the
projector opened, and checked against the server's own list of connections). Each lease
is written again after the kill by its holder; the projector's reader moves to another
server and reads on; the scale completes; every acked event is stored
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
from typing import Any

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.bus import Publisher, connect, consume, wire
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


def _connections(cluster: Cluster, i: int) -> list[str]:
    """The names of the client connections server `i` holds (its monitoring port)."""
    url = f"http://127.0.0.1:{cluster.brokers[i].monitor_port}/connz?limit=1024"
    with urllib.request.urlopen(url, timeout=5) as r:
        conns = json.load(r).get("connections") or []
    return [str(c.get("name")) for c in conns]


async def _until(what: str, cond, within: float = 40.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.1)


class ProjectorReaders:
    """The ordered readers `llmgw up`'s projector opened, newest last: recorded as
    `consume` makes them inside the task `up` runs the projector in."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.readers: list[Any] = []
        make = consume._reader

        def recording(*args: Any, **kw: Any) -> Any:
            reader = make(*args, **kw)
            task = asyncio.current_task()
            if task is not None and task.get_name() == "projector":
                self.readers.append(reader)
            return reader

        monkeypatch.setattr(consume, "_reader", recording)

    def server(self, cluster: Cluster) -> int:
        """The index in `cluster` of the server the newest reader is connected to."""
        assert self.readers, "the projector opened no reader"
        reader = self.readers[-1]
        assert isinstance(reader, wire.WireOrderedReader), type(reader)
        assert reader._conn is not None, "the projector's reader is not connected"
        _, port = reader.target.servers[reader.server]
        return [b.port for b in cluster.brokers].index(port)


@pytest.fixture
async def plane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Cluster, Running, ProjectorReaders]]:
    readers = ProjectorReaders(monkeypatch)
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
            yield cluster, await asyncio.wait_for(ready, 30), readers
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 40) == 0


@pytest.mark.parametrize("victim", ["stream leader", "projector's server"])
async def test_the_plane_survives_a_server_killed_mid_scale(
    plane: tuple[Cluster, Running, ProjectorReaders], victim: str
) -> None:
    cluster, running, readers = plane
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
            dead = readers.server(cluster)
            # The server's own word: it holds a reader connection.
            assert "llmgw-reader" in _connections(cluster, dead)

        # The leases as they stand before the kill: their holders and revisions.
        async def leading() -> bool:
            return running.scheduler.is_leader and running.preemption.is_leader

        await _until("the scheduler and preemption service lead before the kill", leading)
        kv = await js.key_value(running.scheduler.lease.bucket)
        leases = {
            lease.name: (lease.holder, (await kv.get(lease.name)).revision)
            for lease in (running.scheduler.lease, running.preemption.lease)
        }
        killed_readers = len(readers.readers)
        cluster.kill(dead)

        # The operator's own publish after the kill goes through the election.
        await publish(ev.ScaleDesired(model="m", replicas=REPLICAS + 2))

        async def scaled() -> bool:
            return ready() == REPLICAS + 2

        await _until(f"{REPLICAS + 2} replicas ready after the kill", scaled, 60)
        await _until("the scheduler and preemption service lead", leading)

        # Each lease was written again after the kill (renewed, or taken anew once it
        # lapsed), by its holder, on the servers left.
        for key, (holder, rev) in leases.items():
            entry = await kv.get(key)
            assert entry.value is not None and entry.value.decode() == holder, key
            assert entry.revision is not None and entry.revision > rev, (key, rev, entry)

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
        if victim == "projector's server":
            # Its reader lost its server and read on from another one.
            assert readers.server(cluster) != dead
            assert len(readers.readers) > killed_readers or readers.readers[-1].resets > 0
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
