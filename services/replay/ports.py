"""The projector's SQLite store and snapshots, as replay uses them.

Called by `rebuild` (snapshots to start from), `subscribe` (the same) and the `replay`
command (writing the view to SQLite). The tables and the snapshot bucket belong to
`services.projector`; replay writes through `store.write_view` with the whole history
it folded (decisions, rejections, dead letters), so a replayed database and the live
projector's dump the same when they folded the same log.

It must not define the projector's schema, decide what a snapshot is, or create the
snapshot bucket (reading must leave the broker as it found it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.core.ingest import Dead
from services.core.view import DecisionRecord, Rejection, View


async def snapshot_at_or_before(js: Any, seq: int | None) -> View | None:
    """The newest usable snapshot at or before `seq` (None: the newest), or None.

    None also when there is no bucket, or when reading fails: a snapshot is a shortcut,
    never the truth, and the caller then folds from the first event.
    """
    from nats.js.errors import NotFoundError

    from services.bus import snapshots

    try:
        await js.object_store(snapshots.BUCKET)
    except NotFoundError:
        return None
    try:
        return await snapshots.latest_view(js, seq)
    except Exception:
        # Invariant: any failure to read a snapshot means folding from zero, never
        # failing the replay.
        return None


async def write_view(
    path: str,
    view: View,
    *,
    decisions: Iterable[DecisionRecord] | None = None,
    rejections: Iterable[Rejection] | None = None,
    dead: Iterable[tuple[int, str, str]] = (),
) -> None:
    """Write the view, and the history folded with it, to the SQLite file `path` in the
    projector's tables, replacing what it held."""
    from services.projector import store

    db = await store.open_db(path)
    try:
        await store.write_view(
            db,
            view,
            decisions=decisions,
            rejections=rejections,
            dead=[Dead(seq, subject, reason, b"") for seq, subject, reason in dead],
        )
    finally:
        await db.close()
