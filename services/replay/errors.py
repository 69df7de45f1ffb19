"""Errors of the replay toolkit: one base class, data kept as fields.

Raised by `services.replay` and shown by the CLI as one line each (they are `CliError`s
there). This module does no I/O.
"""

from __future__ import annotations


class ReplayError(Exception):
    """Base of every error `services.replay` raises."""


class UnknownEntity(ReplayError):
    """A replica, model or node the log never mentions (up to the point replayed)."""

    def __init__(self, kind: str, name: str, hint: str = "") -> None:
        self.kind = kind
        self.name = name
        self.hint = hint
        super().__init__(f"no {kind} {name!r} in the log{hint}")


class Relist(ReplayError):
    """`from_seq` is older than the stream's first message: the changes in between are
    gone, so a follower must start again from a full listing (as a Kubernetes informer
    re-lists on 410 Gone). Subscribe again with `from_seq=None`."""

    def __init__(self, from_seq: int, first_seq: int, why: str = "") -> None:
        self.from_seq = from_seq
        self.first_seq = first_seq
        self.why = why
        super().__init__(
            why
            or f"seq {from_seq} is older than the stream's first message ({first_seq}): "
            "re-list from the current view"
        )


class ArchiveWriteError(ReplayError):
    """An archive file could not be written (a full or read-only disk): `path` names it,
    since the OS's own message for a failed write (ENOSPC) names no file."""

    def __init__(self, path: str, why: str) -> None:
        self.path = path
        self.why = why
        super().__init__(f"cannot write the archive file {path}: {why}")
