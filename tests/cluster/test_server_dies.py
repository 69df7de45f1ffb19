"""The control plane on a three-server JetStream cluster goes on when a server dies.

`llmgw up --nats u1,u2,u3 --simulate 2x8xH100-80GB` runs as a process, as an operator
runs it, against real nats-servers on loopback. Mid-scale, one server is killed with
kill -9: once the one that leads the log, once the one the projector's log reader is
connected to (the server's own list of connections names it: "llmgw-reader
(projector)"). Each lease is written again after the kill by its holder; the projector's
reader moves to another server and reads on; the scale completes; every acked event is
stored once with no sequence hole; the SQLite view equals an offline replay; and the
killed server, restarted on its store, rejoins and catches up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.bus import Publisher, connect, consume
from services.clock import new_id
from services.core.view import View, digest
from services.plane.follower import ViewFollower
from services.plane.lease import DEFAULT_BUCKET, decode_value
from services.projector import store
from services.replay import rebuild
from services.up import DB_FILE
from tests.bus.cluster import Cluster
from tests.up_process import UpProcess

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


def _known_nodes(follower: ViewFollower, n: int) -> Callable[[], Awaitable[bool]]:
    async def known() -> bool:
        return len(follower.view.state.nodes) >= n

    return known


async def _until(what: str, cond, within: float = 40.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.1)


PROJECTOR = "llmgw-reader (projector)"
LEASES = ("llmgw.scheduler", "llmgw.preemption")


def _server_with(cluster: Cluster, conn_name: str) -> int | None:
    """The index of the live server holding a connection named `conn_name`."""
    for i, b in enumerate(cluster.brokers):
        if b.running and conn_name in _connections(cluster, i):
            return i
    return None


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[tuple[Cluster, Path]]:
    """Three servers and `llmgw up` on them as a process; (the cluster, its data dir)."""
    with Cluster(tmp_path / "nats", 3) as cluster:
        data = tmp_path / "data"
        up = UpProcess(
            data,
            tmp_path / "up.log",
            "--nats", ",".join(cluster.urls), "--simulate", "2x8xH100-80GB", "--no-ui",
            "--tick", "0.2", "--node-timeout", "60", "--drain-grace", "1",
            "--start-delay", "0.05", "--load-delay", "2", "--stop-delay", "0.05",
            "--heartbeat", "1",
        )  # fmt: skip
        try:
            yield cluster, data
            assert up.alive(), up.text()[-3000:]
        finally:
            assert up.stop() == 0, up.text()[-3000:]
        text = up.text()
        assert "Traceback" not in text and "stopped unexpectedly" not in text, text[-3000:]


async def _view_of(db_path: Path) -> View:
    db = await store.open_db(db_path)
    try:
        return await store.load_view(db)
    finally:
        await db.close()


@pytest.mark.parametrize("victim", ["stream leader", "projector's server"])
async def test_the_plane_survives_a_server_killed_mid_scale(
    plane: tuple[Cluster, Path], victim: str
) -> None:
    cluster, data = plane
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
        await _until("two nodes", _known_nodes(follower, 2))
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
            # The server's own word: it holds the projector's reader connection.
            found = _server_with(cluster, PROJECTOR)
            assert found is not None, "no server holds the projector's reader"
            dead = found

        # The leases as they stand before the kill: their holders and revisions.
        kv = await js.key_value(DEFAULT_BUCKET)

        async def leading() -> bool:
            for key in LEASES:
                # Not yet: no such key, or no answer while the bucket's servers elect a
                # leader after the kill (this probe's own request, not the plane's).
                with contextlib.suppress(
                    nats.js.errors.KeyNotFoundError,
                    nats.errors.TimeoutError,
                    nats.js.errors.ServiceUnavailableError,
                ):
                    if (await kv.get(key)).value:
                        continue
                return False
            return True

        await _until("the scheduler and preemption service lead before the kill", leading)
        leases = {}
        for key in LEASES:
            entry = await kv.get(key)
            assert entry.value is not None
            leases[key] = (decode_value(entry.value)[0], entry.revision)
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
            assert entry.value is not None and decode_value(entry.value)[0] == holder, key
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
        db_path = data / DB_FILE

        async def projected() -> bool:
            return (await _view_of(db_path)).seq >= last

        await _until(f"the projector's view at seq {last}", projected, 30)
        if victim == "projector's server":
            # Its reader lost its server and read on from another one.
            async def moved() -> bool:
                at = _server_with(cluster, PROJECTOR)
                return at is not None and at != dead

            await _until("the projector's reader on another server", moved, 30)
        live = await _view_of(db_path)
        replayed = await rebuild.from_stream(js, until_seq=live.seq, use_snapshot=False)
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
