"""`llmgw events`: tail, export, import and publish the event log.

Registered by `services.cli` (see its `COMMAND_MODULES`); each handler is a thin shell
over `services.bus` (connect, stream, publisher, ordered reads) and `schemas` (codec,
bundles). It must not interpret events beyond showing them: no folding, no decisions.

Choices a user relies on:
- `export` writes every stored message, garbage included (`schemas.bundle`), so
  sequences survive the round trip; `import` needs an empty stream, or one holding
  exactly the bundle's start (an import that stopped part way, renumbered or not: a
  retry resumes), and
  refuses anything else, so that order, ids and sequence numbers come back exactly as
  exported (a bundle that starts at seq 500 is stored from 500 again) and a re-export
  is byte-equal. It checks the whole file before it publishes anything (positions,
  order, gaps, each subject against the root and its event): a bad line is reported as
  FILE:LINE and nothing is stored.
- `export --out` never replaces a file without `--force`; `publish` checks model and
  node names against the live view, as the operator commands do.
- `export` writes to a temporary file beside the target and renames it at the end, so
  a bundle on disk is always complete. `--until-time` cuts at the first event whose own
  `time` is later (the cluster's clock, the same on a re-imported log), while
  `tail --since TIME` starts from what the broker stored since then.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import getpass
import json
import os
import sys
import textwrap
from collections.abc import AsyncIterator, Generator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, NamedTuple

import msgspec

from schemas import bundle, codec, subjects
from schemas.errors import BundleError, EventDecodeError
from schemas.events import EVENT_TYPES, Envelope, type_of
from schemas.names import TokenError
from services.cli import app as cli
from services.cli.output import add_output_option
from services.clock import new_id, utc_now
from services.core.ingest import claimed_time, past_bound
from services.core.view import encode_state
from services.replay import eventline

# IMPORT_CHUNK is how many records one pipelined publish_many call carries: enough to keep
# the broker busy, small enough that progress moves and memory stays flat on any bundle.
IMPORT_CHUNK = 2000


def register(commands: cli.Commands) -> None:
    events = commands.group(
        "events",
        help="watch, export, import and publish events on the log",
        description=(
            "The event log is the JetStream stream LLMGW: every fact and decision of the\n"
            "cluster, in order. These commands read and write it directly."
        ),
        epilog=cli.examples(
            "llmgw events tail --type 'replica.*'",
            "llmgw events export --out incident.jsonl --until-time 2026-11-29T14:05:00Z",
            "llmgw --nats nats://127.0.0.1:4333 events import incident.jsonl",
            'llmgw events publish scale.desired --data \'{"model": "llama-70b", "replicas": 2}\'',
        ),
    )
    _register_tail(events)
    _register_export(events)
    _register_import(events)
    _register_publish(events)


# ---------------------------------------------------------------------- shared


async def _event_stream(s: cli.Session, *, create: bool) -> Any:
    """The stream's info; created when `create` and missing. Refuses a stream that stores
    another root's subjects, rather than re-pointing it (and the running cluster) at ours."""
    from nats.js.errors import NotFoundError

    from services.bus import stream

    try:
        info = await s.js.stream_info(subjects.STREAM)
    except NotFoundError:
        if not create:
            raise cli.CliError(
                f"no event stream {subjects.STREAM} at {s.url}: nothing has been published "
                "there yet"
            ) from None
        return await stream.ensure_stream(s.js, s.root)
    have = sorted(info.config.subjects or [])
    want = sorted(stream.log_subjects(s.root, stream.fed_by_nodes(info, s.root)))
    if have != want and set(have) < set(want):
        # A stream made by an older llmgw for this root, before a subject was added (the
        # gateway's demand): it is ours, brought up to date when we are to write to it.
        return await stream.ensure_stream(s.js, s.root) if create else info
    if have != want:
        raise cli.CliError(
            f"stream {subjects.STREAM} at {s.url} stores {', '.join(have)}, not the subjects "
            f"of root {s.root!r}: pass the matching --root"
        )
    return info


# STREAM_WAIT_S is how often a tail looks again for a stream not made yet.
STREAM_WAIT_S = 1.0


async def _stream_made(s: cli.Session) -> bool:
    """Return once the event stream exists, said once while it does not; whether it had
    to wait. A tail reads and makes nothing: the stream is the plane's to make (`llmgw
    up`), with its limits, and a tail started first waits for it rather than make one."""
    import asyncio

    from nats.js.errors import NotFoundError

    said = False
    while True:
        try:
            await s.js.stream_info(subjects.STREAM)
            return said
        except NotFoundError:
            if not said:
                print(
                    f"{cli.PROG}: no event stream {subjects.STREAM} at {s.url} yet; waiting "
                    "for the plane (llmgw up) to make it",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
            await asyncio.sleep(STREAM_WAIT_S)


def _decode_or_reason(body: bytes) -> tuple[Envelope | None, str]:
    try:
        return codec.decode(body), ""
    except EventDecodeError as e:
        return None, str(e)


# ---------------------------------------------------------------------- tail


def _register_tail(events: cli.Commands) -> None:
    p = events.add(
        "tail",
        help="show events live, one line each",
        description=(
            "Show events as they are stored, one line each:\n"
            "  SEQ TIME TYPE KEY FIELDS...   e.g.\n"
            "    1042 14:00:01 replica.state      gpu-a1/r-7 llama-70b ready\n"
            "TIME is the event's own time (UTC). A message that is not a valid event is\n"
            "shown as (undecodable) with the reason; it never stops the tail.\n"
            "By default only new events are shown; --since starts earlier. Ctrl-C stops.\n"
            "On a stopped `llmgw up`'s data directory, --since reads its stored log to the\n"
            "end and exits.\n"
            "-o wide adds each event's id and causation (the event it reacted to); -o json\n"
            "(or --json) prints each as its bundle line; -o name `SEQ TYPE KEY`."
        ),
        epilog=cli.examples(
            "llmgw events tail",
            "llmgw events tail --since 1                 # the whole log, then live",
            "llmgw events tail --since 10m --type 'replica.*' --type node.lost",
            "llmgw events tail --since 2026-11-29T14:00:00Z --json > events.jsonl",
            "llmgw events tail --since 1 --count 100     # the first 100, then exit",
            "llmgw events tail --since 1 -o name         # SEQ TYPE KEY, for scripts",
            "llmgw events tail --since 10m -o wide       # with ids and causation",
        ),
        func=_tail,
    )
    p.add_argument(
        "--type",
        dest="types",
        action="append",
        metavar="T",
        default=[],
        help="show only events of type T (repeatable; shell patterns like 'replica.*' work; "
        "`llmgw events publish --help` lists the types)",
    )
    p.add_argument(
        "--since",
        type=cli.arg_seq_or_time,
        metavar="SEQ|TIME",
        help="start at stream sequence SEQ, or at what was stored since TIME "
        "(RFC3339 like 2026-11-29T14:00:00Z, or an age like 90s, 10m, 2h, 1d). "
        "Default: only events stored from now on",
    )
    add_output_option(
        p,
        TAIL_OUTPUTS,
        help="table (default: a line each), wide (a line each, with id= and cause=), "
        "json (its bundle line), name (`SEQ TYPE KEY`)",
        json_help="same as -o json: print each message as export writes it, its bundle "
        "line (the stored JSON with seq and subject in front)",
    )
    p.add_argument(
        "-n",
        "--count",
        type=int,
        metavar="N",
        help="exit after showing N events (undecodable messages count too)",
    )


TAIL_OUTPUTS = ("table", "wide", "json", "name")


def _type_filter(patterns: list[str]) -> Any:
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(t, pat) for t in EVENT_TYPES):
            raise cli.UsageError(
                f"--type: {pat!r} matches no event type; types: {', '.join(EVENT_TYPES)}"
            )
    wanted = frozenset(t for t in EVENT_TYPES if any(fnmatch.fnmatchcase(t, p) for p in patterns))
    return (lambda kind: kind in wanted) if patterns else (lambda kind: True)


async def _tail(args: argparse.Namespace) -> int:
    from services.bus import follow
    from services.bus.errors import StreamReplaced

    show = _type_filter(args.types)
    if args.count is not None and args.count < 1:
        raise cli.UsageError(f"--count: must be 1 or more, got {args.count}")
    out = sys.stdout
    # It may run for days: what it logs (a lost connection) carries the time.
    cli.setup_logging()
    from services.cli import offline

    # With --since, a stopped plane's stored log is read to its end (nothing more will
    # come); without, there is nothing to show but what a live plane stores next.
    opener = offline.session if args.since is not None else _live
    async with opener(args, "llmgw events tail") as opened:
        s = opened.session
        waited = False if opened.offline else await _stream_made(s)
        info = await _event_stream(s, create=False)
        state = info.state
        start = await _tail_start(args.since, s, waited, state.last_seq)
        shown = 0
        import asyncio

        stop = asyncio.Event()

        async def on_batch(batch: list[Any]) -> None:
            nonlocal shown
            lines = []
            for d in batch:
                if stop.is_set():
                    break
                event, why = _decode_or_reason(d.data)
                if event is not None and not show(type_of(type(event))):
                    continue
                lines.append(_tail_line(args.output, d, event, why, s.root))
                shown += 1
                if args.count is not None and shown >= args.count:
                    stop.set()
            if lines:
                out.write("\n".join(lines) + "\n")
                out.flush()

        # The follow loop, not a bare read: a broker that restarts, or a read that fails
        # while it is away, is a pause; a stream replaced under it is one line.
        seen = start - 1

        async def tail_batch(batch: list[Any]) -> None:
            nonlocal seen
            await on_batch(batch)
            seen = batch[-1].seq

        try:
            if opened.offline:
                from services.bus import consume

                if start <= state.last_seq:
                    async for batch in consume.read_range(s.js, start, state.last_seq):
                        await tail_batch(batch)
                        if stop.is_set():
                            break
            else:
                await follow.follow(
                    s.js, position=lambda: seen, on_batch=tail_batch, stop=stop, name="tail"
                )
        except StreamReplaced as e:
            raise cli.CliError(f"{e}: the tail stops here; start it again") from None
    return 0


async def _tail_start(since: Any, s: Any, waited: bool, last_seq: int) -> int:
    """The first seq the tail shows: `--since`'s (a seq, or the first stored at a time);
    without it, what the plane stores next (all of a stream made while it waited, which
    holds only what came after the tail began)."""
    from services.bus import stream

    if since is None:
        return 1 if waited else last_seq + 1
    if isinstance(since, int):
        return since
    return await stream.first_stored_at(s.nc, since, last_seq)


def _tail_line(output: str, d: Any, event: Any, why: str, root: str) -> str:
    """The tail's line for the message `d` (`event` decoded, or None and `why`), in the
    `-o` form asked for."""
    if output == "json":
        return bundle.line(d.seq, d.subject, d.data).decode()
    if output == "name":
        return _tail_name(d, event, root)
    if event is None:
        return _tail_bad(d, why)
    line = eventline.event_line(d.seq, event, d.subject, root)
    if output == "wide":
        line += f"  id={event.id} cause={event.causation or '-'}"
    return line


@contextlib.asynccontextmanager
async def _live(args: argparse.Namespace, name: str) -> AsyncIterator[Any]:
    """`offline.session`'s shape over the live broker alone."""
    from services.cli.offline import Opened

    async with cli.session(args, name) as s:
        yield Opened(s, s.url)


def _tail_name(d: Any, event: Any, root: str) -> str:
    """`-o name`: `SEQ TYPE KEY`, the KEY being what the event is about."""
    if event is None:
        return f"{d.seq} (undecodable) {d.subject}"
    key, _ = eventline.describe(event, d.subject, root)
    return f"{d.seq} {type_of(type(event))} {key or '-'}"


def _tail_bad(d: Any, why: str) -> str:
    # No time shown: the column is the event's own time, and this one has none.
    return eventline.undecodable_line(d.seq, d.subject, why)


# ---------------------------------------------------------------------- export


def _register_export(events: cli.Commands) -> None:
    p = events.add(
        "export",
        help="write the log (or a range of it) to a .jsonl bundle",
        description=(
            "Write stored events to a bundle: one JSON line each, the stored message with\n"
            "its stream `seq` and `subject` in front. The bundle replays offline and\n"
            "imports into an empty broker exactly (see `llmgw events import`).\n"
            "\n"
            "It streams (any size, flat memory) into a temporary file beside --out and\n"
            "renames it when done, so a bundle on disk is always whole. A progress bar\n"
            "shows on a terminal; a one-line summary at the end.\n"
            "\n"
            "--until-time cuts at the first event whose own `time` is later than T (the\n"
            "cluster's clock, which a re-imported log keeps). A stored message that is not\n"
            'a JSON object is kept at its place as {"seq":N,"subject":S,"body_b64":RAW}.\n'
            "\n"
            "A bundle replays as the log does. Of a compacted log (`llmgw log compact`) it\n"
            "holds the archive's events too, from seq 1 (the archive is found as replay\n"
            "finds it: --archive, $LLMGW_ARCHIVE, the stream's record). One that starts\n"
            "later (--from-seq N, or an archive that is gone) starts with a snapshot line,\n"
            "the view as it stood before its first event: the view at N-1, or the stored\n"
            "snapshot that covers where the stream starts, said in one line. With neither\n"
            "it is refused, naming the seqs missing; --allow-gaps writes what there is.\n"
            "A stopped `llmgw up`'s data directory is exported from its stored log."
        ),
        epilog=cli.examples(
            "llmgw events export --out all.jsonl",
            "llmgw events export --out all.jsonl --force     # replace it",
            "llmgw events export --out incident.jsonl --from-seq 9000 --until-seq 12000",
            "llmgw events export --out before.jsonl --until-time 2026-11-29T14:05:00Z",
            "llmgw events export --out - | gzip > all.jsonl.gz",
        ),
        func=_export,
    )
    p.add_argument(
        "--out", "-o", required=True, metavar="FILE", help="bundle to write ('-': stdout)"
    )
    p.add_argument(
        "--from-seq",
        type=cli.arg_seq,
        metavar="N",
        help="first sequence (default: 1, through the archive of a compacted log); past 1 "
        "the bundle starts with the view at N-1 as a snapshot line",
    )
    p.add_argument(
        "--until-seq",
        type=cli.arg_seq,
        metavar="N",
        help="last sequence, included (default: the last stored when the export starts)",
    )
    p.add_argument(
        "--until-time",
        type=cli.arg_time,
        metavar="T",
        help="stop before the first event whose time is after T (RFC3339 or an age like 10m)",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument(
        "--archive",
        metavar="DIR",
        help="where `llmgw log compact` put the events it took off the stream (default: "
        "$LLMGW_ARCHIVE, else the directory the stream records)",
    )
    p.add_argument(
        "--allow-gaps",
        action="store_true",
        help="when neither the archive nor a stored snapshot covers the start, export "
        "from where the stream starts (its readers then need --allow-gaps too)",
    )


async def _export(args: argparse.Namespace) -> int:
    from services.cli import offline

    if args.from_seq and args.until_seq and args.until_seq < args.from_seq:
        raise cli.UsageError(f"--until-seq {args.until_seq} is before --from-seq {args.from_seq}")
    to_stdout = args.out == "-"
    if not to_stdout:
        _check_out(args.out, args.force)
    report = sys.stderr if to_stdout else sys.stdout
    async with offline.session(args, "llmgw events export") as opened:
        s = opened.session
        info = await _event_stream(s, create=False)
        last = (
            info.state.last_seq
            if args.until_seq is None
            else min(args.until_seq, info.state.last_seq)
        )
        start = await _export_start(s, info, args, opened.where)
        first = start.first
        total = max(last - first + 1, 0)
        progress = cli.Progress("exporting", total)
        raw = 0
        with _bundle_out(args.out) as fp:
            count, last_seq = 0, 0
            if start.snapshot is not None:
                fp.write(bundle.snapshot_line(start.snapshot.seq, encode_state(start.snapshot)))
                fp.write(b"\n")
            if total:
                async for batch in _stored(s, start, first, last):
                    done = False
                    for seq, subject, body, bound in batch:
                        if args.until_time is not None:
                            t = claimed_time(body)
                            if t is not None and t > args.until_time:
                                done = True
                                break
                        if not bundle.inline(body):
                            raw += 1
                        fp.write(bundle.line(seq, subject, body, bound) + b"\n")
                        count += 1
                        last_seq = seq
                    progress.advance(len(batch))
                    if done:
                        break
        progress.close()
    span = f" (seq {first}..{last_seq})" if count else ""
    if start.snapshot is not None:
        span += f" after a snapshot of seq {start.snapshot.seq}"
    where = "stdout" if to_stdout else args.out
    rate = count / max(progress.elapsed, 1e-9)
    kept = f", {raw:,} of them not JSON objects, kept as body_b64" if raw else ""
    archived = f", seq {first}..{start.archived} from the archive" if start.archived else ""
    print(
        f"exported {_events(count)}{span}{archived}{kept} to {where} in "
        f"{progress.elapsed:.1f}s ({rate:,.0f}/s)",
        file=report,
    )
    return 0


class _Start(NamedTuple):
    """Where an export starts: its first seq, the snapshot of the seq before it (None
    when it starts at seq 1, or past a gap it was allowed), and the archive's parts it
    reads before the stream (`archived`: the last seq they give, 0 when none)."""

    first: int
    snapshot: Any
    parts: list[Any]
    archived: int


async def _export_start(s: cli.Session, info: Any, args: argparse.Namespace, where: str) -> _Start:
    """The start of the bundle, so that it replays as the log does: from seq 1 through
    the archive of a compacted log (found as `archive.locate` finds it); from --from-seq N
    with the view at N-1 folded in as its first line; else, when the archive does not
    hold the beginning, from the stored snapshot that covers what the stream still has,
    said in one line. Nothing covers it: a `CliError` naming the missing seqs, unless
    --allow-gaps (then the bundle starts where the stream does, and says nothing of
    what it misses: its readers will)."""
    from services.bus import snapshots
    from services.replay import archive, rebuild

    stream_first = info.state.first_seq or 1
    want = args.from_seq or 1
    if want > info.state.last_seq:
        return _Start(want, None, [], 0)  # past the end: nothing to export, nothing to cover
    directory = archive.locate(args.archive, info.config.metadata)
    held = archive.cover(directory, want, stream_first) if want < stream_first else None
    if held is None or not held.missing:
        parts = held.parts if held is not None else []
        archived = parts[-1].last if parts else 0
        if want == 1:
            return _Start(1, None, parts, archived)
        got = await rebuild.from_stream(
            s.js, until_seq=want - 1, label=where, root=s.root, archive_dir=directory
        )
        if not got.source.stats.gaps and got.seq == want - 1:
            return _Start(want, got.view.state, parts, archived)
        missing = got.source.stats.gaps[0] if got.source.stats.gaps else (got.seq + 1, want - 1)
    else:
        missing = held.missing[0]
    a, b = missing
    run = f"seq {a} is" if a == b else f"seqs {a}-{b} are"
    whys = f" ({'; '.join(held.unreadable)})" if held is not None and held.unreadable else ""
    found = (
        f"the archive {directory} does not hold them{whys}"
        if directory is not None
        else "no archive was found (--archive DIR)"
    )
    # The stored snapshot that covers what the stream still holds, past the request.
    for _, seq, _ in await snapshots.listing(s.js):
        if seq < max(want, stream_first) - 1:
            continue
        state = await snapshots.latest_at_or_before(s.js, seq)
        if state is not None and state.seq >= max(want, stream_first) - 1:
            print(
                f"{cli.PROG}: note: {run} not on the stream and {found}: the bundle starts "
                f"from the stored snapshot of seq {state.seq}",
                file=sys.stderr,
            )
            return _Start(state.seq + 1, state, [], 0)
    if args.allow_gaps:
        return _Start(max(want, stream_first), None, [], 0)
    raise cli.CliError(
        f"{run} not on the stream, {found}, and no stored snapshot covers them: a bundle "
        "without them would replay wrong; --allow-gaps exports what there is"
    )


async def _stored(
    s: cli.Session, start: _Start, first: int, last: int
) -> AsyncIterator[list[tuple[int, str, bytes, int]]]:
    """(seq, subject, body, stored ns when the body's time is past the bound, else 0) of
    every message `first..last`: the archive's parts first, then the stream."""
    from services.bus import consume

    pos = first
    for part in start.parts:
        chunk: list[tuple[int, str, bytes, int]] = []
        with contextlib.closing(_lines(str(part.path))) as lines:
            for rec in lines:
                if rec.seq < pos:
                    continue
                if rec.seq > last:
                    break
                chunk.append((rec.seq, rec.subject, rec.body, rec.stored_ns))
                if len(chunk) >= IMPORT_CHUNK:
                    yield chunk
                    chunk = []
        if chunk:
            yield chunk
        pos = part.last + 1
    if pos > last:
        return
    async for batch in consume.read_range(s.js, pos, last):
        yield [
            (d.seq, d.subject, d.data, d.time_ns if past_bound(d.data, d.time_ns) else 0)
            for d in batch
        ]


def _check_out(out: str, force: bool) -> None:
    """A bundle is never written over one already there by accident (replay's --db
    neither): before connecting, so a mistake costs nothing."""
    if os.path.isdir(out):
        raise cli.UsageError(f"--out: {out} is a directory")
    if os.path.lexists(out) and not force:
        raise cli.CliError(f"--out: {out} exists; pass --force to replace it")


@contextlib.contextmanager
def _bundle_out(out: str) -> Iterator[IO[bytes]]:
    """A binary file that becomes `out` only when the block finishes without error."""
    if out == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    target = Path(out)
    if target.is_dir():
        raise cli.UsageError(f"--out: {out} is a directory")
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        fp = open(tmp, "wb")  # noqa: SIM115 - closed below, before the rename
    except OSError as e:
        raise cli.CliError(f"--out: cannot write {out}: {e.strerror}") from None
    try:
        with fp:
            yield fp
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


# ---------------------------------------------------------------------- import


def _register_import(events: cli.Commands) -> None:
    p = events.add(
        "import",
        help="load a .jsonl bundle into an empty stream",
        description=(
            "Publish a bundle's events into an EMPTY stream, in order, each on its recorded\n"
            "subject (and with ID@SEQ as Nats-Msg-Id, so an id the log holds at two seqs is\n"
            "stored twice, as it was), so the stream holds the same events\n"
            "at the same sequence numbers as the one exported (a bundle that starts at\n"
            "seq 500 is stored from 500), byte for byte: export it again and you get the\n"
            "same file. A bundle that starts past seq 1 starts with the snapshot line\n"
            "export writes; without one the stream would lack its beginning, which every\n"
            "reader refuses, so it is refused (--allow-gaps imports it anyway).\n"
            "\n"
            "Import into a bare broker (`nats-server -js -sd NEW_DIR -p 4333`), not a\n"
            "running `llmgw up`: its scheduler would act on the incident's events.\n"
            "\n"
            "All or nothing: the whole file is checked first. Every line must be a bundle\n"
            "line whose seq follows the line before (no gaps) and whose subject the stream\n"
            "stores under --root, with an event that decodes against the contract and\n"
            "belongs on that subject (--keep-invalid lets bad events through as they are).\n"
            "The first bad line is reported as FILE:LINE and nothing is published.\n"
            "\n"
            "A stream that holds anything but this bundle's start is refused (merging two\n"
            "logs would re-order history). One that holds its start, byte for byte (an\n"
            "import that stopped part way, killed or cut off, --renumber or not), is\n"
            "resumed: run the same import again. A\n"
            "progress bar shows on a terminal; a one-line summary at the end."
        ),
        epilog=cli.examples(
            "llmgw events import incident.jsonl",
            "nats-server -js -sd /tmp/incident -p 4333 &     # a bare broker",
            "LLMGW_NATS=nats://127.0.0.1:4333 llmgw events import incident.jsonl",
            "llmgw events import raw-log.jsonl --keep-invalid   # garbage and all",
        ),
        func=_import,
    )
    p.add_argument("file", metavar="FILE.jsonl", help="the bundle to import")
    p.add_argument(
        "--renumber",
        action="store_true",
        help="store the lines one after another from the stream's next sequence, instead "
        "of at their own (for a filtered or hand-made bundle with gaps)",
    )
    p.add_argument(
        "--keep-invalid",
        action="store_true",
        help="import lines whose event does not decode as they are (a faithful copy of a "
        "log with bad messages on it, as export writes it)",
    )
    p.add_argument(
        "--allow-gaps",
        action="store_true",
        help="import a bundle that starts past seq 1 with no snapshot line (one `events "
        "export --allow-gaps` wrote) at its own seqs; its readers then need --allow-gaps too",
    )


# ADVICE is where an import belongs, said the same way by the help, the errors and the
# README: a bare broker, because a running `llmgw up` would act on the incident's events.
ADVICE = (
    "import into a bare broker (`nats-server -js -sd NEW_DIR -p 4333`, then "
    "--nats nats://127.0.0.1:4333), not a running `llmgw up`, whose scheduler would act on "
    "the incident's events"
)

# _STORED are the second tokens of the subjects the stream stores (`stream_subjects`).
_STORED = frozenset(x.split(".")[1] for x in subjects.stream_subjects("r"))


def _subject_problem(subject: str, root: str) -> str:
    """'' when the stream stores `subject` under `root`, else why not (a publish there
    would fail, or land outside the log)."""
    toks = subject.split(".")
    if toks[0] != root:
        return f"is not under root {root!r} (import with --root {toks[0]})"
    if any(not t or t in ("*", ">") or any(c.isspace() for c in t) for t in toks):
        return "is not a valid NATS subject (an empty token, a wildcard or a space)"
    if len(toks) < 3 or toks[1] not in _STORED:
        return f"is not one the stream {subjects.STREAM} stores"
    return ""


class _Checked(NamedTuple):
    lines: int
    first: int
    last: int
    snapshot: Any = None
    """The view of the snapshot the bundle starts with (`bundle.snapshot`), or None."""


def _check_bundle(
    path: str, root: str, keep_invalid: bool, renumber: bool, allow_gaps: bool = False
) -> _Checked:
    """The bundle's size and seqs after checking every line as import would publish it:
    its position and order (the reader), a subject the stream stores under `root`, no
    gap (unless `renumber`), a start at seq 1 or just after its snapshot (unless
    `renumber` or `allow_gaps`), and an event that decodes and belongs on its subject
    (unless `keep_invalid`). Raises naming FILE:LINE, before anything is published."""
    count, first, last = 0, 0, 0
    progress = cli.Progress("checking", None)
    snapshot = None
    try:
        snapshot = _snapshot_of(path)
        last = snapshot.seq if snapshot is not None else 0
        for rec in bundle.read(path):
            where = f"{path}:{rec.lineno}: seq {rec.seq}"
            if not count and not last and rec.seq > 1 and not (renumber or allow_gaps):
                raise cli.CliError(_beginning_missing(path, rec.lineno, rec.seq))
            why = _subject_problem(rec.subject, root)
            if why:
                raise cli.CliError(f"{where}: subject {rec.subject!r} {why}")
            if last and rec.seq != last + 1 and not renumber:
                raise cli.CliError(
                    f"{path}:{rec.lineno}: {bundle.missing(last, rec.seq)}: a stream keeps "
                    "no gaps (its readers take one for lost events); --renumber stores the "
                    "lines one after another"
                )
            if not keep_invalid:
                try:
                    event = codec.decode(rec.body)
                except EventDecodeError as e:
                    raise cli.CliError(
                        f"{where}: {e} (--keep-invalid imports such lines as they are)"
                    ) from None
                why = subjects.check(event, rec.subject, root) or ""
                if why:
                    raise cli.CliError(
                        f"{where}: subject {rec.subject!r}: {why} (consumers would "
                        "dead-letter it; --keep-invalid imports such lines as they are)"
                    )
            first = first or rec.seq
            last = rec.seq
            count += 1
            if not count % 1000:
                progress.advance(1000)
    except BundleError as e:
        raise cli.CliError(str(e)) from None
    except IsADirectoryError:
        raise cli.CliError(f"{path}: is a directory, not a bundle") from None
    except OSError as e:
        raise cli.CliError(f"{path}: {e.strerror or e}") from None
    finally:
        progress.close()
    return _Checked(count, first, last, snapshot)


def _beginning_missing(path: str, lineno: int, seq: int) -> str:
    """Why a bundle that starts past seq 1 with no snapshot line is not imported: the
    stream would start there with nothing to fold its events onto, and every reader of
    it (`up`, replay, status) refuses such a log."""
    run = "seq 1 is" if seq == 2 else f"seqs 1-{seq - 1} are"
    return (
        f"{path}:{lineno}: the bundle starts at seq {seq} with no snapshot: {run} missing, "
        "and a stream without its beginning is refused by every reader (export it whole, "
        "or from a snapshot: `llmgw events export --from-seq N`); --allow-gaps imports it "
        "as it is, --renumber from the stream's next seq"
    )


def _snapshot_of(path: str) -> Any:
    """The view state of the snapshot a bundle starts with, or None; a `BundleError` for
    one this version cannot read."""
    from services.core.view import SCHEMA, decode_state

    head = bundle.snapshot(path)
    if head is None:
        return None
    try:
        state = decode_state(head[1])
    except msgspec.MsgspecError as e:
        raise BundleError(path, 1, f"the snapshot does not decode as a view ({e})") from None
    if state.schema != SCHEMA:
        raise BundleError(
            path, 1, f"the snapshot is of view schema {state.schema}; this llmgw reads {SCHEMA}"
        )
    if state.seq != head[0]:
        raise BundleError(
            path, 1, f"the snapshot line says seq {head[0]}, its view is of seq {state.seq}"
        )
    return state


async def _already_stored(
    s: cli.Session, st: Any, path: str, checked: _Checked, renumber: bool
) -> int:
    """How many of the bundle's first lines a used stream already holds, exactly (an
    import that stopped part way, or one run twice); a `CliError` when it holds anything
    else, so that a retry resumes and two logs are never merged. With `renumber` the
    lines were stored one after another from wherever the stream stood, so only their
    subjects and bodies are compared, not their seqs."""
    from services.bus import consume

    held = f"stream {subjects.STREAM} at {s.url} already holds {_events(st.messages)} "
    held += f"(seq {st.first_seq}..{st.last_seq})"
    if (
        st.messages != st.last_seq - st.first_seq + 1
        or st.messages > checked.lines
        or (not renumber and (st.first_seq != checked.first or st.last_seq > checked.last))
    ):
        raise cli.CliError(f"{held}, not the start of {path}: {ADVICE}")
    with contextlib.closing(_lines(path)) as lines:
        async for batch in consume.read_range(s.js, st.first_seq, st.last_seq):
            for d in batch:
                rec = next(lines)
                seq = d.seq if renumber else rec.seq
                if (d.seq, d.subject, d.data) != (seq, rec.subject, rec.body):
                    raise cli.CliError(
                        f"{held}, and seq {d.seq} differs from {path}:{rec.lineno}: it is "
                        f"not this bundle's start; {ADVICE}"
                    )
    return int(st.messages)


def _lines(path: str) -> Generator[bundle.Line]:
    yield from bundle.read(path)


async def _import(args: argparse.Namespace) -> int:
    from services.bus.errors import BusError
    from services.bus.publish import Publisher

    root = cli.root(args)
    path = args.file
    checked = _check_bundle(path, root, args.keep_invalid, args.renumber, args.allow_gaps)
    total, first_seq = checked.lines, checked.first
    done = 0
    async with cli.session(args, "llmgw events import") as s:
        info = await _event_stream(s, create=True)
        st = info.state
        if st.messages:
            # A retry of an import that stopped part way (renumbered or not): what is
            # there must be this bundle's start, byte for byte; the rest follows it.
            done = await _already_stored(s, st, path, checked, args.renumber)
            if done == total:
                print(
                    f"nothing to import: {s.url} already holds all {total:,} events of "
                    f"{path} (seq {checked.first}..{checked.last})"
                )
                return 0
        next_seq = st.last_seq + 1
        if not done and first_seq > next_seq and not args.renumber:
            # A bundle that starts past 1 (an export --from-seq): an empty stream can be
            # made to start at any sequence, so the bundle's sequences are kept. Renumbered,
            # the lines go from the stream's next sequence, as --renumber says: a stream
            # started past 1 would have no snapshot of its beginning (none is saved then).
            await s.js.purge_stream(subjects.STREAM, seq=first_seq)
            next_seq = first_seq
        elif not done and first_seq and first_seq < next_seq and not args.renumber:
            raise cli.CliError(
                f"stream {subjects.STREAM} at {s.url} was used before (its next sequence is "
                f"{next_seq}), so the bundle cannot keep its sequences from {first_seq}: "
                f"{ADVICE}; or --renumber"
            )
        if checked.snapshot is not None and not args.renumber:
            # The view before the bundle's first event, where the stream's replays start.
            from services.bus import snapshots

            await snapshots.save(s.js, checked.snapshot)
        publisher = Publisher(s.js, root)
        progress = cli.Progress("importing", total - done)
        first_stored = next_seq
        chunk: list[bundle.Line] = []
        try:
            with contextlib.closing(_lines(path)) as lines:
                for i, rec in enumerate(lines):
                    if i < done:
                        continue
                    chunk.append(rec)
                    if len(chunk) >= IMPORT_CHUNK:
                        next_seq = await _flush(
                            publisher, chunk, path, next_seq, progress, args.renumber
                        )
                        chunk = []
            next_seq = await _flush(publisher, chunk, path, next_seq, progress, args.renumber)
        except BusError as e:
            raise cli.CliError(
                f"{e}; {done + progress.count:,} of {_events(total)} are stored: run the same "
                "import again to go on from there"
            ) from None
        finally:
            progress.close()
    if not progress.count:
        print(f"imported 0 events from {path} (an empty bundle)")
        return 0
    rate = progress.count / max(progress.elapsed, 1e-9)
    resumed = f", after the {done:,} an earlier import stored" if done else ""
    print(
        f"imported {_events(progress.count)} from {path} into {s.url} "
        f"(seq {first_stored}..{next_seq - 1}{resumed}) in {progress.elapsed:.1f}s "
        f"({rate:,.0f}/s)"
    )
    return 0


async def _flush(
    publisher: Any,
    chunk: list[bundle.Line],
    path: str,
    next_seq: int,
    progress: cli.Progress,
    renumber: bool,
) -> int:
    """Publish `chunk` pipelined; check each landed where the bundle says it was."""
    if not chunk:
        return next_seq
    items = [(r.subject, r.body, _msg_id(r)) for r in chunk]
    acks = await publisher.publish_many(items)
    for i, (rec, ack) in enumerate(zip(chunk, acks, strict=True)):
        want = next_seq + i if renumber else rec.seq
        if ack.duplicate or ack.seq != want:
            what = (
                "dropped as a duplicate of an earlier line's id"
                if ack.duplicate
                else f"stored at {ack.seq}, not {want}"
            )
            raise cli.CliError(
                f"{path}:{rec.lineno}: seq {rec.seq} was {what}; the stream no longer matches "
                "the bundle from here on"
            )
    progress.advance(len(chunk))
    return int(acks[-1].seq) + 1


class _IdOnly(msgspec.Struct):
    id: Any = None


_id_only = msgspec.json.Decoder(_IdOnly)


def _msg_id(rec: bundle.Line) -> str:
    """The Nats-Msg-Id a line is imported with: its event id with its bundle seq.

    Not the bare id, as the original publish sent: a log may hold one id at two seqs
    (published again after the broker's duplicate window, or by hand with --id), and a
    faithful copy must store both, where the bare id would drop the second as a
    duplicate in the middle of the import. A bundle's seqs never repeat, so the key is
    one per line, and a line re-sent by the publish path's retry is still a duplicate."""
    try:
        value = _id_only.decode(rec.body).id
    except (msgspec.MsgspecError, RecursionError):
        value = None
    return f"{value}@{rec.seq}" if isinstance(value, str) and value else f"@{rec.seq}"


# ---------------------------------------------------------------------- publish


def _register_publish(events: cli.Commands) -> None:
    p = events.add(
        "publish",
        help="publish one event, checked against the contract",
        description=(
            "Publish one event of TYPE. --data is the event's `data` object as JSON; it is\n"
            "checked exactly as a consumer would decode it (missing fields, wrong types,\n"
            "unknown values), and defaults are filled in. The envelope is made here: a new\n"
            "time-ordered id (ULID), time = now (UTC), source = --source.\n"
            "The subject follows from the event (docs/contract.md has every type, field,\n"
            "range and subject); replica events and replica.drain need --node.\n"
            "Model and node names are checked against the cluster as the log has it now,\n"
            "as `llmgw scale` does: a model's alias is published as the model it names, and\n"
            "an unknown model or node is refused with the closest known name (--force\n"
            "publishes it as typed). model.declared and node.inventory bring new names.\n"
            "Prints the stream sequence and the id.\n"
            "Here --data is the event's data; the global --data DIR goes before the\n"
            "command: `llmgw --data DIR events publish ...`.\n"
            "\n" + textwrap.fill("Types: " + ", ".join(EVENT_TYPES), 84)
        ),
        epilog=cli.examples(
            'llmgw events publish scale.desired --data \'{"model": "llama-70b", "replicas": 3}\'',
            "llmgw events publish model.declared --data @llama.json",
            'llmgw events publish node.cordoned --data \'{"node": "gpu-a1"}\' --source ops/alice',
            "llmgw events publish replica.used --node gpu-a1 \\",
            '    --data \'{"replica": "r-7", "at": "2026-11-29T14:00:00Z"}\'',
        ),
        func=_publish,
        own_flags=("--data",),
    )
    p.add_argument("type", metavar="TYPE", help="the event type, e.g. model.declared")
    p.add_argument(
        "--data",
        required=True,
        metavar="JSON",
        help="the event's data object as JSON; @FILE reads it from a file, - from stdin",
    )
    p.add_argument("--source", metavar="S", help="who publishes (default cli/<user>)")
    p.add_argument("--node", metavar="N", help="the reporting / target node, for replica.* events")
    p.add_argument("--causation", metavar="ID", help="id of the event this one reacts to")
    p.add_argument("--correlation", metavar="ID", help="id of the first event of the chain")
    p.add_argument(
        "--id",
        metavar="ID",
        help="use this id instead of a new one (publishing it again within the duplicate "
        "window stores nothing)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="publish model and node names as typed, even ones the cluster does not know",
    )


def _read_data(spec: str) -> bytes:
    if spec == "-":
        return sys.stdin.buffer.read()
    if spec.startswith("@"):
        try:
            return Path(spec[1:]).read_bytes()
        except OSError as e:
            raise cli.UsageError(f"--data: cannot read {spec[1:]}: {e.strerror}") from None
    return spec.encode()


def _default_source() -> str:
    try:
        return f"cli/{getpass.getuser()}"
    except (OSError, KeyError):
        return "cli"


def build_event(
    kind: str,
    data_json: bytes,
    *,
    source: str,
    now: datetime,
    id: str | None = None,
    causation: str | None = None,
    correlation: str | None = None,
) -> Envelope:
    """The event `llmgw events publish` would publish; `UsageError` naming the flag."""
    if kind not in EVENT_TYPES:
        raise cli.UsageError(f"TYPE: unknown event type {kind!r}; known: {', '.join(EVENT_TYPES)}")
    try:
        data = json.loads(data_json)
    except (ValueError, UnicodeDecodeError) as e:
        raise cli.UsageError(f"--data: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise cli.UsageError(f"--data: must be a JSON object, got {type(data).__name__}")
    envelope: dict[str, Any] = {
        "id": id or new_id(now),
        "type": kind,
        "time": now.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "source": source,
        "causation": causation,
        "correlation": correlation,
        "data": data,
    }
    # Invariant: what publish accepts is what every consumer decodes, so the check is the
    # consumers' own decoder on the whole envelope, not a looser conversion.
    try:
        return codec.decode(json.dumps(envelope).encode())
    except EventDecodeError as e:
        flag = "--data" if (e.path or "").startswith("$.data") else "envelope"
        where = f"field {e.path}: " if e.path else ""
        raise cli.UsageError(f"{flag}: {where}{e.why}") from None


async def _publish(args: argparse.Namespace) -> int:
    from services.bus.publish import Publisher

    root = cli.root(args)
    raw = _read_data(args.data)
    event = build_event(
        args.type,
        raw,
        source=args.source or _default_source(),
        now=utc_now(),
        id=args.id,
        causation=args.causation,
        correlation=args.correlation,
    )
    _subject(event, root, args.node)  # the flags' mistakes, before any connection
    async with cli.session(args, "llmgw events publish") as s:
        await _event_stream(s, create=True)
        renamed: list[str] = []
        if not args.force:
            view = await _live_view(s)
            event, renamed = known_names(event, view, args.node)
        subject = _subject(event, root, args.node)
        out = await Publisher(s.js, root).publish(event, subject=subject)
    note = (
        "  (duplicate: an event with this id is already stored; nothing new)"
        if out.duplicate
        else ""
    )
    print(f"seq={out.seq} id={event.id} subject={out.subject}{note}")
    for line in renamed:
        print(f"  {line}")
    return 0


def _subject(event: Envelope, root: str, node: str | None) -> str:
    try:
        subject = subjects.subject_for(event, root, node)
    except (ValueError, TokenError) as e:
        raise cli.UsageError(f"--node: {e}") from None
    if node is not None:
        why = subjects.check(event, subject, root)
        if why:
            raise cli.UsageError(f"--node: {why}")
    return subject


async def _live_view(s: cli.Session) -> Any:
    """The view the log gives now, to check the names typed against."""
    from services.replay import rebuild
    from services.replay.errors import ReplayError

    try:
        got = await rebuild.from_stream(s.js, label=s.url, root=s.root)
    except ReplayError as e:
        raise cli.CliError(f"cannot read the cluster's state to check names: {e}") from None
    return got.view


# _NEW_NAMES are the events that bring names into the cluster: nothing to check them by.
_NEW_NAMES = frozenset({"model.declared", "node.inventory"})


def known_names(event: Envelope, view: Any, node: str | None) -> tuple[Envelope, list[str]]:
    """`event` with every model alias in its data replaced by the model it names, and
    what was replaced; a `CliError` with "did you mean" for a model or node name the view
    does not know (`--force` skips this). Checked: the data's `model`, `for_model`,
    `node` and its shards' nodes (`name` of model.removed), and `--node`."""
    from services import names

    kind = type_of(type(event))
    data: Any = event.data  # type: ignore[attr-defined]
    if kind in _NEW_NAMES:
        return event, []
    models = view.state.models
    nodes = view.state.nodes
    changes: dict[str, Any] = {}
    renamed: list[str] = []
    fields = ("name",) if kind == "model.removed" else ("model", "for_model")
    for f in fields:
        name = getattr(data, f, None)
        if not isinstance(name, str) or not name:
            continue
        m = view.catalog.resolve(name)
        if m is None:
            hint = names.did_you_mean(name, names.model_names(models))
            raise cli.NotFound(
                f"--data: {f} {name!r}: unknown model{hint} (no model of that name or alias "
                "is declared; --force publishes it as typed)"
            )
        if m.name != name:
            changes[f] = m.name
            renamed.append(f"{f}: {name} is an alias of {m.name}; published as {m.name}")
    typed = [("--node", node)] if node is not None else []
    if isinstance(getattr(data, "node", None), str):
        typed.append(("--data: node", data.node))
    typed += [("--data: shards", sh.node) for sh in getattr(data, "shards", ())]
    for where, n in typed:
        if n not in nodes:
            hint = names.did_you_mean(n, nodes)
            raise cli.NotFound(
                f"{where} {n!r}: unknown node{hint} (no node of that name has reported; "
                "--force publishes it as typed)"
            )
    if not changes:
        return event, []
    return msgspec.structs.replace(
        event,
        data=msgspec.structs.replace(data, **changes),
    ), renamed


def _events(n: int) -> str:
    """`1 event`, `1,200 events`."""
    return f"{n:,} event{'' if n == 1 else 's'}"
