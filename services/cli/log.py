"""`llmgw log compact`: bound the log. Events before a cut go to a compressed archive and
then off the stream; replay, `history` and `explain` read the archive and the stream as
one log.

Registered by `services.cli`. The order is the safety: a snapshot that covers the cut
exists (one is taken when none does), the archive part is written, synced and checked
against its checksum, the stream records where the archive is, and only then is the
stream purged. A crash anywhere before the purge leaves the log whole; a second run
writes the part again. Where to cut is `services.core.compaction`'s call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from services.cli import app as cli

if TYPE_CHECKING:
    from services.core.compaction import Cut
    from services.replay.archive import Part, Writer


def register(commands: cli.Commands) -> None:
    g = commands.group(
        "log",
        help="the event log itself: compact it",
        description="Commands on the event log as a whole.",
        epilog=cli.examples(
            "llmgw log compact --keep 30d --archive /var/lib/llmgw/archive",
            "llmgw log compact --before 1200000",
        ),
    )
    p = g.add(
        "compact",
        help="archive the events before a cut, then purge them from the stream",
        description=(
            "Move the events before a cut off the stream into an archive (compressed JSONL\n"
            "with a checksum, one file per compaction), so the stream stops growing forever.\n"
            "First a snapshot at or after the cut is made sure of (taken if missing), then\n"
            "the archive part is written and checked, then the stream is purged. Nothing is\n"
            "purged that no snapshot covers. Replay, history and explain read the archive\n"
            "and the stream as one log (the archive's directory is recorded on the stream;\n"
            "--archive or $LLMGW_ARCHIVE point elsewhere) and name any gap; `events export`\n"
            "writes the archive's events too.\n"
            "It says what it will archive and purge (the seqs, how many events, from when to\n"
            "when, where to) and asks first, unless --yes; not confirmed, it exits 5.\n"
            "A part is written as .writing-<pid>.jsonl.gz first: one that a killed run left\n"
            "is removed by the next. A write that fails (a full disk) names its file, and\n"
            "nothing is purged."
        ),
        epilog=cli.examples(
            "llmgw log compact --keep 30d",
            "llmgw log compact --before 1000000 --archive /srv/llmgw-archive",
            "llmgw log compact --keep 30d --yes          # from cron: no question",
        ),
        func=_compact,
    )
    cut = p.add_mutually_exclusive_group(required=True)
    cut.add_argument(
        "--before", type=cli.arg_seq, metavar="SEQ", help="archive and purge every seq below SEQ"
    )
    cut.add_argument(
        "--keep",
        type=cli.arg_time,
        metavar="AGE",
        help="keep the events stored in the last AGE (30d, 12h), archive the older ones",
    )
    p.add_argument(
        "--archive",
        metavar="DIR",
        help="the archive directory (default: the one recorded on the stream, else DATA/archive)",
    )
    p.add_argument(
        "-y", "--yes", action="store_true", help="do not ask before purging (for scripts, cron)"
    )


def _archive_dir(args: argparse.Namespace, metadata: dict[str, str] | None) -> Path:
    """--archive, $LLMGW_ARCHIVE, the stream's record, else DATA/archive; absolute, since
    the stream records it for replays run from anywhere."""
    from services.replay import archive

    where = archive.locate(args.archive, metadata) or (cli.data_dir(args) / "archive")
    return Path(os.path.abspath(where))


async def _compact(args: argparse.Namespace) -> int:
    from schemas import subjects
    from services.bus import snapshots, stream
    from services.core import compaction
    from services.core.view import SCHEMA
    from services.replay import archive, rebuild
    from services.replay.errors import ArchiveWriteError

    async with cli.session(args, "llmgw log compact") as s:
        info = await s.js.stream_info(subjects.STREAM)
        first, last = info.state.first_seq or 1, info.state.last_seq
        where = _archive_dir(args, info.config.metadata)
        before = args.before or await stream.first_stored_at(s.nc, args.keep, last)
        stored = [seq for schema, seq, _ in await snapshots.listing(s.js) if schema == SCHEMA]
        cut = compaction.plan(first, last, before, stored)
        if isinstance(cut, str):
            print(cut)
            return 0
        span = await _span(s, cut)
        cli.confirm(
            f"archive seq {cut.first}..{cut.before - 1} ({cut.count:,} "
            f"event{'' if cut.count == 1 else 's'}{span}) to {where} and purge them from "
            f"the stream, which then starts at seq {cut.before}?",
            args.yes,
            "nothing archived or purged",
        )
        # 1. A snapshot covers every event the cut removes.
        if cut.snapshot is None:
            got = await rebuild.from_stream(s.js, until_seq=cut.before - 1, root=s.root)
            if got.view.state.seq != cut.before - 1:
                raise cli.CliError(
                    f"could not fold the log to seq {cut.before - 1} for a snapshot "
                    f"(reached {got.view.state.seq}); nothing was purged"
                )
            name = await snapshots.save(s.js, got.view.state)
            print(f"saved snapshot {name} at seq {cut.before - 1}")
        else:
            print(f"snapshot at seq {cut.snapshot} covers the cut")
        # 2. The archive holds every event the cut removes, checked.
        try:
            writer = archive.Writer(where)
        except ArchiveWriteError as e:
            raise cli.CliError(f"{e}; nothing was purged") from None
        for gone in writer.swept:
            print(f"removed {gone}, left by a compaction that was stopped while writing")
        try:
            part = await _write_part(s, writer, cut)
        except ArchiveWriteError as e:
            raise cli.CliError(f"{e}; nothing was purged") from None
        why = archive.verify(part)
        if why:
            raise cli.CliError(f"the archive part just written is bad ({why}); nothing was purged")
        # 3. The stream says where its beginning went; then it lets it go.
        await stream.record(s.js, archive.METADATA_KEY, str(where))
        await s.js.purge_stream(subjects.STREAM, seq=cut.before)
    size = part.path.stat().st_size
    print(
        f"archived seq {cut.first}..{cut.before - 1} ({cut.count:,} event{'' if cut.count == 1 else 's'}, {size:,} bytes) "
        f"to {part.path}; the stream now starts at seq {cut.before}"
    )
    return 0


async def _span(s: cli.Session, cut: Cut) -> str:
    """`, stored 2026-10-01T00:00:00Z to 2026-11-01T12:00:00Z`: when the first and the
    last event the cut removes were stored; "" when the broker does not say."""
    from schemas import subjects
    from services.replay import render

    times = []
    for seq in (cut.first, cut.before - 1):
        with contextlib.suppress(Exception):
            msg = await s.js.get_msg(subjects.STREAM, seq)
            times.append(render.stamp(msg.time) if getattr(msg, "time", None) else None)
    if len(times) != 2 or None in times:
        return ""
    return f", stored {times[0]} to {times[1]}"


async def _write_part(s: cli.Session, writer: Writer, cut: Cut) -> Part:
    """Copy the cut's events from the stream into the archive part `writer` writes."""
    from services.bus import consume
    from services.core import ingest

    with writer:
        expect = cut.first
        async for batch in consume.read_range(s.js, cut.first, cut.before - 1):
            for d in batch:
                if d.seq != expect:
                    raise cli.CliError(
                        f"the stream is missing seq {expect} (read {d.seq}); nothing was purged"
                    )
                bound = d.time_ns if ingest.past_bound(d.data, d.time_ns) else 0
                writer.write(d.seq, d.subject, d.data, bound)
                expect += 1
        if expect != cut.before:
            raise cli.CliError(
                f"read the stream to seq {expect - 1}, not {cut.before - 1}; nothing was purged"
            )
        part = writer.finish()
    return part
