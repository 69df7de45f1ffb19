"""`llmgw events`: tail, export, import and publish the event log.

Registered by `services.cli` (see its `COMMAND_MODULES`); each handler is a thin shell
over `services.bus` (connect, stream, publisher, ordered reads) and `schemas` (codec,
bundles). It must not interpret events beyond showing them: no folding, no decisions.

Choices a user relies on:
- `export` writes every stored message, garbage included (`schemas.bundle`), so
  sequences survive the round trip; `import` needs an empty stream and refuses anything
  else, so that order, ids and sequence numbers come back exactly as exported (a bundle
  that starts at seq 500 is stored from 500 again) and a re-export is byte-equal. It
  checks the whole file before it publishes anything: a bad line is reported as
  FILE:LINE and nothing is stored.
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
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import msgspec

from schemas import bundle, codec, subjects
from schemas.errors import BundleError, EventDecodeError
from schemas.events import EVENT_TYPES, Envelope, type_of
from schemas.names import TokenError
from services.cli import app as cli
from services.clock import new_id
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
    if have != sorted(subjects.stream_subjects(s.root)):
        raise cli.CliError(
            f"stream {subjects.STREAM} at {s.url} stores {', '.join(have)}, not the subjects "
            f"of root {s.root!r}: pass the matching --root"
        )
    return info


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
            "By default only new events are shown; --since starts earlier. Ctrl-C stops."
        ),
        epilog=cli.examples(
            "llmgw events tail",
            "llmgw events tail --since 1                 # the whole log, then live",
            "llmgw events tail --since 10m --type 'replica.*' --type node.lost",
            "llmgw events tail --since 2026-11-29T14:00:00Z --json > events.jsonl",
            "llmgw events tail --since 1 --count 100     # the first 100, then exit",
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
    p.add_argument(
        "--json",
        action="store_true",
        help="print each message as export writes it: its bundle line (the stored JSON with "
        "seq and subject in front)",
    )
    p.add_argument(
        "-n",
        "--count",
        type=int,
        metavar="N",
        help="exit after showing N events (undecodable messages count too)",
    )


def _type_filter(patterns: list[str]) -> Any:
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(t, pat) for t in EVENT_TYPES):
            raise cli.UsageError(
                f"--type: {pat!r} matches no event type; types: {', '.join(EVENT_TYPES)}"
            )
    wanted = frozenset(t for t in EVENT_TYPES if any(fnmatch.fnmatchcase(t, p) for p in patterns))
    return (lambda kind: kind in wanted) if patterns else (lambda kind: True)


async def _seq_at_time(js: Any, first: int, last: int, t: datetime) -> int:
    """The first stream sequence stored at or after `t` (last + 1 if none): a binary
    search over stored times, which only grow along the stream."""
    lo, hi = first, last + 1
    while lo < hi:
        mid = (lo + hi) // 2
        # next=True with subject `>` finds the first message at or after `mid`, stepping
        # over deleted sequences.
        msg = await js.get_msg(subjects.STREAM, seq=mid, subject=">", next=True)
        if msg.time is not None and msg.time >= t:
            hi = mid
        else:
            lo = (msg.seq or mid) + 1
    return lo


async def _tail(args: argparse.Namespace) -> int:
    from services.bus import consume

    show = _type_filter(args.types)
    if args.count is not None and args.count < 1:
        raise cli.UsageError(f"--count: must be 1 or more, got {args.count}")
    out = sys.stdout
    # It may run for days: what it logs (a lost connection) carries the time.
    cli.setup_logging()
    async with cli.session(args, "llmgw events tail") as s:
        info = await _event_stream(s, create=True)
        state = info.state
        since = args.since
        if since is None:
            start = state.last_seq + 1
        elif isinstance(since, int):
            start = since
        else:
            start = await _seq_at_time(s.js, state.first_seq, state.last_seq, since)
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
                if args.json:
                    lines.append(bundle.line(d.seq, d.subject, d.data).decode())
                elif event is None:
                    lines.append(_tail_bad(d, why))
                else:
                    lines.append(eventline.event_line(d.seq, event, d.subject, s.root))
                shown += 1
                if args.count is not None and shown >= args.count:
                    stop.set()
            if lines:
                out.write("\n".join(lines) + "\n")
                out.flush()

        await consume.read_ordered(s.js, from_seq=start, on_batch=on_batch, stop=stop)
    return 0


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
            'a JSON object is kept at its place as {"seq":N,"subject":S,"body_b64":RAW}.'
        ),
        epilog=cli.examples(
            "llmgw events export --out all.jsonl",
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
        help="first sequence (default: the first stored)",
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


class _TimeOnly(msgspec.Struct):
    time: datetime | None = None


_time_only = msgspec.json.Decoder(_TimeOnly)


def _event_time(body: bytes) -> datetime | None:
    try:
        t = _time_only.decode(body).time
    except msgspec.MsgspecError:
        return None
    return t if t is None or t.tzinfo is not None else None


async def _export(args: argparse.Namespace) -> int:
    from services.bus import consume

    if args.from_seq and args.until_seq and args.until_seq < args.from_seq:
        raise cli.UsageError(f"--until-seq {args.until_seq} is before --from-seq {args.from_seq}")
    to_stdout = args.out == "-"
    report = sys.stderr if to_stdout else sys.stdout
    async with cli.session(args, "llmgw events export") as s:
        info = await _event_stream(s, create=False)
        first = max(args.from_seq or 1, info.state.first_seq)
        last = (
            info.state.last_seq
            if args.until_seq is None
            else min(args.until_seq, info.state.last_seq)
        )
        total = max(last - first + 1, 0)
        progress = cli.Progress("exporting", total)
        raw = 0
        with _bundle_out(args.out) as fp:
            count, last_seq = 0, 0
            if total:
                async for batch in consume.read_range(s.js, first, last):
                    done = False
                    for d in batch:
                        if args.until_time is not None:
                            t = _event_time(d.data)
                            if t is not None and t > args.until_time:
                                done = True
                                break
                        if not bundle.inline(d.data):
                            raw += 1
                        fp.write(bundle.line(d.seq, d.subject, d.data) + b"\n")
                        count += 1
                        last_seq = d.seq
                    progress.advance(len(batch))
                    if done:
                        break
        progress.close()
    span = f" (seq {first}..{last_seq})" if count else ""
    where = "stdout" if to_stdout else args.out
    rate = count / max(progress.elapsed, 1e-9)
    kept = f", {raw:,} of them not JSON objects, kept as body_b64" if raw else ""
    print(
        f"exported {count:,} events{span}{kept} to {where} in {progress.elapsed:.1f}s "
        f"({rate:,.0f}/s)",
        file=report,
    )
    return 0


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
            "Publish a bundle's events into an EMPTY stream, in order, each with its id as\n"
            "Nats-Msg-Id and on its recorded subject, so the stream holds the same events\n"
            "at the same sequence numbers as the one exported (a bundle that starts at\n"
            "seq 500 is stored from 500), byte for byte: export it again and you get the\n"
            "same file.\n"
            "\n"
            "The whole file is checked first: every line must be a bundle line whose event\n"
            "decodes against the contract, whose subject is under --root, and whose seq\n"
            "follows the line before. The first bad line is reported as FILE:LINE and\n"
            "nothing is published. A stream that already holds events is refused (merging\n"
            "two logs would re-order history): import into a fresh broker, e.g.\n"
            "`llmgw up --data /tmp/incident` in another terminal."
        ),
        epilog=cli.examples(
            "llmgw events import incident.jsonl",
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


def _check_bundle(path: str, root: str, keep_invalid: bool, renumber: bool) -> tuple[int, int]:
    """(lines, first seq) after checking every line; raises naming FILE:LINE."""
    prefix = root + "."
    count, first, last = 0, 0, 0
    try:
        for rec in bundle.read(path):
            if not rec.subject.startswith(prefix):
                raise cli.CliError(
                    f"{path}:{rec.lineno}: subject {rec.subject!r} is not under root "
                    f"{root!r} (import with --root {rec.subject.split('.')[0]})"
                )
            if last and rec.seq != last + 1 and not renumber:
                raise cli.CliError(
                    f"{path}:{rec.lineno}: seq {rec.seq} follows {last}: a stream keeps no "
                    "gaps (its readers take one for lost events); --renumber stores the "
                    "lines one after another"
                )
            if not keep_invalid:
                try:
                    codec.decode(rec.body)
                except EventDecodeError as e:
                    raise cli.CliError(
                        f"{path}:{rec.lineno}: seq {rec.seq}: {e} "
                        "(--keep-invalid imports such lines as they are)"
                    ) from None
            first = first or rec.seq
            last = rec.seq
            count += 1
    except BundleError as e:
        raise cli.CliError(str(e)) from None
    except OSError as e:
        raise cli.CliError(f"{path}: {e.strerror}") from None
    return count, first


async def _import(args: argparse.Namespace) -> int:
    from services.bus.publish import Publisher

    root = cli.root(args)
    path = args.file
    total, first_seq = _check_bundle(path, root, args.keep_invalid, args.renumber)
    async with cli.session(args, "llmgw events import") as s:
        info = await _event_stream(s, create=True)
        st = info.state
        if st.messages:
            raise cli.CliError(
                f"stream {subjects.STREAM} at {s.url} already holds {st.messages:,} events "
                f"(seq {st.first_seq}..{st.last_seq}); import needs an empty stream: use a "
                "fresh broker (`llmgw up --data NEW_DIR` in another terminal)"
            )
        next_seq = st.last_seq + 1
        if first_seq > next_seq:
            # A bundle that starts past 1 (an export --from-seq): an empty stream can be
            # made to start at any sequence, so the bundle's sequences are kept.
            await s.js.purge_stream(subjects.STREAM, seq=first_seq)
            next_seq = first_seq
        elif first_seq and first_seq < next_seq and not args.renumber:
            raise cli.CliError(
                f"stream {subjects.STREAM} at {s.url} was used before (its next sequence is "
                f"{next_seq}), so the bundle cannot keep its sequences from {first_seq}: use "
                "a fresh broker, or --renumber"
            )
        publisher = Publisher(s.js, root)
        progress = cli.Progress("importing", total)
        first_stored = next_seq
        chunk: list[bundle.Line] = []
        for rec in bundle.read(path):
            chunk.append(rec)
            if len(chunk) >= IMPORT_CHUNK:
                next_seq = await _flush(publisher, chunk, path, next_seq, progress, args.renumber)
                chunk = []
        next_seq = await _flush(publisher, chunk, path, next_seq, progress, args.renumber)
        progress.close()
    if not progress.count:
        print(f"imported 0 events from {path} (an empty bundle)")
        return 0
    rate = progress.count / max(progress.elapsed, 1e-9)
    print(
        f"imported {progress.count:,} events from {path} into {s.url} "
        f"(seq {first_stored}..{next_seq - 1}) in {progress.elapsed:.1f}s ({rate:,.0f}/s)"
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
    items = [(r.subject, r.body, _body_id(r.body)) for r in chunk]
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


def _body_id(body: bytes) -> str | None:
    """The event id in a stored body, sent as Nats-Msg-Id as the original publish did."""
    try:
        value = _id_only.decode(body).id
    except msgspec.MsgspecError:
        return None
    return value if isinstance(value, str) and value else None


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
        now=datetime.now(UTC),
        id=args.id,
        causation=args.causation,
        correlation=args.correlation,
    )
    try:
        subject = subjects.subject_for(event, root, args.node)
    except (ValueError, TokenError) as e:
        raise cli.UsageError(f"--node: {e}") from None
    if args.node is not None:
        why = subjects.check(event, subject, root)
        if why:
            raise cli.UsageError(f"--node: {why}")
    async with cli.session(args, "llmgw events publish") as s:
        await _event_stream(s, create=True)
        out = await Publisher(s.js, root).publish(event, subject=subject)
    note = (
        "  (duplicate: an event with this id is already stored; nothing new)"
        if out.duplicate
        else ""
    )
    print(f"seq={out.seq} id={event.id} subject={out.subject}{note}")
    return 0
