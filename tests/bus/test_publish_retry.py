"""A publish that gets no ack (the broker is away, as during an election) is sent again
with the same message id until the broker answers: it returns once stored, and the
stream holds it once. Without a message id nothing is retried: a retry could store the
event twice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from schemas import codec, subjects
from services.bus import Publisher, PublishError, connect, ensure_streams, publish
from services.bus.broker import EmbeddedBroker
from services.bus.consume import read_range

pytestmark = pytest.mark.timeout(60)


async def test_a_publish_through_an_outage_is_stored_once(
    nats_server: EmbeddedBroker,
    events,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, "llmgw.bus")
    # Short ack waits, so the first tries fail while the broker is away.
    monkeypatch.setattr(publish, "ACK_TIMEOUT_S", 0.5)
    nc = await connect(nats_server.url, "retry", reconnect_wait_s=0.1)
    try:
        js = nc.jetstream(timeout=0.5)
        await ensure_streams(js)
        pub = Publisher(js, retry_s=30)
        first, during, batch = events(1), events(1)[0], events(50)
        await pub.publish(first[0])
        await asyncio.to_thread(nats_server.stop)
        one = asyncio.create_task(pub.publish(during))
        many = asyncio.create_task(pub.publish_many(batch))
        deadline = time.monotonic() + 20
        while sum("retrying with the same id" in r.getMessage() for r in caplog.records) < 2:
            assert time.monotonic() < deadline, "no retry while the broker was away"
            assert not one.done() and not many.done(), "gave up while the broker was away"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(nats_server.start)
        got = await asyncio.wait_for(one, 30)
        acks = await asyncio.wait_for(many, 30)
        assert got.seq >= 2 and len(acks) == 50
        info = await js.stream_info(subjects.STREAM)
        stored = [
            codec.decode(d.data).id async for b in read_range(js, 1, info.state.last_seq) for d in b
        ]
        want = [first[0].id, during.id, *(e.id for e in batch)]
        assert sorted(stored) == sorted(want), "an event lost or stored twice"
    finally:
        await nc.close()


async def test_without_a_message_id_a_publish_is_not_retried(
    nats_server: EmbeddedBroker,
) -> None:
    nc = await connect(nats_server.url, "retry", reconnect_wait_s=0.1)
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        await asyncio.to_thread(nats_server.stop)
        with pytest.raises(PublishError):
            await Publisher(js, retry_s=30).publish_raw(f"{subjects.DEFAULT_ROOT}.catalog.x", b"{}")
    finally:
        # Closing a connection whose server is gone may say so; that is not the test.
        with contextlib.suppress(ConnectionError):
            await nc.close()
