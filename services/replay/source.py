"""Where replayed events come from: one shape over a `.jsonl` bundle and the live stream.

Called by `rebuild` (and through it by every replay command and `subscribe`'s catch-up).
`LogSource` reads a compacted log: the archive, then the stream, as one. A source yields batches of `Item(seq, subject, event)` in stream order, from `from_seq`
to `until_seq`, or up to the first event whose own time is after `until_time`. A line or
message that does not decode, or whose event does not belong on its subject, is counted
in `stats` with its reason and skipped, as the projector dead-letters it: a bad event
in the log must never stop a replay, and must never pass unnoticed either.

It must not fold or interpret events; it only reads, decodes and cuts.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from schemas import bundle, subjects
from schemas.errors import BundleError
from schemas.events import Event
from services.core import ingest
from services.replay import archive
from services.replay.render import plural

# BATCH is how many bundle lines one batch carries: a bundle is read synchronously, and
# a batch at a time keeps a progress bar moving without a call per event.
BATCH = 1000


@dataclass(frozen=True, slots=True)
class Item:
    """One decoded event with its place in the stream."""

    seq: int
    subject: str
    event: Event


@dataclass
class Stats:
    """What a source read: counts, the last sequence, and why bad messages were skipped."""

    decoded: int = 0
    undecodable: int = 0
    dead: list[tuple[int, str, str]] = field(default_factory=list)
    """(seq, subject, why) of every message skipped: the projector's dead letters."""
    last_seq: int = 0
    """The last sequence read and taken (decoded or not)."""
    cut_at: int | None = None
    """The sequence of the first event past `until_time`, when the time cut stopped it."""
    gaps: list[tuple[int, int]] = field(default_factory=list)
    """(first, last) of every run of sequences missing from a bundle, replayed past with
    `allow_gaps`."""
    where: dict[int, str] = field(default_factory=dict)
    """For a skipped message of a file, its `FILE:LINE`, by sequence."""

    def skip(self, seq: int, subject: str, why: str) -> None:
        self.undecodable += 1
        self.last_seq = seq
        self.dead.append((seq, subject, why))

    def summary(self) -> str:
        """'' when nothing was skipped, else one line naming the first few."""
        if not self.undecodable:
            return ""
        shown = "; ".join(
            f"{self.where[s]}: seq {s}: {w}" if s in self.where else f"seq {s}: {w}"
            for s, _, w in self.dead[:3]
        )
        more = "; ..." if self.undecodable > 3 else ""
        verb = "is" if self.undecodable == 1 else "are"
        return (
            f"skipped {plural(self.undecodable, 'event')} that {verb} not valid here "
            f"({shown}{more})"
        )

    def gap_summary(self) -> str:
        """'' when no sequence was missing, else one line naming the first few gaps."""
        if not self.gaps:
            return ""
        runs = [f"{a}" if a == b else f"{a}-{b}" for a, b in self.gaps[:3]]
        more = ", ..." if len(self.gaps) > 3 else ""
        lost = sum(b - a + 1 for a, b in self.gaps)
        what = "seq" if lost == 1 else "seqs"
        return (
            f"the log has {plural(len(self.gaps), 'gap')}: {what} {', '.join(runs)}{more} "
            f"missing ({plural(lost, 'event')}); replayed past them"
        )


class Source(Protocol):
    """Events in stream order with their sequence and subject."""

    stats: Stats
    label: str

    def batches(self) -> AsyncIterator[list[Item]]: ...


class _Cut:
    """The shared limits: decode and check (`ingest.decode_checked`), count, stop at
    `until_seq` / past `until_time`."""

    def __init__(
        self, stats: Stats, until_seq: int | None, until_time: datetime | None, root: str
    ) -> None:
        self.stats = stats
        self.root = root
        self.until_seq = until_seq
        self.until_time = until_time
        self.done = False

    def take(self, raw: Iterable[tuple[int, str, bytes, int]]) -> list[Item]:
        """Items of (seq, subject, body, when stored in ns or 0) in order, up to the cut."""
        out: list[Item] = []
        st = self.stats
        until_seq, until_time = self.until_seq, self.until_time
        decode, root = ingest.decode_checked, self.root
        for seq, subject, data, stored_ns in raw:
            if until_seq is not None and seq > until_seq:
                self.done = True
                break
            # Invariant: decoded and checked by the step the projector runs, so what it
            # dead-letters is skipped here, and a replay and the live view agree.
            event = decode(data, subject, root, stored_ns)
            if isinstance(event, str):
                st.skip(seq, subject, event)
                continue
            if until_time is not None and event.time > until_time:
                st.cut_at = seq
                self.done = True
                break
            st.decoded += 1
            st.last_seq = seq
            out.append(Item(seq, subject, event))
            if until_seq is not None and seq >= until_seq:
                self.done = True
                break
        return out


class BundleSource:
    """The events of a `.jsonl` bundle file (`llmgw events export`).

    A bundle is a run of the log, so a sequence that does not follow the line before
    means events were lost (a hand-cut file, a broken copy): replaying past them would
    give a view no cluster ever had, without a word. So a gap before the cut is a
    `BundleError` naming its line, unless `allow_gaps`; then it is kept in `stats.gaps`
    for the caller to say once. A gap past the cut is never looked at.

    The same holds for the bundle's start: its first line must follow `start_after`, the
    seq of the snapshot it starts from (`bundle.snapshot`), or 0 when it has none. A
    bundle of a compacted log cut without its archive starts after seq 1 with nothing
    to fold its beginning from, and is a gap like any other."""

    def __init__(
        self,
        path: str,
        *,
        from_seq: int = 1,
        until_seq: int | None = None,
        until_time: datetime | None = None,
        root: str = subjects.DEFAULT_ROOT,
        allow_gaps: bool = False,
        start_after: int = 0,
    ) -> None:
        self.path = path
        self.from_seq = from_seq
        self.start_after = start_after
        self.until_seq = until_seq
        self.allow_gaps = allow_gaps
        self.label = path
        self.stats = Stats()
        self._cut = _Cut(self.stats, until_seq, until_time, root)

    async def batches(self) -> AsyncIterator[list[Item]]:
        chunk: list[tuple[int, str, bytes, int]] = []
        # The line of each message of the chunk, to name a skipped one by FILE:LINE.
        lines: list[int] = []
        until_seq, from_seq = self.until_seq, self.from_seq
        last = self.start_after
        for seq, subject, line, lineno, stored_ns in bundle.entries(self.path):
            if until_seq is not None and seq > until_seq:
                break
            if seq != last + 1 and seq > from_seq:
                # The lines before the gap are taken first: a cut among them (a time)
                # ends the replay before the gap matters.
                out = self._take(chunk, lines) if chunk else []
                chunk, lines = [], []
                if out:
                    yield out
                if self._cut.done:
                    return
                self._gap(last, seq, lineno)
            last = seq
            if seq < from_seq:
                continue
            chunk.append((seq, subject, line, stored_ns))
            lines.append(lineno)
            if len(chunk) >= BATCH:
                out = self._take(chunk, lines)
                chunk, lines = [], []
                if out:
                    yield out
                if self._cut.done:
                    return
        if chunk:
            out = self._take(chunk, lines)
            if out:
                yield out

    def _take(self, chunk: list[tuple[int, str, bytes, int]], lines: list[int]) -> list[Item]:
        """`_Cut.take`, with the FILE:LINE of each message it skips."""
        st = self.stats
        before = len(st.dead)
        out = self._cut.take(chunk)
        if len(st.dead) > before:
            at = {c[0]: n for c, n in zip(chunk, lines, strict=True)}
            for seq, _, _ in st.dead[before:]:
                st.where[seq] = f"{self.path}:{at[seq]}"
        return out

    def _gap(self, before: int, seq: int, lineno: int) -> None:
        if not self.allow_gaps:
            raise BundleError(
                self.path, lineno, f"{self._missing(before, seq)}; --allow-gaps replays past it"
            )
        self.stats.gaps.append((before + 1, seq - 1))

    def _missing(self, before: int, seq: int) -> str:
        """The gap in words; at the start, what would have covered it."""
        if before > self.start_after:
            return bundle.missing(before, seq)
        run = f"seq {before + 1} is" if seq == before + 2 else f"seqs {before + 1}-{seq - 1} are"
        held = f"its snapshot is of seq {before}" if before else "no snapshot in it covers them"
        return (
            f"the bundle starts at seq {seq}: {run} missing and {held} (a compacted log "
            "exported or cut without its archive, or a hand-cut file)"
        )


class StreamSource:
    """The events stored on the JetStream stream, read to its end as it is now and no
    further (`services.bus.consume.read_range`)."""

    def __init__(
        self,
        js: Any,
        *,
        from_seq: int = 1,
        until_seq: int | None = None,
        until_time: datetime | None = None,
        label: str = "the stream",
        root: str = subjects.DEFAULT_ROOT,
    ) -> None:
        self.js = js
        self.from_seq = from_seq
        self.until_seq = until_seq
        self.label = label
        self.stats = Stats()
        self._cut = _Cut(self.stats, until_seq, until_time, root)

    async def batches(self) -> AsyncIterator[list[Item]]:
        from services.bus import consume

        # aclosing: a cut ends the read early, and the reader's consumer must be removed
        # then, not whenever the garbage collector finds it.
        reader: Any = consume.read_range(self.js, self.from_seq, self.until_seq)
        async with contextlib.aclosing(reader):
            async for batch in reader:
                out = self._cut.take((d.seq, d.subject, d.data, d.time_ns) for d in batch)
                if out:
                    yield out
                if self._cut.done:
                    return


class LogSource:
    """The log as one run: the archive's parts (`services.replay.archive`) for what
    compaction took off the stream, then the stream from its first sequence on.

    A run of sequences neither holds (no archive given, a part missing, a part that does
    not match its checksum) is replayed past and named in `stats.gaps`: the view is then
    one no cluster ever had, and the caller says so in one line."""

    def __init__(
        self,
        js: Any,
        archive_dir: Path | None,
        *,
        stream_first: int,
        from_seq: int = 1,
        until_seq: int | None = None,
        until_time: datetime | None = None,
        label: str = "the stream",
        root: str = subjects.DEFAULT_ROOT,
    ) -> None:
        self.js = js
        self.archive_dir = archive_dir
        self.stream_first = stream_first
        self.from_seq = from_seq
        self.until_seq = until_seq
        self.label = f"{archive_dir} + {label}" if archive_dir is not None else label
        self.stats = Stats()
        self.unreadable: list[str] = []
        """Why each archive part skipped was not read."""
        self._cut = _Cut(self.stats, until_seq, until_time, root)
        self._stream = StreamSource(js, until_seq=until_seq, label=label, root=root)
        self._stream.stats = self.stats
        self._stream._cut = self._cut

    async def batches(self) -> AsyncIterator[list[Item]]:
        pos = self.from_seq
        if pos < self.stream_first:
            before = self.stream_first
            if self.until_seq is not None:
                before = min(before, self.until_seq + 1)
            held = archive.cover(self.archive_dir, pos, before)
            self.unreadable.extend(held.unreadable)
            for run in held.in_order():
                if isinstance(run, tuple):
                    self.stats.gaps.append(run)
                    continue
                async for out in self._part(run, pos):
                    yield out
                if self._cut.done:
                    return
            pos = self.stream_first
        if self.until_seq is not None and pos > self.until_seq:
            return
        self._stream.from_seq = pos
        async for out in self._stream.batches():
            yield out

    async def _part(self, part: archive.Part, pos: int) -> AsyncIterator[list[Item]]:
        chunk: list[tuple[int, str, bytes, int]] = []
        for seq, subject, line, _, stored_ns in bundle.entries(str(part.path)):
            if seq < pos:
                continue
            if seq >= self.stream_first or (self.until_seq is not None and seq > self.until_seq):
                break
            chunk.append((seq, subject, line, stored_ns))
            if len(chunk) >= BATCH:
                out = self._cut.take(chunk)
                chunk = []
                if out:
                    yield out
                if self._cut.done:
                    return
        if chunk:
            out = self._cut.take(chunk)
            if out:
                yield out
