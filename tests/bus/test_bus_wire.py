"""The wire reader of an ordered consumer: its parser, flow control and heartbeats
answered, a consumer-sequence gap recreating the consumer, a stream gap reported; and,
for both readers (`either_reader`), a filter, a broker restart and a stop while it is
down."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import codec, subjects
from schemas import events as ev
from services.bus import (
    EmbeddedBroker,
    Publisher,
    connect,
    consume,
    ensure_streams,
    free_port,
    ordered,
    wire,
)
from services.bus.connection import JetStream
from services.bus.consume import Delivery, read_ordered, read_range
from services.bus.errors import SequenceGap


def _reader(js, **kw) -> wire.WireOrderedReader:
    args = _kw(batch_max=100, idle_heartbeat_s=consume.IDLE_HEARTBEAT_S)
    args.update(kw)
    return wire.WireOrderedReader(js, js.target, **args)  # type: ignore[arg-type]


def _kw(**kw):
    args = dict(
        from_seq=1,
        filter_subject=None,
        stream=subjects.STREAM,
        until_seq=None,
        to_end=False,
        stop=None,
        batch_max=10,
    )
    args.update(kw)
    return args


async def test_the_default_reader_is_the_wire_reader_and_the_flag_turns_it_off(
    js, js_broker, monkeypatch
):
    kw = _kw(to_end=True)
    assert isinstance(consume._reader(js, **kw), wire.WireOrderedReader)
    # The variable of the rounds before turns nothing off: only the connection's setting
    # (`--no-wire-reader`) does.
    monkeypatch.setenv("LLMGW_BUS_WIRE", "0")
    assert isinstance(consume._reader(js, **kw), wire.WireOrderedReader)
    off = await connect(js_broker.url, "plain", wire_reader=False)
    try:
        assert isinstance(consume._reader(off.jetstream(), **kw), ordered.NatsOrderedReader)
    finally:
        await off.close()


def test_what_the_wire_does_not_speak_reads_through_nats_py(js, nc):
    kw = _kw(to_end=True)
    tls = JetStream(nc, dataclasses.replace(js.target, unsupported="nkeys_seed"))
    assert isinstance(consume._reader(tls, **kw), ordered.NatsOrderedReader)
    plain = JetStreamContext(nc)  # not made by bus.connect: nobody said where to connect
    assert isinstance(consume._reader(plain, **kw), ordered.NatsOrderedReader)


def test_the_api_prefix_comes_from_the_context(nc):
    assert nc.jetstream().target.api_prefix == "$JS.API"
    assert nc.jetstream(domain="hub").target.api_prefix == "$JS.hub.API"
    assert nc.jetstream(prefix="$X.API").target.api_prefix == "$X.API"


class _Sink:
    """A connection that only records what would have been written."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def publish(self, subject: bytes, payload: bytes = b"") -> None:
        self.sent.append(subject)


def _frame(sseq: int, dseq: int, sid: bytes = b"2", hdr: bytes | None = None) -> wire.Frame:
    reply = f"$JS.ACK.LLMGW.c.1.{sseq}.{dseq}.0.{100 - sseq}".encode()
    return (sid, b"llmgw.view.digest", reply, hdr, b"{}")


def test_the_parser_splits_frames_across_reads():
    async def go() -> list[wire.Frame]:
        conn = wire.WireConnection("t")
        hmsg = b"HMSG a.b 2 r.1 23 25\r\nNATS/1.0\r\nK: v\r\nX:y\r\n\r\nhi\r\n"
        stream = b"MSG x.y 2 r.2 5\r\nhello\r\n" + hmsg + b"MSG z 2 0\r\n\r\n"
        for i in range(0, len(stream), 7):  # chopped into odd pieces
            conn.data_received(stream[i : i + 7])
        return conn.frames

    frames = asyncio.run(go())
    assert frames[0] == (b"2", b"x.y", b"r.2", None, b"hello")
    assert frames[1][:3] == (b"2", b"a.b", b"r.1") and frames[1][4] == b"hi"
    assert wire.parse_headers(frames[1][3]) == {"K": "v", "X": "y"}  # type: ignore[arg-type]
    assert frames[2] == (b"2", b"z", b"", None, b"")


def test_flow_control_and_stalled_heartbeats_are_answered(js):
    r = _reader(js)
    r._sid = b"2"
    sink = _Sink()
    fc = b"NATS/1.0 100 FlowControl Request\r\n\r\n"
    hb = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 2\r\nNats-Consumer-Stalled: $JS.FC.x\r\n\r\n"
    frames = [
        _frame(1, 1),
        (b"2", b"_INBOX.d", b"$JS.FC.LLMGW.c.1", fc, b""),
        _frame(2, 2),
        (b"2", b"_INBOX.d", b"", hb, b""),
        _frame(3, 3),
    ]
    out, why = r._take(frames, sink)  # type: ignore[arg-type]
    assert [d.seq for d in out] == [1, 2, 3] and why == ""
    assert sink.sent == [b"$JS.FC.LLMGW.c.1", b"$JS.FC.x"]


def test_a_consumer_gap_stops_before_it_and_asks_for_a_new_consumer(js):
    r = _reader(js, filter_subject="llmgw.>")
    r._sid = b"2"
    out, why = r._take([_frame(1, 1), _frame(5, 2), _frame(9, 4), _frame(10, 5)], _Sink())  # type: ignore[arg-type]
    assert [d.seq for d in out] == [1, 5] and "consumer sequence gap: expected 3, got 4" in why
    assert r.last_seq == 5  # the new consumer starts at 6: nothing past the gap is folded


def test_a_heartbeat_reporting_lost_messages_asks_for_a_new_consumer(js):
    r = _reader(js)
    r._sid = b"2"
    hb = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 3\r\n\r\n"
    out, why = r._take([_frame(1, 1), (b"2", b"_INBOX.d", b"", hb, b"")], _Sink())  # type: ignore[arg-type]
    assert [d.seq for d in out] == [1] and "heartbeat" in why


def test_a_stream_gap_without_a_filter_is_reported(js):
    r = _reader(js)
    r._sid = b"2"
    with pytest.raises(SequenceGap) as e:
        r._take([_frame(1, 1), _frame(2, 2), _frame(4, 3)], _Sink())  # type: ignore[arg-type]
    assert (e.value.expected, e.value.got) == (3, 4)


def test_frames_of_a_consumer_left_behind_are_ignored(js):
    r = _reader(js)
    r._sid = b"3"
    out, why = r._take([_frame(1, 1, sid=b"2"), _frame(1, 1, sid=b"3")], _Sink())  # type: ignore[arg-type]
    assert [d.seq for d in out] == [1] and why == ""


async def test_flow_control_under_a_slow_fold_loses_nothing(js, events):
    """Enough data that the server asks for flow control many times while the fold sleeps."""
    evs = events(20000, "mixed")
    await Publisher(js).publish_many(evs)
    r = _reader(js, to_end=True, batch_max=5000)
    seen: list[Delivery] = []
    async for batch in r.batches():
        seen.extend(batch)
        await asyncio.sleep(0.02)
    assert [d.seq for d in seen] == list(range(1, 20001))
    assert [codec.decode(d.data).id for d in seen] == [e.id for e in evs]
    assert seen[0].msg_id is not None and seen[-1].pending == 0
    assert r.resets == 0


async def test_missed_heartbeats_recreate_the_consumer(js, events):
    pub = Publisher(js)
    await pub.publish_many(events(5))
    stop = asyncio.Event()
    r = _reader(js, stop=stop, idle_heartbeat_s=0.2)
    got: list[int] = []
    five = asyncio.Event()

    async def run() -> None:
        async for batch in r.batches():
            got.extend(d.seq for d in batch)
            if got[-1] >= 5:
                five.set()
            if got[-1] >= 10:
                stop.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(five.wait(), 5)
    # Delete the consumer behind the reader's back: no heartbeats come any more.
    await js.delete_consumer(subjects.STREAM, r._consumer)
    deadline = time.monotonic() + 5
    while r.resets == 0:
        assert time.monotonic() < deadline, "the consumer was not recreated"
        await asyncio.sleep(0.05)
    await pub.publish_many(events(5))
    await asyncio.wait_for(task, 5)
    assert got == list(range(1, 11))


@pytest.mark.usefixtures("either_reader")
async def test_a_filtered_live_read(js, events):
    evs = events(30, "mixed")
    pub = Publisher(js)
    await pub.publish_many(evs[:15])
    stop = asyncio.Event()
    got: list[Delivery] = []
    want = [e.id for e in evs if isinstance(e, ev.NodeLostEvent)]

    def on_batch(batch: list[Delivery]) -> None:
        got.extend(batch)
        if len(got) >= len(want):
            stop.set()

    task = asyncio.create_task(
        read_ordered(
            js, from_seq=1, on_batch=on_batch, stop=stop, filter_subject="llmgw.node.*.status"
        )
    )
    await pub.publish_many(evs[15:])
    last = await asyncio.wait_for(task, 10)
    assert [codec.decode(d.data).id for d in got] == want
    assert last == got[-1].seq


async def test_the_consumer_is_deleted_when_the_read_ends(js, events):
    await Publisher(js).publish_many(events(10))
    assert [d.seq async for b in read_range(js, 1) for d in b] == list(range(1, 11))
    deadline = time.monotonic() + 3
    while [c for c in await js.consumers_info(subjects.STREAM) if c.name.startswith("llmgw_")]:
        assert time.monotonic() < deadline, "the consumer was left behind"
        await asyncio.sleep(0.05)


async def test_a_read_left_early_closes_its_connection(js, events):
    await Publisher(js).publish_many(events(50))
    gen = read_range(js, 1, batch_max=10)
    async for _ in gen:
        break
    await gen.aclose()
    deadline = time.monotonic() + 3
    while [c for c in await js.consumers_info(subjects.STREAM) if c.name.startswith("llmgw_")]:
        assert time.monotonic() < deadline, "the consumer was left behind"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_a_read_resumes_after_the_broker_restarts(nats_server, events, either_reader):
    nc = await connect(nats_server.url, "follower", wire_reader=either_reader == "wire")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
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

        task = asyncio.create_task(
            read_ordered(js, from_seq=1, on_batch=on_batch, stop=stop, batch_max=500)
        )
        await asyncio.wait_for(first.wait(), 10)
        nats_server.kill()
        nats_server.start()
        deadline = time.monotonic() + 20
        while not (nc.stats["reconnects"] >= 1 and nc.is_connected):
            assert time.monotonic() < deadline, "client did not reconnect"
            await asyncio.sleep(0.05)
        await pub.publish_many(evs[2000:])
        assert await asyncio.wait_for(task, 20) == 3000
        assert got == list(range(1, 3001))
    finally:
        await nc.close()


@pytest.mark.timeout(60)
async def test_stopping_while_the_broker_is_down_returns(nats_server, events, either_reader):
    nc = await connect(nats_server.url, "follower", wire_reader=either_reader == "wire")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        await Publisher(js).publish_many(events(5))
        stop = asyncio.Event()
        got: list[int] = []
        five = asyncio.Event()

        def on_batch(batch: list[Delivery]) -> None:
            got.extend(d.seq for d in batch)
            if len(got) >= 5:
                five.set()

        task = asyncio.create_task(read_ordered(js, from_seq=1, on_batch=on_batch, stop=stop))
        await asyncio.wait_for(five.wait(), 10)
        nats_server.kill()
        # Stopped once the client knows the broker is gone (not after some time has passed).
        deadline = time.monotonic() + 10
        while nc.is_connected:
            assert time.monotonic() < deadline, "the client never saw the broker go"
            await asyncio.sleep(0.02)
        stop.set()
        assert await asyncio.wait_for(task, 5) == 5
    finally:
        nats_server.start()
        await nc.close()


async def test_the_wire_reader_tries_the_next_server_when_one_is_down(js, events):
    await Publisher(js).publish_many(events(20))
    (host, port) = js.target.servers[0]
    dead = dataclasses.replace(js.target, servers=((host, free_port()), (host, port)))
    r = wire.WireOrderedReader(
        js,
        dead,
        from_seq=1,
        filter_subject=None,
        stream=subjects.STREAM,
        until_seq=None,
        to_end=True,
        stop=None,
        batch_max=100,
    )
    assert [d.seq async for b in r.batches() for d in b] == list(range(1, 21))
    assert r.server == 1


@pytest.mark.timeout(60)
async def test_the_wire_reader_speaks_tls(tmp_path, events, caplog):
    """A broker that asks for TLS, with the test-only certificate in tests/bus/tls."""
    caplog.set_level(logging.INFO, "llmgw.bus")
    tls = Path(__file__).parent / "tls"
    conf = f'tls {{\n  cert_file: "{tls / "cert.pem"}"\n  key_file: "{tls / "key.pem"}"\n}}\n'
    with EmbeddedBroker(tmp_path / "tls-broker", conf_extra=conf) as broker:
        ctx = ssl.create_default_context(cafile=str(tls / "cert.pem"))
        nc = await connect(broker.url, "t", tls=ctx)
        try:
            js = nc.jetstream()
            assert js.target.tls is ctx and not js.target.unsupported
            await ensure_streams(js)
            await Publisher(js).publish_many(events(50))
            r = _reader(js, to_end=True)
            assert isinstance(consume._reader(js, **_kw(to_end=True)), wire.WireOrderedReader)
            assert [d.seq async for b in r.batches() for d in b] == list(range(1, 51))
            assert not [x for x in caplog.records if "through nats-py" in x.getMessage()]
        finally:
            await nc.close()


async def test_each_reader_case_reads_with_the_reader_it_names(js, either_reader):
    kind = wire.WireOrderedReader if either_reader == "wire" else ordered.NatsOrderedReader
    assert type(consume._reader(js, **_kw(to_end=True))) is kind
