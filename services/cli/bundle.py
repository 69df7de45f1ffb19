"""Bundle lines for any stored message, and the stored message back from a line.

Called by `llmgw events export` and `import`. `schemas.bundle.line_for` writes a stored
body that is a JSON object; a log also holds what is not (garbage that the consumers
dead-letter), and a bundle must keep it at its sequence, or a re-import would shift
every sequence after it. Such a body is written as `{"seq":N,"subject":S,"body_b64":B}`:
the line stays valid JSON, replay sees an undecodable event at its position, and import
stores the very bytes again. This module does no I/O beyond reading the bundle file and
never judges whether an event is valid; that is the codec's job.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from schemas import bundle
from schemas.errors import BundleError

RAW_KEY = "body_b64"

_raw_json = msgspec.json.Decoder(msgspec.Raw)
_doc = msgspec.json.Decoder(dict[str, Any])
_encoder = msgspec.json.Encoder()
# _HEAD is the position `bundle.line_for` writes first on every line; reading it with a
# pattern keeps a line's bytes as they are (a re-parse would re-escape strings).
_HEAD = re.compile(rb'^\{"seq":(\d+),"subject":("(?:[^"\\]|\\.)*")')
_RAW_TAIL = re.compile(rb'^,"' + RAW_KEY.encode() + rb'":"([A-Za-z0-9+/=]*)"\}$')


def is_json_object(body: bytes) -> bool:
    """Whether `body` can follow the position on a line as it is: one JSON object, UTF-8,
    on one line."""
    if not body.lstrip().startswith(b"{") or b"\n" in body or b"\r" in body:
        return False
    try:
        _raw_json.decode(body)
        if not body.isascii():
            body.decode()
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False
    return True


def line(seq: int, subject: str, body: bytes) -> bytes:
    """The bundle line (without newline) for a stored message, whatever its body."""
    if is_json_object(body):
        return bundle.line_for(seq, subject, body)
    return raw_line(seq, subject, body)


def raw_line(seq: int, subject: str, body: bytes) -> bytes:
    """The line for a body kept as base64."""
    return b'{"seq":%d,"subject":%s,"%s":"%s"}' % (
        seq,
        _encoder.encode(subject),
        RAW_KEY.encode(),
        base64.b64encode(body),
    )


@dataclass(frozen=True, slots=True)
class Line:
    """One bundle line: its position, and the body to store for it."""

    seq: int
    subject: str
    body: bytes
    lineno: int


def _b64(text: bytes, name: str, lineno: int) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as e:
        raise BundleError(name, lineno, f"{RAW_KEY} is not base64 ({e})") from None


def _parse(raw: bytes, name: str, lineno: int) -> Line:
    m = _HEAD.match(raw)
    if m is not None:
        seq, subject = int(m[1]), json.loads(m[2])
        rest = raw[m.end() :]
        if rest == b"}":
            return Line(seq, subject, b"{}", lineno)
        r = _RAW_TAIL.match(rest)
        if r is not None:
            return Line(seq, subject, _b64(r[1], name, lineno), lineno)
        if rest.startswith(b","):
            # The inverse of line_for: the body's own fields followed the position.
            return Line(seq, subject, b"{" + rest[1:], lineno)
    # Written by something else (spaces, another key order): read it as JSON.
    try:
        doc = _doc.decode(raw)
    except msgspec.MsgspecError as e:
        raise BundleError(name, lineno, f"not a bundle line ({e})") from None
    seq, subject = doc.pop("seq", None), doc.pop("subject", None)
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(subject, str):
        raise BundleError(name, lineno, "a bundle line needs an integer seq and a subject")
    raw_body = doc.get(RAW_KEY)
    if isinstance(raw_body, str) and len(doc) == 1:
        return Line(seq, subject, _b64(raw_body.encode(), name, lineno), lineno)
    return Line(seq, subject, _encoder.encode(doc), lineno)


def read(path: str) -> Iterator[Line]:
    """The lines of a bundle in order; `BundleError` names FILE:LINE of a bad one."""
    last = 0
    with open(path, "rb") as fp:
        for lineno, raw in enumerate(fp, start=1):
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            rec = _parse(raw, path, lineno)
            if rec.seq < 1:
                raise BundleError(path, lineno, f"seq {rec.seq}: sequences start at 1")
            if rec.seq <= last:
                raise BundleError(path, lineno, f"seq {rec.seq} does not follow {last}")
            last = rec.seq
            yield rec
