"""The projector against a real broker: live SQLite equals a replay, digests agree,
crashes (kill -9 of the process) lose and repeat nothing, gaps are healed, holes stop it,
snapshots are found and old schemas ignored."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from schemas import codec
from services.bus import EmbeddedBroker, Publisher, consume, snapshots
from services.bus.errors import LogHole
from services.core.ingest import Ingest
from services.core.view import SCHEMA, ViewState, digest, encode_state
from services.projector import store
from services.projector.service import Projector
from tests.projector import mix

Record = tuple[int, str, bytes]


async def export(js: JetStreamContext) -> list[Record]:
    out: list[Record] = []
    async for batch in consume.read_range(js):
        out.extend((d.seq, d.subject, d.data) for d in batch)
    return out


def replay(records: list[Record], until: int | None = None) -> Ingest:
    """Fold records in memory; the folder's dirty keeps the whole history (never cleared)."""
    f = Ingest()
    for seq, subject, body in records:
        if until is not None and seq > until:
            break
        f.raw(seq, subject, body)
    return f


async def replay_dump(tmp: Path, records: list[Record], until: int | None = None) -> str:
    f = replay(records, until)
    db = await store.open_db(tmp)
    try:
        await store.write_view(
            db,
            f.view,
            decisions=f.touched.decisions,
            rejections=f.touched.rejections,
            dead=f.touched.dead,
        )
        loaded = await store.load_view(db)
        assert encode_state(loaded.state) == encode_state(f.view.state)
        return await store.dump(db)
    finally:
        await db.close()


async def db_dump(path: Path) -> tuple[str, str]:
    db = await store.open_db(path)
    try:
        return await store.dump(db), digest((await store.load_view(db)).state)
    finally:
        await db.close()


async def settle(js: JetStreamContext, p: Projector, limit_s: float = 60) -> int:
    """Wait until the projector has committed the stream's end and the end holds still
    (it publishes digests into the stream it reads)."""
    async with asyncio.timeout(limit_s):
        while True:
            last = (await js.stream_info("LLMGW")).state.last_seq
            await p.wait_for(last)
            if (await js.stream_info("LLMGW")).state.last_seq == last:
                return last


@contextlib.asynccontextmanager
async def running(p: Projector):  # type: ignore[no-untyped-def]
    stop = asyncio.Event()
    task = asyncio.create_task(p.run(stop))
    try:
        yield task
    finally:
        stop.set()
        with contextlib.suppress(LogHole):
            await task


@pytest.mark.timeout(90)
async def test_live_view_equals_replay_50k(js: JetStreamContext, tmp_path: Path) -> None:
    items = mix.items(11, 50_000, nodes=200, bad=True)
    p = Projector(js, tmp_path / "live.sqlite", digest_every=10_000, snapshot_every=0)
    async with running(p):
        await Publisher(js).publish_many(items)
        last = await settle(js, p)
    records = await export(js)
    assert [r[0] for r in records] == list(range(1, last + 1))
    live, live_digest = await db_dump(tmp_path / "live.sqlite")
    assert live == await replay_dump(tmp_path / "replay.sqlite", records)
    assert live_digest == digest(replay(records).view.state)
    # Every published digest is the replay's digest at its sequence.
    published = [codec.decode(b) for _, s, b in records if s.endswith(".view.digest")]
    published = [e for e in published if e.source == "projector"]
    assert [e.data.seq for e in published] == [10_000, 20_000, 30_000, 40_000, 50_000]  # type: ignore[union-attr]
    for e in published:
        at = e.data.seq  # type: ignore[union-attr]
        assert e.data.digest == digest(replay(records, until=at).view.state)  # type: ignore[union-attr]
    assert p.dead > 0 and p.gaps == 0


@pytest.mark.timeout(60)
async def test_projector_heals_an_injected_gap(js: JetStreamContext, tmp_path: Path) -> None:
    items = mix.items(12, 6000, nodes=50)
    await Publisher(js).publish_many(items)
    p = Projector(js, tmp_path / "v.sqlite", batch_max=500)
    original = p._on_batch
    drops = 0

    async def lossy(batch: list[consume.Delivery]) -> None:
        nonlocal drops
        if drops < 2 and len(batch) > 10 and batch[0].seq > 1000:
            drops += 1
            batch = batch[:5] + batch[6:]  # a delivery vanishes mid-batch
        await original(batch)

    p._on_batch = lossy  # type: ignore[method-assign]
    async with running(p):
        last = await settle(js, p)
    assert drops == 2 and p.gaps >= 2
    records = await export(js)
    live, _ = await db_dump(tmp_path / "v.sqlite")
    assert live == await replay_dump(tmp_path / "r.sqlite", records)
    assert last == len(items)


@pytest.mark.timeout(60)
async def test_a_deleted_message_stops_the_projector(js: JetStreamContext, tmp_path: Path) -> None:
    items = mix.items(13, 3000, nodes=30)
    await Publisher(js).publish_many(items)
    await js.delete_msg("LLMGW", 1700)
    p = Projector(js, tmp_path / "v.sqlite", batch_max=500)
    with pytest.raises(LogHole) as e:
        await p.run(asyncio.Event())
    assert e.value.seq == 1700
    records = await export_around_hole(js)
    live, _ = await db_dump(tmp_path / "v.sqlite")
    # It folded towards the hole and nothing after it. How close it got depends on how
    # the reader batched the messages before the hole (a batch holding the hole is not
    # folded), so only "before the hole, and exactly the log up to there" is asserted.
    pos = _position(tmp_path / "v.sqlite")
    assert 0 < pos < 1700
    assert live == await replay_dump(tmp_path / "r.sqlite", records, until=pos)


async def export_around_hole(js: JetStreamContext) -> list[Record]:
    out: list[Record] = []
    for seq in range(1, 1700):
        m = await js.get_msg("LLMGW", seq)
        out.append((seq, m.subject or "", m.data or b""))
    return out


@pytest.mark.timeout(60)
async def test_snapshots(js: JetStreamContext, tmp_path: Path) -> None:
    items = mix.items(14, 5000, nodes=30)
    await Publisher(js).publish_many(items)
    p = Projector(js, tmp_path / "v.sqlite", snapshot_every=1000, digest_every=0)
    async with running(p):
        await settle(js, p)
        on_demand = await p.snapshot()
    records = await export(js)
    assert [s for _, s, _ in await snapshots.listing(js)] == [1000, 2000, 3000, 4000, 5000]
    assert on_demand == snapshots.name_for(5000)
    snap = await snapshots.latest_at_or_before(js, 3500)
    assert snap is not None and snap.seq == 3000
    assert digest(snap) == digest(replay(records, until=3000).view.state)
    # A snapshot of another schema, newer than all, is ignored, not trusted.
    obs = await snapshots.bucket(js)
    await obs.put(snapshots.name_for(4800, SCHEMA + 1), encode_state(ViewState(seq=4800)))
    assert (await snapshots.latest_at_or_before(js, 4900)).seq == 4000  # type: ignore[union-attr]
    # A cold start from a snapshot, into an empty database, reaches the same view.
    p2 = Projector(js, tmp_path / "cold.sqlite", from_snapshot=True, snapshot_every=0)
    async with running(p2):
        await settle(js, p2)
    assert p2.view.seq == len(items)
    assert digest(p2.view.state) == digest(replay(records).view.state)


# ------------------------------------------------------------------ crashes


def _position(path: Path) -> int:
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(path, timeout=5)) as db:
            row = db.execute("SELECT seq FROM position WHERE id = 1").fetchone()
    except sqlite3.OperationalError:
        return 0
    return 0 if row is None else int(row[0])


def _spawn(url: str, db: Path, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    # The child keeps its own copy of the log's descriptor; ours is closed at once.
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.projector",
                "--nats",
                url,
                "--db",
                str(db),
                "--digest-every",
                "5000",
                "--snapshot-every",
                "0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


async def _wait_position(
    path: Path, at_least: int, proc: subprocess.Popen[bytes], limit_s: float
) -> int:
    deadline = time.monotonic() + limit_s
    while True:
        pos = await asyncio.to_thread(_position, path)
        if pos >= at_least:
            return pos
        assert proc.poll() is None, f"projector exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"position {pos} never reached {at_least}"
        await asyncio.sleep(0.02)  # polling a real condition, with a deadline


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_kill_9_at_random_moments(
    nats_server: EmbeddedBroker, js: JetStreamContext, tmp_path: Path, rng: random.Random
) -> None:
    items = mix.items(rng.randrange(1 << 30), 50_000, nodes=200, bad=True)
    db = tmp_path / "v.sqlite"
    log = tmp_path / "projector.log"
    pub = Publisher(js)
    chunks = [items[i : i + 8000] for i in range(0, len(items), 8000)]
    proc = _spawn(nats_server.url, db, log)
    kills = 0
    published = 0
    try:
        for chunk in chunks:
            sending = asyncio.create_task(pub.publish_many(chunk))
            target = published + rng.randrange(1, len(chunk))
            await _wait_position(db, target, proc, 60)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            await sending
            published += len(chunk)
            proc = _spawn(nats_server.url, db, log)
        last = (await js.stream_info("LLMGW")).state.last_seq
        while True:
            await _wait_position(db, last, proc, 60)
            now = (await js.stream_info("LLMGW")).state.last_seq
            if now == last:
                break
            last = now
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert kills >= 5
    records = await export(js)
    live, _ = await db_dump(db)
    assert live == await replay_dump(tmp_path / "replay.sqlite", records)


# ------------------------------------------------------------------ a million


def million(n: int) -> list[mix.Item]:
    """A cluster set up by the mix, then replica.used reports for the rest: cheap to make
    (bytes formatting), each a valid event that changes the view."""
    m = mix.Mix(21, nodes=20)
    head = list(m.items(3000))
    live = [(rid, m.live[rid][2][0][0]) for rid in m.live_ids]
    out = head
    for i in range(n - len(head)):
        rid, node = live[i % len(live)]
        ms = i % 1000
        body = (
            b'{"type":"replica.used","id":"u%d","time":"2026-11-30T00:00:00.%03dZ",'
            b'"source":"agent","data":{"replica":"%s","at":"2026-11-30T00:00:00.%03dZ"}}'
            % (i, ms, rid.encode(), ms)
        )
        out.append((f"llmgw.node.{node}.replica.{rid}", body, None))
    return out


class _Ack(msgspec.Struct):
    seq: int = 0
    error: dict[str, object] | None = None


async def publish_acked(nc: Client, items: list[mix.Item], window: int = 50_000) -> None:
    """Publish `items` to an empty stream, each with its own reply subject, `window` in
    flight; every ack is checked: no error, and item i stored at sequence i + 1.

    The lean form of `Publisher.publish_many` for pre-encoded bodies without ids or
    headers (no future per message), several times faster for a million.
    """
    inbox = nc.new_inbox()
    acked = 0
    bad: list[str] = []
    room = asyncio.Event()
    decode = msgspec.json.Decoder(_Ack).decode

    async def on_ack(msg: Msg) -> None:
        # No await here: a callback that awaits can let nats-py drop messages.
        nonlocal acked
        i = int(msg.subject.rsplit(".", 1)[1])
        ack = decode(msg.data)
        if ack.error is not None or ack.seq != i + 1:
            bad.append(f"item {i}: {msg.data!r}")
        acked += 1
        room.set()

    sub = await nc.subscribe(f"{inbox}.*", cb=on_ack, pending_msgs_limit=0, pending_bytes_limit=0)
    try:
        for i, (subject, body, _) in enumerate(items):
            await nc.publish(subject, body, reply=f"{inbox}.{i}")
            while i + 1 - acked >= window:
                room.clear()
                await nc.flush()
                await asyncio.wait_for(room.wait(), 30)
        async with asyncio.timeout(60):
            while acked < len(items):
                room.clear()
                await nc.flush()
                await room.wait()
    finally:
        await sub.unsubscribe()
    assert not bad, bad[:3]
    assert acked == len(items)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_million_events_every_sequence_applied(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> None:
    n = 1_000_000
    t = time.perf_counter()
    await publish_acked(nc, million(n))
    published = time.perf_counter() - t
    assert (await js.stream_info("LLMGW")).state.last_seq == n
    p = Projector(js, tmp_path / "v.sqlite", digest_every=0, snapshot_every=0)
    original = p._on_batch
    expected = 1
    applied = 0

    async def checked(batch: list[consume.Delivery]) -> None:
        # Checked here as well as in the reader and the folder: every sequence, in order.
        nonlocal expected, applied
        for d in batch:
            assert d.seq == expected, f"expected {expected}, got {d.seq}"
            expected += 1
        applied += len(batch)
        await original(batch)

    p._on_batch = checked  # type: ignore[method-assign]
    t = time.perf_counter()
    async with running(p):
        await p.wait_for(n, timeout=240)
    read = time.perf_counter() - t
    print(f"published {n:,} in {published:.1f}s; projected in {read:.1f}s ({n / read:,.0f}/s)")
    assert applied == n and expected == n + 1
    assert p.gaps == 0 and p.dead == 0
    assert _position(tmp_path / "v.sqlite") == n
    assert p.view.state.rejected == 0
