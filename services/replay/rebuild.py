"""Rebuild a view by folding a source: the one loop every replay command runs.

Called by the replay commands and by `subscribe`. Its source decodes and checks each
message and it folds each event with `services.core.ingest`, the step the projector
runs, so a replay keeps the same history the live projector stores: replay never
re-decides, it re-folds what was decided. `watcher` lets a caller
look at each event with the view as it stood just before it and the fold's verdict
(history and explain collect their timelines this way) without a second pass.

It must not write anywhere; persisting the result is the caller's choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import msgspec

from schemas import bundle, subjects
from schemas.errors import BundleError
from services.core.ingest import Ingest
from services.core.view import SCHEMA, DecisionRecord, Rejection, View, decode_state
from services.replay import archive, ports
from services.replay.render import plural
from services.replay.source import BundleSource, Item, LogSource, Source, StreamSource


class Watcher(Protocol):
    """Sees each item twice: `before` with the view as it stood before the fold, `after`
    with the fold's verdict (None when applied, else the rejection) and the view after."""

    def before(self, item: Item, view: View) -> None: ...

    def after(self, item: Item, rejection: Rejection | None, view: View) -> None: ...


@dataclass
class Rebuilt:
    """A rebuilt view and what it took."""

    view: View
    source: Source
    folded: int = 0
    rejected: int = 0
    started_at: int = 0
    """The sequence the fold started after: a snapshot's, or 0."""
    rejections: list[Rejection] = field(default_factory=list)
    """Every rejection folded (the view keeps only the recent ones); from a snapshot, the
    ones it recalls, then every one after it."""
    decisions: list[DecisionRecord] = field(default_factory=list)
    """Every decision folded in this run, as the projector stores them."""

    @property
    def seq(self) -> int:
        return self.view.state.seq

    def summary(self) -> str:
        from services.core.view import digest

        start = f" from the snapshot at seq {self.started_at}" if self.started_at else ""
        return (
            f"folded {plural(self.folded, 'event')}{start}, {self.rejected:,} rejected; "
            f"reached seq {self.seq}; digest {digest(self.view.state)}"
        )


async def run(
    source: Source,
    *,
    view: View | None = None,
    watcher: Watcher | None = None,
    progress: Any = None,
) -> Rebuilt:
    """Fold every item of `source` into `view` (a fresh one by default) with
    `ingest`: the same fold, and the same history kept, as the live view."""
    v = view if view is not None else View()
    # A snapshot remembers only the recent decisions and rejections; they open the
    # history, and everything from here on is kept whole.
    step = Ingest(v, strict=False)
    step.touched.rejections = list(v.state.rejections)
    step.touched.decisions = list(v.state.decisions)
    out = Rebuilt(
        view=v,
        source=source,
        started_at=v.state.seq,
        rejections=step.touched.rejections,
        decisions=step.touched.decisions,
    )
    fold_event = step.event
    rejected = 0
    async for batch in source.batches():
        if watcher is None:
            for it in batch:
                if fold_event(it.seq, it.subject, it.event) is not None:
                    rejected += 1
        else:
            for it in batch:
                watcher.before(it, v)
                rej = fold_event(it.seq, it.subject, it.event)
                watcher.after(it, rej, v)
                if rej is not None:
                    rejected += 1
        out.folded += len(batch)
        if progress is not None:
            progress.advance(len(batch))
    out.rejected = rejected
    # The view's position is the last sequence read, undecodable ones included: they are
    # part of the log the view has seen.
    step.end(source.stats.last_seq)
    return out


async def from_bundle(
    path: str,
    *,
    until_seq: int | None = None,
    until_time: datetime | None = None,
    watcher: Watcher | None = None,
    progress: Any = None,
    root: str = subjects.DEFAULT_ROOT,
    allow_gaps: bool = False,
) -> Rebuilt:
    """The view a bundle gives, up to a sequence or a time, folded onto the snapshot it
    starts with when it has one (`bundle.snapshot`); a gap in its sequences, or a start
    after seq 1 that no snapshot covers, is a `BundleError` unless `allow_gaps`
    (`BundleSource`)."""
    start = _bundle_snapshot(path, until_seq, until_time)
    src = BundleSource(
        path,
        until_seq=until_seq,
        until_time=until_time,
        root=root,
        allow_gaps=allow_gaps,
        start_after=start.state.seq if start is not None else 0,
    )
    return await run(src, view=start, watcher=watcher, progress=progress)


def _bundle_snapshot(path: str, until_seq: int | None, until_time: datetime | None) -> View | None:
    """The view of the snapshot a bundle starts with, or None; a `BundleError` for one
    this version cannot read or one past the moment asked for (the view before it is
    not in the bundle)."""
    got = bundle.snapshot(path)
    if got is None:
        return None
    seq, raw = got
    try:
        state = decode_state(raw)
    except msgspec.MsgspecError as e:
        raise BundleError(path, 1, f"the snapshot does not decode as a view ({e})") from None
    if state.seq != seq:
        raise BundleError(
            path, 1, f"the snapshot line says seq {seq} and its view seq {state.seq}: not trusted"
        )
    if state.schema != SCHEMA:
        raise BundleError(
            path,
            1,
            f"the snapshot is of view schema {state.schema}; this llmgw reads schema "
            f"{SCHEMA}: export the log again with this version",
        )
    if (until_seq is not None and until_seq < seq) or (
        until_time is not None and state.time is not None and until_time < state.time
    ):
        raise BundleError(
            path,
            1,
            f"the bundle starts from a snapshot of seq {seq} ({state.time}): the moment "
            "asked for is before it, and not in the bundle",
        )
    return View(state)


async def from_stream(
    js: Any,
    *,
    until_seq: int | None = None,
    until_time: datetime | None = None,
    watcher: Watcher | None = None,
    progress: Any = None,
    use_snapshot: bool = True,
    label: str = "the stream",
    root: str = subjects.DEFAULT_ROOT,
    archive_dir: str | Path | None = None,
) -> Rebuilt:
    """The view the live log gives, up to a sequence or a time, starting from the newest
    snapshot at or before the target when there is one (and no `watcher` needs
    every event from the start). What compaction took off the stream is read from the
    archive (`archive.locate`); a run found nowhere is in `source.stats.gaps`."""
    start: View | None = None
    if use_snapshot and watcher is None:
        snap = await ports.snapshot_at_or_before(js, until_seq)
        # A time target needs a snapshot taken before that time; a later one would hold
        # events the replay must not see.
        if snap is not None and (
            until_time is None or (snap.state.time is not None and snap.state.time <= until_time)
        ):
            start = snap
    from_seq = (start.state.seq + 1) if start is not None else 1
    info = await js.stream_info(subjects.STREAM)
    stream_first = info.state.first_seq or 1
    src: Source
    if from_seq < stream_first:
        # Compacted: what the replay needs from before the stream's first event is in
        # the archive (a snapshot past it would have spared the read).
        src = LogSource(
            js,
            archive.locate(archive_dir, info.config.metadata),
            stream_first=stream_first,
            from_seq=from_seq,
            until_seq=until_seq,
            until_time=until_time,
            label=label,
            root=root,
        )
    else:
        src = StreamSource(
            js,
            from_seq=from_seq,
            until_seq=until_seq,
            until_time=until_time,
            label=label,
            root=root,
        )
    if progress is not None and start is not None and getattr(progress, "total", None):
        progress.total = max(progress.total - start.state.seq, 0)
    return await run(src, view=start, watcher=watcher, progress=progress)
