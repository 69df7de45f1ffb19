"""Errors of the projector: one base class, data kept as fields.

Raised by `services.projector` (store, service, snapshots); the CLI entry turns them
into one line for the user. This module does no I/O.
"""

from __future__ import annotations


class ProjectorError(Exception):
    """Base of every error `services.projector` raises."""


class StoreError(ProjectorError):
    """The stored view cannot be used as it is; the message says what to do."""


class LogHole(ProjectorError):
    """Stream message `seq` is gone from the log (deleted), so no view can be folded past
    it. Folding on would build a view no replay agrees with; an operator must restore the
    message (or the stream) first."""

    def __init__(self, seq: int, stream: str) -> None:
        self.seq = seq
        self.stream = stream
        super().__init__(
            f"message {seq} of stream {stream} is missing from the log (deleted?): "
            "the view cannot be folded past it; restore the stream from a backup"
        )
