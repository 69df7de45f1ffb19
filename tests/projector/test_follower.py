"""ViewFollower against a real broker: it keeps up, waits, dead-letters, heals gaps."""

from __future__ import annotations

import pytest
from nats.js.client import JetStreamContext

from services.bus import EmbeddedBroker, Publisher, snapshots
from services.bus.connection import connect
from services.bus.stream import ensure_streams
from services.core.ingest import Ingest
from services.core.view import View, digest
from services.plane.follower import ViewFollower
from tests.projector import mix

pytestmark = pytest.mark.timeout(60)


def fold_items(items: list[mix.Item]) -> View:
    f = Ingest()
    for seq, (subject, body, _) in enumerate(items, start=1):
        f.raw(seq, subject, body)
    return f.view


async def test_follower_keeps_up_and_waits(js: JetStreamContext) -> None:
    items = mix.items(7, 3000, nodes=20, bad=True)
    pub = Publisher(js)
    await pub.publish_many(items[:1000])
    seen: list[int] = []
    f = ViewFollower(js, on_change=lambda seq, e, r: seen.append(seq))
    f.start()
    try:
        await f.wait_for(1000, timeout=20)
        acks = await pub.publish_many(items[1000:])
        await f.wait_for(acks[-1].seq, timeout=20)
        assert f.seq == 3000
        assert digest(f.view.state) == digest(fold_items(items).state)
        assert f.dead > 0
        assert seen == sorted(seen) and len(seen) == 3000 - f.dead
        with pytest.raises(TimeoutError):
            await f.wait_for(3001, timeout=0.2)
    finally:
        await f.stop()


async def test_follower_starts_from_a_snapshot(js: JetStreamContext) -> None:
    items = mix.items(8, 2000, nodes=20)
    await Publisher(js).publish_many(items)
    half = fold_items(items[:1200])
    await snapshots.save(js, half.state)
    f = ViewFollower(js)
    assert await f.load_snapshot()
    assert f.seq == 1200
    f.start()
    try:
        await f.caught_up(timeout=20)
        assert digest(f.view.state) == digest(fold_items(items).state)
    finally:
        await f.stop()


async def test_follower_heals_an_injected_gap(js: JetStreamContext) -> None:
    items = mix.items(9, 1500, nodes=20)
    await Publisher(js).publish_many(items)
    f = ViewFollower(js)
    original = f._on_batch
    dropped = False

    async def lossy(batch):  # type: ignore[no-untyped-def]
        nonlocal dropped
        if not dropped and len(batch) > 3:
            dropped = True
            batch = batch[:2] + batch[3:]
        await original(batch)

    f._on_batch = lossy  # type: ignore[method-assign]
    f.start()
    try:
        await f.caught_up(timeout=20)
        assert dropped and f.gaps >= 1
        assert digest(f.view.state) == digest(fold_items(items).state)
    finally:
        await f.stop()


async def test_a_snapshot_that_cannot_be_read_is_said_and_the_log_read_instead(
    nats_server: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower started while its broker restarts (what `up` met right after a kill -9
    of its broker) reads the log from the view's position; the snapshot's timeout once
    stopped the gateway, and `up` with it."""
    nc = await connect(nats_server.url, "test")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        items = mix.items(9, 200, nodes=5)
        await Publisher(js).publish_many(items)
        nats_server.kill()
        f = ViewFollower(js)
        assert not await f.load_snapshot()
        (line,) = [r.getMessage() for r in caplog.records if "no snapshot read" in r.getMessage()]
        assert "reading the log from seq 1" in line, line
        nats_server.start()
        f.start()
        try:
            await f.caught_up(timeout=20)
            assert digest(f.view.state) == digest(fold_items(items).state)
        finally:
            await f.stop()
    finally:
        await nc.close()
