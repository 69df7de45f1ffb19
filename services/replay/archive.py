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

A part is written as `.writing-<pid>.jsonl.gz` (and its checksum as
`.writing-<pid>.sha256`), locked while it is written; one whose lock is free is what a
killed compaction left, and the next `Writer` removes it (`sweep`). A write that fails
(a full disk) is an `ArchiveWriteError` naming the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from schemas import bundle
from services.replay.errors import ArchiveWriteError

ENV_ARCHIVE = "LLMGW_ARCHIVE"

# METADATA_KEY is the stream metadata entry naming the archive directory, set by each
# compaction: the log itself says where its beginning went.
METADATA_KEY = "llmgw.archive"

SUM_SUFFIX = ".sha256"
_PART = re.compile(r"^llmgw-(\d{12})-(\d{12})\.jsonl\.gz$")
_WRITING = re.compile(r"^\.writing-(\d+)\.(jsonl\.gz|sha256)$")


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


@dataclass(frozen=True, slots=True)
class Cover:
    """What the archive holds of a run of seqs: the parts to read, in log order, and the
    runs (first, last) no readable part holds, with why each unreadable part was not."""

    parts: list[Part]
    missing: list[tuple[int, int]]
    unreadable: list[str]

    def in_order(self) -> list[Part | tuple[int, int]]:
        """The parts and the missing runs as one list, in log order."""
        return sorted(
            [*self.parts, *self.missing], key=lambda x: x.first if isinstance(x, Part) else x[0]
        )


def cover(directory: Path | None, first: int, before: int) -> Cover:
    """What `directory` (None: no archive found) holds of seqs `first..before-1`: each
    part is checked against its checksum (`verify`), and one that fails is a missing run."""
    out = Cover([], [], [])
    pos = first
    for part in parts(directory) if directory is not None else []:
        if part.last < pos:
            continue
        if part.first >= before:
            break
        if part.first > pos:
            out.missing.append((pos, part.first - 1))
        why = verify(part)
        if why:
            out.unreadable.append(why)
            out.missing.append((max(pos, part.first), min(part.last, before - 1)))
        else:
            out.parts.append(part)
        pos = part.last + 1
    if pos < before:
        out.missing.append((pos, before - 1))
    return out


def locate(explicit: str | Path | None, metadata: dict[str, str] | None) -> Path | None:
    """The archive directory: given, else $LLMGW_ARCHIVE, else the stream's record."""
    where = explicit or os.environ.get(ENV_ARCHIVE) or (metadata or {}).get(METADATA_KEY)
    return Path(where).expanduser() if where else None


def sweep(directory: Path) -> list[Path]:
    """Remove the temporary files of compactions that died writing (kill -9, a crash);
    returns them. A part being written is locked by its writer, so a live one is left
    alone, whatever its pid (pids are reused)."""
    if not directory.is_dir():
        return []
    found = sorted(p for p in directory.iterdir() if _WRITING.match(p.name))
    live = set()
    for p in found:
        if not p.name.endswith(".jsonl.gz"):
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.add(_WRITING.match(p.name)[1])  # type: ignore[index]
        finally:
            os.close(fd)
    gone = []
    for p in found:
        if _WRITING.match(p.name)[1] in live:  # type: ignore[index]
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            gone.append(p)
    return gone


class Writer:
    """Writes one part: lines in log order, then `finish()` compresses, checksums, syncs
    and renames it into place; a part is never seen half written. What a killed writer
    left behind is removed first (`sweep`, in `swept`). Every failed write is an
    `ArchiveWriteError` naming its file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._tmp = directory / f".writing-{os.getpid()}.jsonl.gz"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.swept = sweep(directory)
            self._raw: IO[bytes] = self._tmp.open("wb")
        except OSError as e:
            raise ArchiveWriteError(str(e.filename or directory), e.strerror or str(e)) from e
        # Invariant: locked for the life of the file, so `sweep` knows a live writer's.
        fcntl.flock(self._raw.fileno(), fcntl.LOCK_EX)
        self._gz = gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=6, mtime=0)
        self.first = 0
        self.last = 0
        self.count = 0

    def write(self, seq: int, subject: str, body: bytes, stored_ns: int = 0) -> None:
        if self.last and seq <= self.last:
            raise ValueError(f"seq {seq} does not follow {self.last}")
        with self._failing(self._tmp):
            self._gz.write(bundle.line(seq, subject, body, stored_ns) + b"\n")
        self.first = self.first or seq
        self.last = seq
        self.count += 1

    @contextlib.contextmanager
    def _failing(self, path: Path) -> Iterator[None]:
        """An OSError of a write (ENOSPC has no file name) as one naming `path`."""
        try:
            yield
        except OSError as e:
            raise ArchiveWriteError(str(path), e.strerror or str(e)) from e

    def finish(self) -> Part:
        """Close, sync, checksum and name the part; returns it."""
        if not self.count:
            raise ValueError("an archive part needs at least one event")
        with self._failing(self._tmp):
            self._gz.close()
            self._raw.flush()
            os.fsync(self._raw.fileno())
        path = self.directory / part_name(self.first, self.last)
        sums = path.with_name(path.name + SUM_SUFFIX)
        tmp_sums = self.directory / f".writing-{os.getpid()}{SUM_SUFFIX}"
        with self._failing(tmp_sums), tmp_sums.open("w") as fp:
            fp.write(f"{sha256_of(self._tmp)}  {path.name}\n")
            fp.flush()
            os.fsync(fp.fileno())
        with self._failing(path):
            os.replace(self._tmp, path)
            os.replace(tmp_sums, sums)
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._raw.close()
        return Part(self.first, self.last, path)

    def abort(self) -> None:
        for f in (self._gz, self._raw):
            with contextlib.suppress(OSError):
                f.close()
        for leftover in (self._tmp, self.directory / f".writing-{os.getpid()}{SUM_SUFFIX}"):
            with contextlib.suppress(OSError):
                leftover.unlink()

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
