"""Errors of the projector: one base class, data kept as fields.

Raised by `services.projector` (store, service, snapshots); the CLI entry turns them
into one line for the user. This module does no I/O.
"""

from __future__ import annotations


class ProjectorError(Exception):
    """Base of every error `services.projector` raises."""


class StoreError(ProjectorError):
    """The stored view cannot be used as it is; the message says what to do."""
