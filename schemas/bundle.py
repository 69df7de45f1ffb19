"""JSONL bundles: one event a line, each an envelope plus `seq` and `subject`.

Written by `llmgw events export`, read by import, replay and the offline tools. Reading
and writing stream line by line, so a bundle of any size never sits in memory. A line is
the stored message body with `seq` and `subject` put in front, byte for byte otherwise,
so export -> import -> export gives the same file.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import msgspec

from schemas.errors import BundleError


class _Position(msgspec.Struct):
    seq: int
    subject: str


_position = msgspec.json.Decoder(_Position)
_strip = msgspec.json.Decoder(dict[str, Any])
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Record:
    """One line of a bundle. `line` is the whole line; it decodes as the event itself,
    since the envelope decoder ignores the extra `seq` and `subject`."""

    seq: int
    subject: str
    line: bytes
    lineno: int

    def body(self) -> bytes:
        """The message body as it was stored on the stream (without seq and subject)."""
        doc = _strip.decode(self.line)
        doc.pop("seq", None)
        doc.pop("subject", None)
        return _encoder.encode(doc)


def line_for(seq: int, subject: str, body: bytes) -> bytes:
    """The bundle line for a stored message (its body a JSON object), without newline."""
    head = b'{"seq":%d,"subject":%s' % (seq, _encoder.encode(subject))
    rest = body.lstrip()
    if not rest.startswith(b"{"):
        raise ValueError("a bundle line's body must be a JSON object")
    rest = rest[1:].lstrip()
    return head + (b"}" if rest.startswith(b"}") else b"," + rest)


class Writer:
    """Appends lines to an open binary file."""

    def __init__(self, fp: IO[bytes]) -> None:
        self._fp = fp
        self.count = 0
        self.last_seq = 0

    def write(self, seq: int, subject: str, body: bytes) -> None:
        self._fp.write(line_for(seq, subject, body) + b"\n")
        self.count += 1
        self.last_seq = seq


def read(path: str) -> Iterator[Record]:
    """The records of a bundle file in order; `BundleError` names the line of a bad one."""
    with open(path, "rb") as fp:
        yield from read_lines(fp, path)


def read_lines(fp: IO[bytes], name: str = "<bundle>") -> Iterator[Record]:
    last = 0
    for lineno, line in enumerate(fp, start=1):
        line = line.rstrip(b"\r\n")
        if not line.strip():
            continue
        try:
            pos = _position.decode(line)
        except msgspec.MsgspecError as e:
            raise BundleError(name, lineno, f"not a bundle line ({e})") from e
        if pos.seq <= last:
            raise BundleError(name, lineno, f"seq {pos.seq} does not follow {last}")
        last = pos.seq
        yield Record(pos.seq, pos.subject, line, lineno)
