"""The ordered readers: every message from a sequence, in order, nothing lost, and a gap
reported rather than skipped. The reads run against both readers (`either_reader`)."""

from __future__ import annotations

import asyncio

import pytest

from schemas import codec, subjects
from schemas import events as ev
from services.bus import Publisher
from services.bus.consume import Delivery, read_ordered, read_range
from services.bus.ordered import NatsOrderedReader


@pytest.mark.usefixtures("either_reader")
async def test_read_range_reads_to_the_end_in_order(js, events):
    pub = Publisher(js)
    evs = events(2500, "mixed")
    await pub.publish_many(evs)
    seen: list[Delivery] = []
    async for batch in read_range(js, 1, batch_max=300):
        assert len(batch) <= 300
        seen.extend(batch)
    assert [d.seq for d in seen] == list(range(1, 2501))
    assert [codec.decode(d.data).id for d in seen] == [e.id for e in evs]


@pytest.mark.usefixtures("either_reader")
async def test_read_range_from_and_until(js, events):
    await Publisher(js).publish_many(events(100))
    seqs = [d.seq async for b in read_range(js, 40, 60) for d in b]
    assert seqs == list(range(40, 61))
    assert [d.seq async for b in read_range(js, 101) for d in b] == []


@pytest.mark.usefixtures("either_reader")
async def test_read_range_with_a_filter(js, events):
    evs = events(90, "mixed")
    await Publisher(js).publish_many(evs)
    lost = [d async for b in read_range(js, 1, filter_subject="llmgw.node.*.status") for d in b]
    assert [codec.decode(d.data).id for d in lost] == [
        e.id for e in evs if isinstance(e, ev.NodeLostEvent)
    ]
    none = [d async for b in read_range(js, 1, filter_subject="llmgw.hold.>") for d in b]
    assert none == []


@pytest.mark.usefixtures("either_reader")
async def test_read_range_of_an_empty_stream(js):
    assert [b async for b in read_range(js, 1)] == []


@pytest.mark.usefixtures("either_reader")
async def test_read_ordered_follows_live_until_stopped(js, events):
    pub = Publisher(js)
    await pub.publish_many(events(10))
    stop = asyncio.Event()
    got: list[int] = []

    async def on_batch(batch: list[Delivery]) -> None:
        got.extend(d.seq for d in batch)
        if got[-1] >= 25:
            stop.set()

    task = asyncio.create_task(read_ordered(js, from_seq=5, on_batch=on_batch, stop=stop))
    await pub.publish_many(events(15))
    last = await asyncio.wait_for(task, 10)
    assert got == list(range(5, 26))
    assert last == 25


@pytest.mark.usefixtures("either_reader")
async def test_read_ordered_until_seq(js, events):
    await Publisher(js).publish_many(events(30))
    got: list[int] = []
    last = await read_ordered(
        js, from_seq=1, until_seq=12, on_batch=lambda b: got.extend(d.seq for d in b)
    )
    assert got == list(range(1, 13)) and last == 12


def _fake(reply_seq: tuple[int, int], subject: str = "llmgw.view.digest"):
    class M:
        pass

    m = M()
    sseq, dseq = reply_seq
    m.reply = f"$JS.ACK.LLMGW.c.1.{sseq}.{dseq}.0.0"  # type: ignore[attr-defined]
    m.subject = subject  # type: ignore[attr-defined]
    m.data = b"{}"  # type: ignore[attr-defined]
    m.headers = None  # type: ignore[attr-defined]
    return m


@pytest.mark.parametrize(
    ("filter_subject", "msgs", "expected", "got"),
    [
        pytest.param(None, [(1, 1), (2, 2), (4, 3)], 3, 4, id="stream sequence skipped"),
        pytest.param("llmgw.>", [(1, 1), (5, 2), (9, 4)], 3, 4, id="consumer sequence skipped"),
    ],
)
def test_a_gap_is_reported_not_skipped(js, filter_subject, msgs, expected, got):
    from services.bus.errors import SequenceGap

    r = NatsOrderedReader(
        js,
        from_seq=1,
        filter_subject=filter_subject,
        stream=subjects.STREAM,
        until_seq=None,
        to_end=False,
        stop=None,
        batch_max=100,
    )
    with pytest.raises(SequenceGap) as e:
        r.check([_fake(m) for m in msgs])
    assert (e.value.expected, e.value.got) == (expected, got)


def test_a_consumer_reset_is_not_a_gap(js):
    r = NatsOrderedReader(
        js,
        from_seq=1,
        filter_subject=None,
        stream=subjects.STREAM,
        until_seq=None,
        to_end=False,
        stop=None,
        batch_max=100,
    )
    out = r.check([_fake(m) for m in [(1, 1), (2, 2), (3, 1), (4, 2)]])
    assert [d.seq for d in out] == [1, 2, 3, 4]
