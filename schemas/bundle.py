"""JSONL bundles: one stored message a line, its stream `seq` and `subject` in front.

The one reader and writer of bundles: `llmgw events export` writes with `line` (the
simulator with `event_line`, the same line for a body the codec wrote), and import,
replay (`services.replay.source`) and `llmgw preemption plan` read with `read`, so no two
of them can disagree about a line. Reading streams line by line, so a bundle of any size
never sits in memory. Pure: no I/O beyond the bundle file, and it never judges whether a
body is a valid event; that is the codec's job.

Two shapes of line, both one JSON document on one UTF-8 line:
- `{"seq":N,"subject":S,...}`: a body that is a compact JSON object (every event the
  codec writes) follows the position with its own fields, byte for byte, so the line
  decodes as the event itself and export -> import -> export gives the same file;
- `{"seq":N,"subject":S,"body_b64":B}`: any other body (garbage the consumers
  dead-letter, a body with newlines, or one that would read back otherwise), as base64.
  A log keeps such a message at its sequence, and so must a bundle, or a re-import would
  shift every sequence after it.
Lines written by other tools (spaces, another key order) are read as JSON documents.

A bundle that does not start at seq 1 starts with a snapshot line,
`{"snapshot":{"seq":S,"view":{...}}}`: the view as it stood after seq S (the canonical
`ViewState` JSON), so the lines after it fold onto what the log did before them. It is
only ever the first line; `read` and `entries` pass over it, `snapshot` reads it. A
bundle that starts after seq 1 without one is missing its beginning, and its readers
say so (`services.replay.source`).

A bundle may be gzip-compressed (the archive `llmgw log compact` writes is): every reader
here opens one as it opens a plain one, by its first bytes, whatever its name.
"""

from __future__ import annotations

import base64
import gzip
import re
import zlib
from collections.abc import Iterator
from typing import IO, Any, NamedTuple, cast

import msgspec

from schemas.errors import BundleError
from schemas.events import MAX_SEQ

RAW_KEY = "body_b64"
# STORED_KEY marks a line whose event claims a time past the broker's bound (see
# `services.core.ingest.MAX_SKEW`): it keeps when the broker stored the message, in ns,
# so a replay of the bundle bounds the event's time exactly as the live view did. Such a
# line is always written in the body_b64 form. Honest events never need it, so a bundle
# of an honest log is byte for byte what the stream holds.
STORED_KEY = "stored_ns"


class _Probe(msgspec.Struct):
    """The fields of a body that would read back as part of the position."""

    seq: Any = msgspec.UNSET
    subject: Any = msgspec.UNSET
    body_b64: Any = msgspec.UNSET


_probe = msgspec.json.Decoder(_Probe)
_doc = msgspec.json.Decoder(dict[str, Any])
_str = msgspec.json.Decoder(str)
_encoder = msgspec.json.Encoder()

# _HEAD is the position `line` writes first on every line. Read with a pattern, not a
# parse, so the body after it keeps its bytes (a re-encode would re-escape strings) and a
# line costs no more than the event's own decode. The subject may hold JSON escapes.
_HEAD = re.compile(rb'\{"seq":(\d+),"subject":("[^"\\]*(?:\\.[^"\\]*)*")')


class Line(NamedTuple):
    """One bundle line: its position, the stored body exactly, and where it was read."""

    seq: int
    subject: str
    body: bytes
    lineno: int
    stored_ns: int = 0
    """Its STORED_KEY, 0 when it has none: `line(seq, subject, body, stored_ns)` writes
    the line again."""


# SNAPSHOT_KEY is the one key of a bundle's first line when it carries a snapshot.
SNAPSHOT_KEY = "snapshot"
_SNAPSHOT_HEAD = b'{"%s":' % SNAPSHOT_KEY.encode()


class _SnapshotBody(msgspec.Struct):
    seq: int
    view: msgspec.Raw


class _SnapshotLine(msgspec.Struct):
    snapshot: _SnapshotBody


_snapshot_line = msgspec.json.Decoder(_SnapshotLine)


def snapshot_line(seq: int, view: bytes) -> bytes:
    """The first line (without newline) of a bundle that starts after `seq`: `view` is
    the canonical JSON of the view as it stood after `seq`."""
    return b'{"%s":{"seq":%d,"view":%s}}' % (SNAPSHOT_KEY.encode(), seq, view)


def snapshot(path: str) -> tuple[int, bytes] | None:
    """(seq, view JSON) of the snapshot a bundle starts with, or None when it has none;
    `BundleError` for a first line that claims to be one and is not."""
    with open_bundle(path) as fp:
        for lineno, raw in _numbered(fp, path):
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            if not raw.startswith(_SNAPSHOT_HEAD):
                return None
            try:
                got = _snapshot_line.decode(raw).snapshot
            except (msgspec.MsgspecError, RecursionError) as e:
                raise BundleError(path, lineno, f"not a snapshot line ({e})") from None
            why = seq_problem(got.seq)
            if why:
                raise BundleError(path, lineno, f"snapshot {why}")
            return got.seq, bytes(got.view)
    return None


# ---------------------------------------------------------------------- writing


def inline(body: bytes) -> bool:
    """Whether `body` is written after the position as it is: one compact JSON object
    (`{"` or `{}` first, `}` last), UTF-8, on one line, that reads back as itself."""
    if body[:1] != b"{" or body[1:2] not in (b'"', b"}") or body[-1:] != b"}":
        return False
    if b"\n" in body or b"\r" in body:
        return False
    try:
        p = _probe.decode(body)
        if not body.isascii():
            body.decode()
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return False
    # Invariant: a line has one seq, one subject and no body_b64 beside a body's fields;
    # a body with its own would read back otherwise.
    return p.seq is msgspec.UNSET and p.subject is msgspec.UNSET and p.body_b64 is msgspec.UNSET


def line(seq: int, subject: str, body: bytes, stored_ns: int = 0) -> bytes:
    """The bundle line (without newline) for a stored message, whatever its body;
    `stored_ns` only for a message whose time the broker's clock bounds (STORED_KEY)."""
    head = b'{"seq":%d,"subject":%s' % (seq, _encoder.encode(subject))
    if stored_ns:
        return b'%s,"%s":"%s","%s":%d}' % (
            head,
            RAW_KEY.encode(),
            base64.b64encode(body),
            STORED_KEY.encode(),
            stored_ns,
        )
    if not inline(body):
        return b'%s,"%s":"%s"}' % (head, RAW_KEY.encode(), base64.b64encode(body))
    return _inlined(head, body)


def event_line(seq: int, subject: str, body: bytes) -> bytes:
    """`line` of a body `schemas.codec.encode` wrote, without `inline`'s parse of it (the
    simulator writes every event it makes): such a body is always inline, being compact
    UTF-8 JSON of one envelope, an object whose fields (`type`, `id`, `time`, `source`,
    `causation`, `correlation`, `data`) are none of a line's position.

    The subject's JSON is kept per subject (`_SUBJECT_JSON`: a log's subjects repeat, one
    per node and replica), and the line is one format of the body's slice: its bytes
    copied twice, not three times (a preemption decision's body runs to kilobytes)."""
    if body[1] == 0x7D:  # b"}": the body is `{}`
        return _inlined(b'{"seq":%d,"subject":%s' % (seq, _encoder.encode(subject)), body)
    head = _SUBJECT_JSON.get(subject)
    if head is None:
        if len(_SUBJECT_JSON) >= _SUBJECT_CACHE_MAX:
            _SUBJECT_JSON.clear()
        head = _SUBJECT_JSON[subject] = b',"subject":%s,' % _encoder.encode(subject)
    return b'{"seq":%d%s%s' % (seq, head, body[1:])


# _SUBJECT_JSON is `,"subject":S,` of each subject `event_line` wrote lately, up to
# _SUBJECT_CACHE_MAX of them (then begun again).
_SUBJECT_JSON: dict[str, bytes] = {}
_SUBJECT_CACHE_MAX = 1 << 16


def _inlined(head: bytes, body: bytes) -> bytes:
    """The line of an inline body: the position, then the body's own fields."""
    if body[1:2] == b"}":
        return head + body[1:]
    return head + b"," + body[1:]


# ---------------------------------------------------------------------- reading


class _Position(msgspec.Struct):
    seq: int
    subject: str
    body_b64: Any = None
    stored_ns: Any = 0


_position = msgspec.json.Decoder(_Position)


GZIP_MAGIC = b"\x1f\x8b"


def open_bundle(path: str) -> IO[bytes]:
    """A bundle file opened for reading, through gzip when it is compressed."""
    fp = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
    if fp.read(2) == GZIP_MAGIC:
        fp.close()
        return cast("IO[bytes]", gzip.open(path, "rb"))
    fp.seek(0)
    return fp


def read(path: str) -> Iterator[Line]:
    """The lines of a bundle file in order, with their exact stored bodies (import);
    `BundleError` names FILE:LINE of a bad one."""
    with open_bundle(path) as fp:
        yield from read_lines(fp, path)


def read_lines(fp: IO[bytes], name: str = "<bundle>") -> Iterator[Line]:
    """`read` of an open binary file; `name` is the FILE of error messages."""
    return cast("Iterator[Line]", _scan(fp, name, True))


def records(path: str) -> Iterator[tuple[int, str, bytes]]:
    """(seq, subject, data) of each line of a bundle file, where `data` decodes exactly as
    the stored body does: the line itself when the body is inline (the envelope decoder
    skips `seq` and `subject`), which spares a copy a line (replay); else the body."""
    for seq, subject, data, _, _ in entries(path):
        yield seq, subject, data


def entries(path: str) -> Iterator[tuple[int, str, bytes, int, int]]:
    """`records` with each line's number and its STORED_KEY (0 when it has none):
    (seq, subject, data, lineno, stored_ns)."""
    with open_bundle(path) as fp:
        yield from _scan(fp, path, False)


def missing(before: int, seq: int) -> str:
    """What a gap between two lines' sequences means, in words: `seqs 301-310 are missing
    (the log has a gap)`. A bundle is a run of the log, so a sequence that does not follow
    the line before is events lost, not skipped on purpose."""
    if seq == before + 2:
        return f"seq {before + 1} is missing (the log has a gap)"
    return f"seqs {before + 1}-{seq - 1} are missing (the log has a gap)"


def seq_problem(seq: object) -> str:
    """'' when `seq` is a valid stream sequence (an integer from 1 to MAX_SEQ), else why
    not: past 2^53 no JSON reader is sure to read the number back exactly."""
    if isinstance(seq, bool) or not isinstance(seq, int):
        return f"seq {_shown(seq)} is not a positive integer"
    if seq < 1:
        return f"seq {seq}: sequences start at 1"
    if seq > MAX_SEQ:
        return f"seq {seq} is past the largest sequence a bundle can hold (2^53)"
    return ""


def _shown(value: object) -> str:
    text = _encoder.encode(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def _scan(fp: IO[bytes], name: str, exact: bool) -> Iterator[tuple[Any, ...]]:
    """Each line as a `Line` with the exact body (`exact`), else as (seq, subject, data,
    lineno).

    A line without a position, or whose sequence does not rise, is a broken bundle: no
    sequence after it can be trusted. A line whose body is not a valid event is not: the
    codec judges that where the line is used (replay skips it at its sequence, import
    refuses it unless told to keep it)."""
    last = 0
    decode = _position.decode
    first = True
    for lineno, raw in _numbered(fp, name):
        raw = raw.rstrip(b"\r\n")
        stored = 0
        if first and raw.strip():
            first = False
            if raw.startswith(_SNAPSHOT_HEAD):
                continue  # the snapshot the bundle starts from: `snapshot` reads it
        try:
            pos = decode(raw)
        except (msgspec.MsgspecError, RecursionError) as e:
            if not raw.strip():
                continue
            # Not JSON after all: a position in front still places it (as an undecodable
            # event); nothing in front is a broken bundle.
            m = _HEAD.match(raw)
            if m is not None:
                seq, subject = int(m[1]), _str.decode(m[2])
                data = _body_after(raw, m.end()) if exact else raw
            elif raw.lstrip()[:1] == b"{":
                # A JSON document whose position is not the shape `line` writes (a seq
                # that is not an integer, keys in another order): `_parse` says which.
                seq, subject, data = _parse(raw, name, lineno)
            else:
                raise BundleError(name, lineno, f"not a bundle line ({e})") from None
        else:
            seq, subject, data = pos.seq, pos.subject, raw
            if pos.body_b64 is not None:
                seq, subject, data = _parse(raw, name, lineno)
                stored = pos.stored_ns if type(pos.stored_ns) is int else 0
            elif exact:
                m = _HEAD.match(raw)
                if m is not None and raw[m.end() : m.end() + 1] in (b",", b"}"):
                    data = _body_after(raw, m.end())
                else:  # written by something else (spaces, another key order)
                    seq, subject, data = _parse(raw, name, lineno)
        if seq <= last or seq > MAX_SEQ:
            why = seq_problem(seq)
            raise BundleError(name, lineno, why or f"seq {seq} does not follow {last}")
        last = seq
        yield (
            Line(seq, subject, data, lineno, stored)
            if exact
            else (seq, subject, data, lineno, stored)
        )


def _numbered(fp: IO[bytes], name: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of an open bundle; a `BundleError` at the line where a gzip
    bundle breaks off (an archive cut short by a full disk or a copy that stopped), which
    the gzip reader raises as EOFError or a zlib error, not as a line."""
    lineno = 0
    try:
        for lineno, raw in enumerate(fp, start=1):
            yield lineno, raw
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise BundleError(
            name, lineno + 1, f"the compressed bundle is cut short or corrupt ({e})"
        ) from None


def _body_after(raw: bytes, end: int) -> bytes:
    """The inline body of a line whose position ends at `end`: `line` undone."""
    return b"{" + (raw[end + 1 :] if raw[end : end + 1] == b"," else raw[end:])


def _parse(raw: bytes, name: str, lineno: int) -> tuple[int, str, bytes]:
    """(seq, subject, body) of a line read as one JSON document: a body_b64 line, or one
    written by something else."""
    try:
        doc = _doc.decode(raw)
    except (msgspec.MsgspecError, RecursionError) as e:
        raise BundleError(name, lineno, f"not a bundle line ({e})") from None
    if "seq" not in doc:
        raise BundleError(name, lineno, "not a bundle line (it has no seq)")
    seq, subject = doc.pop("seq"), doc.pop("subject", None)
    why = seq_problem(seq)
    if why:
        integer = isinstance(seq, int) and not isinstance(seq, bool)
        raise BundleError(name, lineno, why if integer else f"not a bundle line: {why}")
    if not isinstance(subject, str):
        raise BundleError(name, lineno, "not a bundle line (it needs a subject)")
    raw_body = doc.get(RAW_KEY)
    if isinstance(raw_body, str) and set(doc) <= {RAW_KEY, STORED_KEY}:
        try:
            return seq, subject, base64.b64decode(raw_body, validate=True)
        except ValueError as e:
            raise BundleError(name, lineno, f"{RAW_KEY} is not base64 ({e})") from None
    return seq, subject, _encoder.encode(doc)
