"""Failover in a cluster: `bus.connect` takes every server, and an ordered read whose
server is killed with kill -9 goes on from another one, with no gap and no repeat."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from services.bus import Publisher, connect
from services.bus.consume import Delivery, read_ordered
from services.bus.errors import BrokerUnavailable
from services.bus.stream import ensure_dlq_stream, ensure_stream
from tests.bus.cluster import Cluster

# The cluster may take up to 60 s to elect its meta leader under the suite's load.
pytestmark = pytest.mark.timeout(150)


async def test_a_read_resumes_on_another_server_when_its_own_dies(
    nats_cluster: Cluster, events, either_reader: str, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, "llmgw.bus")
    # dont_randomize: the client, and the wire reader, start on the first server.
    nc = await connect(
        nats_cluster.urls,
        "follower",
        dont_randomize=True,
        wire_reader=either_reader == "wire",
    )
    try:
        assert nc.connected_url is not None
        assert nc.connected_url.port == nats_cluster.brokers[0].port
        js = nc.jetstream()
        # R3: the log survives the loss of any one server.
        await ensure_stream(js, replicas=3)
        await ensure_dlq_stream(js, replicas=3)
        pub = Publisher(js)
        evs = events(3000)
        await pub.publish_many(evs[:2000])
        stop = asyncio.Event()
        got: list[int] = []
        first = asyncio.Event()

        def on_batch(batch: list[Delivery]) -> None:
            got.extend(d.seq for d in batch)
            if got[-1] >= 2000:
                first.set()
            if got[-1] >= 3000:
                stop.set()

        task = asyncio.create_task(read_ordered(js, from_seq=1, on_batch=on_batch, stop=stop))
        await asyncio.wait_for(first.wait(), 20)
        nats_cluster.kill(0)
        deadline = time.monotonic() + 30
        while not (nc.is_connected and nc.connected_url.port != nats_cluster.brokers[0].port):
            assert time.monotonic() < deadline, "the client did not fail over"
            await asyncio.sleep(0.05)
        # Publishing waits out the election of new stream leaders.
        while True:
            try:
                await pub.publish_many(evs[2000:])
                break
            except Exception:
                assert time.monotonic() < deadline, "the cluster did not take publishes again"
                await asyncio.sleep(0.2)
        assert await asyncio.wait_for(task, 30) == 3000
        assert got == list(range(1, 3001))
        if either_reader == "wire":
            dead = nats_cluster.brokers[0].port
            assert any(f":{dead} failed" in r.getMessage() for r in caplog.records)
    finally:
        await nc.close()


async def test_connect_fails_over_to_the_next_url_and_says_where_it_looked(
    nats_cluster: Cluster,
):
    nats_cluster.kill(0)
    nc = await connect(",".join(nats_cluster.urls), "t", dont_randomize=True)
    try:
        assert nc.connected_url is not None
        assert nc.connected_url.port == nats_cluster.brokers[1].port
        assert [p for _, p in nc.target.servers] == [b.port for b in nats_cluster.brokers]
    finally:
        await nc.close()
    dead = nats_cluster.brokers[0].url
    with pytest.raises(BrokerUnavailable, match=dead):
        await connect([dead, dead.replace("nats://", "nats://u:p@")], "t")


def test_the_target_carries_credentials_and_what_the_wire_cannot_speak():
    from services.bus.connection import target_of

    t = target_of(["nats://alice:s%40cret@h1:4333", "h2"])
    assert t.servers == (("h1", 4333), ("h2", 4222))
    assert t.auth() == {"user": "alice", "pass": "s@cret"}
    assert target_of(["nats://tok@h"]).auth() == {"auth_token": "tok"}
    assert target_of(["h"], token="t2").auth() == {"auth_token": "t2"}
    tls = target_of(["tls://h:1"])
    assert tls.tls is not None and tls.unsupported == ""
    assert target_of(["ws://h:1"]).unsupported == "scheme ws"
    assert target_of(["h"], options={"nkeys_seed": "s"}).unsupported == "nkeys_seed"
    assert "SSLContext" in target_of(["h"], options={"tls": object()}).unsupported
    assert target_of(["h"]).unsupported == "" and target_of(["h"]).wire
