"""The archive: the events `llmgw log compact` took off the stream, kept as compressed
bundles in one directory, each with its checksum.

Written by `services.cli.log` (compact) through `Writer`; read by `services.replay.source`
(`LogSource`), which replays the archive and the stream as one log. A part is
`llmgw-<first>-<last>.jsonl.gz` (the sequences it holds, 12 digits, so the names sort in
log order) beside `<part>.sha256` (sha256sum's format). A part without a checksum, or
whose bytes do not match it, is not read: replay names it as a gap instead of folding
events nobody can vouch for.

Where it is: `--archive DIR`, else $LLMGW_ARCHIVE, else the directory the last
compaction recorded in the stream's metadata (`METADATA_KEY`).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from schemas import bundle

ENV_ARCHIVE = "LLMGW_ARCHIVE"

# METADATA_KEY is the stream metadata entry naming the archive directory, set by each
# compaction: the log itself says where its beginning went.
METADATA_KEY = "llmgw.archive"

SUM_SUFFIX = ".sha256"
_PART = re.compile(r"^llmgw-(\d{12})-(\d{12})\.jsonl\.gz$")


@dataclass(frozen=True, slots=True)
class Part:
    """One archive file holding sequences `first..last`."""

    first: int
    last: int
    path: Path


def part_name(first: int, last: int) -> str:
    return f"llmgw-{first:012d}-{last:012d}.jsonl.gz"


def parts(directory: Path) -> list[Part]:
    """The parts in `directory`, in log order; none when it does not exist."""
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        m = _PART.match(p.name)
        if m is not None:
            out.append(Part(int(m[1]), int(m[2]), p))
    out.sort(key=lambda x: x.first)
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fp:
        for chunk in iter(lambda: fp.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(part: Part) -> str:
    """'' when the part's bytes match its checksum, else why not."""
    sums = part.path.with_name(part.path.name + SUM_SUFFIX)
    try:
        want = sums.read_text().split()[0]
    except (OSError, IndexError):
        return f"{part.path.name} has no checksum ({sums.name})"
    if sha256_of(part.path) != want:
        return f"{part.path.name} does not match its checksum"
    return ""


def locate(explicit: str | Path | None, metadata: dict[str, str] | None) -> Path | None:
    """The archive directory: given, else $LLMGW_ARCHIVE, else the stream's record."""
    where = explicit or os.environ.get(ENV_ARCHIVE) or (metadata or {}).get(METADATA_KEY)
    return Path(where).expanduser() if where else None


class Writer:
    """Writes one part: lines in log order, then `finish()` compresses, checksums, syncs
    and renames it into place; a part is never seen half written."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._tmp = directory / f".writing-{os.getpid()}.jsonl.gz"
        self._raw: IO[bytes] = self._tmp.open("wb")
        self._gz = gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=6, mtime=0)
        self.first = 0
        self.last = 0
        self.count = 0

    def write(self, seq: int, subject: str, body: bytes, stored_ns: int = 0) -> None:
        if self.last and seq <= self.last:
            raise ValueError(f"seq {seq} does not follow {self.last}")
        self._gz.write(bundle.line(seq, subject, body, stored_ns) + b"\n")
        self.first = self.first or seq
        self.last = seq
        self.count += 1

    def finish(self) -> Part:
        """Close, sync, checksum and name the part; returns it."""
        if not self.count:
            raise ValueError("an archive part needs at least one event")
        self._gz.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        path = self.directory / part_name(self.first, self.last)
        sums = path.with_name(path.name + SUM_SUFFIX)
        tmp_sums = self.directory / f".writing-{os.getpid()}{SUM_SUFFIX}"
        with tmp_sums.open("w") as fp:
            fp.write(f"{sha256_of(self._tmp)}  {path.name}\n")
            fp.flush()
            os.fsync(fp.fileno())
        os.replace(self._tmp, path)
        os.replace(tmp_sums, sums)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return Part(self.first, self.last, path)

    def abort(self) -> None:
        for f in (self._gz, self._raw):
            f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.abort()
