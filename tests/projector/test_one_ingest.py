"""One ingest: every reader of the log, fed the same log, ends with the same view, the
same rejections and the same dead letters.

The projector (SQLite), a `ViewFollower` (memory), a `subscribe` client (its live tail)
and a replay from the stream (`rebuild`) read one log on a real broker, with an event on
the wrong subject and a message that does not decode in it besides the mix's own
invariant breakers. A reader with its own copy of the raw-message step (the live tail
once folded the wrong-subject event the projector dead-letters) fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import codec, subjects
from schemas import events as ev
from services.bus import DLQ_STREAM, Publisher
from services.bus.consume import read_dead_letter, read_range
from services.core.view import Rejection, View, digest
from services.plane.follower import ViewFollower
from services.projector import store
from services.projector.service import Projector
from services.replay import rebuild
from services.replay.subscribe import LIST, UNDECODABLE, subscribe
from tests.projector import mix

pytestmark = pytest.mark.timeout(90)

T = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)

Seen = tuple[str, list[tuple[int, str]], set[tuple[int, str]]]
"""What one reader ended with: its view's digest, its rejections (seq, reason) in log
order, and its dead letters (seq, reason)."""


def _line(reason: str) -> str:
    # The DLQ stores a reason on one line (`consume.dead_letter`); compare them so.
    return " ".join(reason.split())


def _rejections(rs: list[Rejection]) -> list[tuple[int, str]]:
    return [(r.seq, r.reason) for r in rs]


async def _publish(js: JetStreamContext) -> tuple[int, int, int]:
    """The log: a mix with invariant breakers, one event on the wrong subject and one
    message that does not decode. Returns (wrong subject seq, undecodable seq, last seq)."""
    items = mix.items(11, 1200, nodes=12, bad=True)
    pub = Publisher(js)
    await pub.publish_many(items[:600])
    # scale.desired for one model on another model's subject: `subjects.check` refuses it.
    stray = ev.make(
        ev.ScaleDesired(model="stray/model", replicas=3), id="stray-1", time=T, source="test"
    )
    wrong = await pub.publish_raw(
        subjects.scale_subject("meta/llama-3.1-8b"), codec.encode(stray), msg_id="stray-1"
    )
    junk = await pub.publish_raw(subjects.scale_subject("x"), b'{"type": 7', msg_id="junk-1")
    acks = await pub.publish_many(items[600:])
    return wrong.seq, junk.seq, acks[-1].seq


async def _projector(js: JetStreamContext, db_path: Path, last: int) -> Seen:
    p = Projector(js, db_path, digest_every=0, snapshot_every=0)
    stop = asyncio.Event()
    task = asyncio.create_task(p.run(stop))
    try:
        await p.wait_for(last, timeout=30)
    finally:
        stop.set()
        await task
    db = await store.open_db(db_path)
    try:
        stored = await store.load_view(db)
        async with db.execute("SELECT seq, reason FROM rejections ORDER BY n") as cur:
            rej = [(int(s), str(r)) for s, r in await cur.fetchall()]
        async with db.execute("SELECT seq, reason FROM dead_letters") as cur:
            dead = {(int(s), _line(r)) for s, r in await cur.fetchall()}
    finally:
        await db.close()
    assert digest(stored.state) == digest(p.view.state)
    return digest(stored.state), rej, dead


async def _follower(js: JetStreamContext, last: int) -> Seen:
    rej: list[tuple[int, str]] = []

    def on_change(seq: int, e: ev.Event, r: Rejection | None) -> None:
        if r is not None:
            rej.append((seq, r.reason))

    f = ViewFollower(js, consumer="one-ingest", on_change=on_change)
    f.start()
    try:
        await f.wait_for(last, timeout=30)
    finally:
        await f.stop()
    dead: set[tuple[int, str]] = set()
    mine = subjects.dlq_subject("one-ingest")
    async for batch in read_range(js, 1, stream=DLQ_STREAM, filter_subject=mine):
        for d in batch:
            letter = read_dead_letter(d.data)
            dead.add((letter.seq, _line(letter.reason)))
    assert len(dead) == f.dead
    return digest(f.view.state), rej, dead


async def _subscriber(js: JetStreamContext, last: int) -> Seen:
    rej: list[tuple[int, str]] = []
    dead: set[tuple[int, str]] = set()
    view: View | None = None
    async with contextlib.aclosing(subscribe(js, 1)) as changes:
        async for seq, ch in changes:
            view = ch.view
            if ch.type == LIST:
                assert seq == 0
            elif ch.type == UNDECODABLE:
                assert ch.rejected is not None
                dead.add((seq, _line(ch.rejected)))
            elif ch.rejected is not None:
                rej.append((seq, ch.rejected))
            if seq >= last:
                break
    assert view is not None and view.state.seq == last
    return digest(view.state), rej, dead


async def _replay(js: JetStreamContext, last: int) -> Seen:
    r = await rebuild.from_stream(js, use_snapshot=False)
    assert r.seq == last
    dead = {(seq, _line(why)) for seq, _, why in r.source.stats.dead}
    return digest(r.view.state), _rejections(r.rejections), dead


async def test_every_reader_of_the_log_ends_with_the_same_view(
    js: JetStreamContext, tmp_path: Path
) -> None:
    wrong, junk, last = await _publish(js)

    seen = {
        "projector": await _projector(js, tmp_path / "view.db", last),
        "follower": await _follower(js, last),
        "subscribe": await _subscriber(js, last),
        "replay": await _replay(js, last),
    }

    digest_, rej, dead = seen["projector"]
    assert rej, "the mix's invariant breakers are rejected"
    dead_seqs = {s for s, _ in dead}
    assert {wrong, junk} <= dead_seqs
    assert any(s == wrong and "wrong subject for its data" in r for s, r in dead)
    for name, (d, r, x) in seen.items():
        assert x == dead, f"{name}: dead letters differ from the projector's"
        assert r == rej, f"{name}: rejections differ from the projector's"
        assert d == digest_, f"{name}: view differs from the projector's"


async def test_the_live_tail_never_folds_an_event_on_the_wrong_subject(
    js: JetStreamContext,
) -> None:
    pub = Publisher(js)
    stray = ev.make(
        ev.ScaleDesired(model="stray/model", replicas=3), id="stray-2", time=T, source="test"
    )
    async with contextlib.aclosing(subscribe(js, None)) as changes:
        _, listing = await anext(changes)
        assert listing.type == LIST
        ack = await pub.publish_raw(
            subjects.scale_subject("meta/llama-3.1-8b"), codec.encode(stray), msg_id="stray-2"
        )
        seq, ch = await anext(changes)
    assert seq == ack.seq
    assert ch.type == UNDECODABLE
    assert ch.rejected is not None and "wrong subject for its data" in ch.rejected
    assert "stray/model" not in ch.view.state.desired
    assert ch.view.state.seq == ack.seq
