"""Commits an ingest's batches to SQLite, one transaction in flight while the next folds.

Used by the projector and by `replay_records` (bundle replay, the benchmark): the one way
a fold reaches SQLite. `start` takes the keys the ingest touched as they stand, builds the
transaction's rows at once (on the caller's thread, from the view at that point), hands
the transaction to the database's thread and returns; the caller folds on. `wait`
returns when it is committed (or raises what stopped it).

Invariants:
- at most one transaction in flight: `start` refuses while one is, and the caller waits
  first; transactions commit in the order they were started;
- `committed` is the position of the last transaction that committed, never one still
  in flight: rows and position are in the same transaction, and this is only advanced
  once the database says so;
- if a transaction fails, the cache of committed GPU rows is emptied (it was
  updated as if it would commit), and the caller must reload its view from the database
  before starting another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiosqlite

from services.core.ingest import Ingest, Touched
from services.projector import store

Before = Callable[[Touched], Awaitable[None]]
After = Callable[[int], Awaitable[None] | None]


class Committer:
    """The write side of one ingest on one database connection."""

    __slots__ = ("_task", "batches", "committed", "db", "gpu_rows", "ingest", "rows")

    def __init__(self, db: aiosqlite.Connection, ingest: Ingest) -> None:
        self.db = db
        self.ingest = ingest
        self.committed = ingest.seq
        self.gpu_rows: store.GpuCache = {}
        """The GPU rows as last committed, per node, for the store to write only changes."""
        self.batches = 0
        """Transactions committed."""
        self.rows = 0
        """Rows written by them (position rows included)."""
        self._task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        """A transaction is in flight (or finished and not yet waited for)."""
        return self._task is not None

    @property
    def writing(self) -> bool:
        """A transaction is being written right now."""
        return self._task is not None and not self._task.done()

    def start(self, before: Before | None = None, after: After | None = None) -> bool:
        """Take what the ingest touched since the last `start` and write it in one
        transaction, in the background. False when there was nothing to write.

        `before(touched)` runs first (the projector publishes that batch's dead letters and
        digests: if it raises, nothing is written); `after(seq)` once it is committed.
        """
        if self._task is not None:
            raise RuntimeError("a transaction is in flight: wait for it first")
        f = self.ingest
        d = f.touched
        if not d.count:
            return False
        f.touched = Touched()
        txn = store.prepare_batch(f.view, d, self.gpu_rows)
        self._task = asyncio.get_running_loop().create_task(self._write(txn, d, before, after))
        return True

    async def _write(
        self, txn: store.Txn, d: Touched, before: Before | None, after: After | None
    ) -> None:
        try:
            if before is not None:
                await before(d)
            await store.commit(self.db, txn)
        except BaseException:
            self.gpu_rows.clear()
            raise
        self.committed = txn.seq
        self.batches += 1
        self.rows += txn.rows
        if after is not None:
            r = after(txn.seq)
            if r is not None:
                await r

    async def wait(self) -> None:
        """Return once nothing is in flight; raises what stopped the last transaction."""
        t = self._task
        if t is None:
            return
        try:
            # Shielded: a caller cancelled here leaves the transaction to finish, and the
            # task to be waited for again (the database must not close under it).
            await asyncio.shield(t)
        finally:
            if t.done():
                self._task = None

    async def flush(self, before: Before | None = None, after: After | None = None) -> None:
        """Commit everything folded so far and wait for it."""
        await self.wait()
        if self.start(before, after):
            await self.wait()
