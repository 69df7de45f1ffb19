"""Commits a Folder's batches to SQLite, one transaction in flight while the next folds.

Used by the projector and by `replay_records` (bundle replay, the benchmark): the one way
a fold reaches SQLite. `start` takes the folder's dirty keys as they stand, builds the
transaction's rows at once (on the caller's thread, from the view at that point), hands
the transaction to the database's thread and returns; the caller folds on. `wait`
returns when it is committed (or raises what stopped it).

Invariants:
- at most one transaction in flight: `start` refuses while one is, and the caller waits
  first; transactions commit in the order they were started;
- `committed` is the position of the last transaction that committed, never one still
  in flight: rows and position are in the same transaction, and this is only advanced
  once the database says so;
- if a transaction fails, the folder's cache of committed GPU rows is emptied (it was
  updated as if it would commit), and the caller must reload its view from the database
  before starting another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiosqlite

from services.projector import store
from services.projector.folder import Dirty, Folder

Before = Callable[[Dirty], Awaitable[None]]
After = Callable[[int], Awaitable[None] | None]


class Committer:
    """The write side of one folder on one database connection."""

    __slots__ = ("_task", "batches", "committed", "db", "folder", "rows")

    def __init__(self, db: aiosqlite.Connection, folder: Folder) -> None:
        self.db = db
        self.folder = folder
        self.committed = folder.seq
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
        """Take what the folder changed since the last `start` and write it in one
        transaction, in the background. False when there was nothing to write.

        `before(dirty)` runs first (the projector publishes that batch's dead letters and
        digests: if it raises, nothing is written); `after(seq)` once it is committed.
        """
        if self._task is not None:
            raise RuntimeError("a transaction is in flight: wait for it first")
        f = self.folder
        d = f.dirty
        if not d.count:
            return False
        f.dirty = Dirty()
        txn = store.prepare_batch(f.view, d, f.gpu_rows)
        self._task = asyncio.get_running_loop().create_task(self._write(txn, d, before, after))
        return True

    async def _write(
        self, txn: store.Txn, d: Dirty, before: Before | None, after: After | None
    ) -> None:
        try:
            if before is not None:
                await before(d)
            await store.commit(self.db, txn)
        except BaseException:
            self.folder.gpu_rows.clear()
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
