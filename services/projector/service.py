"""The projector service: the log folded into SQLite, batch by batch, position included.

`llmgw up` runs `Projector(js, db_path, root).run(stop)` in-process; `python -m
services.projector` runs it alone. It owns its position (the stream sequence in the
`position` table) and reads on from just after it with the bus's follow loop, folding
each message with `services.core.ingest`; there is no durable consumer to ack. Every N events it publishes `view.digest` and every M it
stores a snapshot. `replay_records` is the same batch path fed from a bundle.

It must not fold past a gap (it reloads its checkpoint and reads again; a message
deleted from the log stops it with `services.bus.LogHole`), must not commit
rows without their position, and must not decide anything: it only records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path

import aiosqlite
import nats.errors
from nats.js.client import JetStreamContext

from schemas import events as ev
from schemas import ids, subjects
from services.bus import Publisher, consume, follow, snapshots
from services.bus.errors import SequenceGap, StreamReplaced
from services.clock import utc_now
from services.core.ingest import Gap, Ingest, Touched
from services.core.view import View, decode_state, digest, encode_state
from services.projector import store
from services.projector.committer import Committer

log = logging.getLogger("llmgw.projector")

# DIGEST_EVERY is how many events apart `view.digest` is published, at sequences that
# are multiples of it, so every projector and replay digests the same points.
DIGEST_EVERY = 10_000

# BATCH_MAX is the most events one SQLite transaction covers. A transaction writes each
# row its batch touched once, however often it was touched (a replica reported used ten
# times is one row), so with a backlog large batches write far fewer rows per event:
# 0.56 rows/event at 5,000 on the benchmark's mix, 0.22 at 50,000. Caught up, a batch is
# whatever arrived, committed at once.
BATCH_MAX = 50_000

# MAX_DELAY_S bounds how long folded events wait for a transaction when there is a
# backlog and the database is idle; caught up, they are committed at once.
MAX_DELAY_S = 0.2

# FULL_RETRY_S is how long the projector waits, after a commit failed on a full disk,
# before it reads on from its last commit and tries again.
FULL_RETRY_S = 1.0

# READ_CHUNK is the most messages handed to one `_on_batch` call (the reader's batch).
READ_CHUNK = 5000

# REPLAY_BATCH is the batch of a replay from a bundle: no reader waits on its freshness,
# so it batches for the fewest rows written.
REPLAY_BATCH = 100_000

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def digest_event(seq: int, value: str, time: datetime | None, stream: str) -> ev.Event:
    """The `view.digest` for the view at `seq`. Its id and time come from the log, not
    the clock, so any projector re-publishing it (after a crash) is deduplicated."""
    return ev.make(
        ev.ViewDigest(seq=seq, digest=value),
        id=ids.derived(f"{stream}:{seq}", "view.digest"),
        time=time or _EPOCH,
        source="projector",
    )


class Projector:
    """Folds the log into the SQLite view at `db_path`."""

    def __init__(
        self,
        js: JetStreamContext,
        db_path: str | Path,
        root: str = subjects.DEFAULT_ROOT,
        *,
        consumer: str = "projector",
        digest_every: int = DIGEST_EVERY,
        snapshot_every: int = snapshots.SNAPSHOT_EVERY,
        from_snapshot: bool = False,
        batch_max: int = BATCH_MAX,
        max_delay_s: float = MAX_DELAY_S,
        stream: str = subjects.STREAM,
    ) -> None:
        self.js = js
        self.db_path = db_path
        self.root = root
        self.consumer = consumer
        self.digest_every = digest_every
        self.snapshot_every = snapshot_every
        self.from_snapshot = from_snapshot
        self.batch_max = batch_max
        self.max_delay_s = max_delay_s
        self.stream = stream
        self.folder = Ingest(root=root)
        self.db: aiosqlite.Connection | None = None
        self._committer: Committer | None = None
        self._digests: list[ev.Event] = []
        """Digests of the events folded and not yet handed to a transaction."""
        self._snaps: list[bytes] = []
        self._since = 0.0
        """When the oldest event not yet handed to a transaction was folded."""
        self.gaps = 0
        self.dead = 0
        self.digests = 0
        self.snapshots = 0
        self.committed = 0
        """The position as last committed."""
        self._advanced = asyncio.Event()
        self.error: BaseException | None = None
        """What stopped `run`, if it stopped on an error."""
        self._aside_at: int | None = None
        """The position the view was rebuilt from when an unreadable one was last moved
        aside (-1 until it is loaded); None: never."""
        self._full = False
        """The last commit failed on a full disk, and none has worked since."""
        self.stopped = False

    @property
    def view(self) -> View:
        return self.folder.view

    @property
    def seq(self) -> int:
        return self.folder.seq

    async def wait_for(self, seq: int, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Return once the committed position has reached `seq`."""
        async with asyncio.timeout(timeout):
            while self.committed < seq:
                if self.error is not None:
                    raise self.error
                if self.stopped:
                    raise RuntimeError(f"projector stopped at {self.committed}")
                await self._advanced.wait()

    async def _load(
        self, db: aiosqlite.Connection, *, rebuild: bool = False, snapshot: bool = False
    ) -> None:
        """(Re)start from the view as committed: whatever was folded past it is dropped.
        With `rebuild`, or when the stream is not the one the view was folded from, the
        view starts again empty, from the new log. An empty view starts from the newest
        snapshot with `snapshot` (or `from_snapshot`)."""
        await self._settle()
        view = await store.load_view(db)
        origin, last = await follow.stream_origin(self.js, self.stream)
        kept = await store.read_origin(db)
        if origin is not None and not rebuild and view.seq:
            if kept not in (None, origin):
                why = f"created {origin}, the view's {kept}"
            elif last < view.seq:
                why = f"it ends at {last}, the view is at {view.seq}"
            else:
                why = ""
            if why:
                log.error(
                    "projector: the stream %s is not the one the view was folded from (%s); "
                    "rebuilding the view from the new log",
                    self.stream,
                    why,
                )
                rebuild = True
        if rebuild:
            view = View()
            await store.write_view(db, view)
        if origin is not None and kept != origin:
            await store.write_origin(db, self.stream, origin)
        if view.seq == 0 and (self.from_snapshot or snapshot):
            snap = await snapshots.latest_view(self.js)
            if snap is not None:
                # The rows start from the snapshot: decisions and rejections before it are
                # only the recent ones the view kept. A full history needs a fold from 1.
                await store.write_view(db, snap)
                view = snap
                log.info("projector: started from the snapshot at %d", view.seq)
        self.folder = Ingest(view, self.root)
        self._committer = Committer(db, self.folder)
        self._digests, self._snaps = [], []
        self.committed = view.seq
        self._notify()

    async def _settle(self) -> None:
        """Wait for the transaction in flight, if any. A broker error in it (publishing
        its digests) only means it did not commit: the caller reloads and reads again."""
        if self._committer is None:
            return
        try:
            await self._committer.wait()
        except nats.errors.Error as e:
            log.warning("projector: a batch was not committed (%s)", e)

    def _notify(self) -> None:
        self._advanced.set()
        self._advanced = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Fold until `stop` is set. Raises `LogHole` if a message was deleted from the log.

        A view file that cannot be opened or read (`store.unreadable`) is moved aside and
        the view folded again from the log, from its newest snapshot: the view is derived
        from the log, and a damaged copy must not stop the plane. A new file that fails
        again before anything was committed to it is not the file's fault, and stops it.
        """
        self.db = await self._open()

        async def restart(e: BaseException) -> None:
            # Nothing past the checkpoint is trusted: reload it and read again.
            if isinstance(e, SequenceGap | Gap):
                self.gaps += 1
            assert self.db is not None
            await self._load(self.db)

        try:
            while True:
                try:
                    await self._load(self.db, snapshot=self._aside_at is not None)
                    if self._aside_at is not None:
                        self._aside_at = self.committed
                    log.info("projector: view at %d, reading on", self.seq)
                    stopped = await self._follow(stop, restart)
                    break
                except Exception as e:
                    if store.full(e):
                        # A full disk: what was folded since the last commit is folded
                        # again from the log once a commit works; the plane runs on.
                        await self._wait_for_space(e, stop)
                        continue
                    if not store.unreadable(e) or self._aside_at in (-1, self.committed):
                        raise
                    await self._reopen(e)
            # What was folded is committed before the database closes.
            if stopped:
                await self._flush()
            else:
                with contextlib.suppress(nats.errors.Error):
                    await self._flush()
        except BaseException as e:
            self.error = e
            raise
        finally:
            # Never close the database under a transaction in flight.
            if self._committer is not None:
                with contextlib.suppress(Exception):
                    await self._committer.wait()
            self.stopped = True
            db, self.db = self.db, None
            if db is not None:
                with contextlib.suppress(Exception):
                    await db.close()
            self._advanced.set()

    async def _follow(
        self, stop: asyncio.Event, restart: Callable[[BaseException], Awaitable[None]]
    ) -> bool:
        """The follow loop, from the view as loaded; a replaced stream rebuilds the view."""
        while True:
            try:
                return await follow.follow(
                    self.js,
                    position=lambda: self.folder.seq,
                    on_batch=self._on_batch,
                    stop=stop,
                    restart=restart,
                    name="projector",
                    batch_max=min(self.batch_max, READ_CHUNK),
                    stream=self.stream,
                )
            except StreamReplaced as e:
                log.error("projector: %s; rebuilding the view from the new log", e)
                assert self.db is not None
                await self._load(self.db, rebuild=True)

    async def _wait_for_space(self, e: BaseException, stop: asyncio.Event) -> None:
        """Say once per outage that the view cannot be written; wait FULL_RETRY_S."""
        if not self._full:
            self._full = True
            log.error(
                "projector: the view %s cannot be written (%s: %s); retrying every %gs, "
                "from its last commit at %d",
                self.db_path,
                type(e).__name__,
                e,
                FULL_RETRY_S,
                self.committed,
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), FULL_RETRY_S)

    async def _open(self) -> aiosqlite.Connection:
        """The view database; an unreadable file is moved aside and a new one made."""
        try:
            return await store.open_db(self.db_path)
        except Exception as e:
            if not store.unreadable(e):
                raise
            self._set_aside(e)
            return await store.open_db(self.db_path)

    async def _reopen(self, e: BaseException) -> None:
        """The view failed on reading or writing: close it, move it aside, open a new one."""
        if self._committer is not None:
            with contextlib.suppress(Exception):
                await self._committer.wait()
            self._committer = None
        db, self.db = self.db, None
        if db is not None:
            with contextlib.suppress(Exception):
                await db.close()
        self._set_aside(e)
        self.db = await store.open_db(self.db_path)

    def _set_aside(self, e: BaseException) -> None:
        path = Path(self.db_path)
        aside = store.set_aside(path, utc_now())
        self._aside_at = -1
        log.error(
            "projector: the view %s cannot be read (%s: %s); moved it aside to %s and "
            "rebuilding it from the log",
            path,
            type(e).__name__,
            e,
            aside.name,
        )

    async def _on_batch(self, batch: list[consume.Delivery]) -> None:
        """Fold a delivery; commit when caught up (at once, and wait for it), else when
        the batch is full or old enough, in the background while the next one folds."""
        folder = self.folder
        if not folder.touched.count:
            self._since = time.monotonic()
        raw = folder.raw
        every_d, every_s = self.digest_every, self.snapshot_every
        for d in batch:
            seq = d.seq
            raw(seq, d.subject, d.data, d.time_ns)
            if every_d and seq % every_d == 0:
                s = folder.view.state
                self._digests.append(digest_event(seq, digest(s), s.time, self.stream))
            if every_s and seq % every_s == 0:
                self._snaps.append(encode_state(folder.view.state))
        c = self._committer
        assert c is not None
        n = folder.touched.count
        if not n:
            return
        caught_up = batch[-1].pending == 0
        if caught_up or n >= self.batch_max:
            await self._commit()
            if caught_up:
                # Nothing more to fold: the view is fresh once this is committed.
                await c.wait()
        elif not c.writing and time.monotonic() - self._since >= self.max_delay_s:
            await self._commit()

    async def _commit(self) -> None:
        """Wait for the transaction in flight, then start one for everything folded since.

        Dead letters and digests are published first (their ids make a re-publish after a
        crash a duplicate), then rows and position commit in one transaction; snapshots
        after, since they must never be ahead of the log's committed view."""
        c = self._committer
        assert c is not None
        await c.wait()
        digests, self._digests = self._digests, []
        snaps, self._snaps = self._snaps, []

        async def before(touched: Touched) -> None:
            await consume.dead_letters(self.js, self.root, self.consumer, touched.dead)
            for e in digests:
                # Its id scoped and a duplicate ack checked (Publisher): nobody else's
                # message keeps a digest off the log.
                await Publisher(self.js, self.root).publish(
                    e, subject=subjects.digest_subject(self.root)
                )
            self.dead += len(touched.dead)
            self.digests += len(digests)

        async def after(seq: int) -> None:
            if self._full:
                self._full = False
                log.info("projector: the view is written again, at %d", seq)
            self.committed = seq
            self._notify()
            for raw in snaps:
                await self._put_snapshot(raw)

        if c.start(before, after):
            # Let the transaction reach the database's thread before folding on.
            await asyncio.sleep(0)

    async def _flush(self) -> None:
        """Commit everything folded, and wait for it."""
        if self._committer is not None:
            await self._commit()
            await self._committer.wait()

    async def _put_snapshot(self, raw: bytes) -> None:
        state = decode_state(raw)
        try:
            await snapshots.save(self.js, state)
            self.snapshots += 1
        except nats.errors.Error as e:
            # A snapshot is a shortcut; losing one costs a longer cold start, nothing else.
            log.warning("projector: snapshot at %d not stored: %s", state.seq, e)

    async def snapshot(self) -> str:
        """Store a snapshot of the view as it is now (on demand); returns its name."""
        name = await snapshots.save(self.js, self.folder.view.state)
        self.snapshots += 1
        return name


async def replay_records(
    db: aiosqlite.Connection,
    records: Iterable[tuple[int, str, bytes]],
    *,
    root: str = subjects.DEFAULT_ROOT,
    batch: int = REPLAY_BATCH,
    ingest: Ingest | None = None,
    strict: bool = True,
) -> Ingest:
    """Fold (seq, subject, body) records into the SQLite view at `db` through the same
    ingest and write path as the live projector (a bundle replay, a benchmark), each
    transaction written while the next `batch` records fold. Returns the ingest, its
    view committed."""
    f = ingest if ingest is not None else Ingest(await store.load_view(db), root, strict)
    c = Committer(db, f)
    raw = f.raw
    try:
        for seq, subject, body in records:
            if seq <= f.seq:
                continue
            raw(seq, subject, body)
            if f.touched.count >= batch:
                await c.wait()
                c.start()
                await asyncio.sleep(0)
        await c.flush()
    finally:
        with contextlib.suppress(Exception):
            await c.wait()
    return f
