"""The shell's clock and entropy: the wall-clock time and fresh event ids.

Used by every service and command that stamps an event. The core never calls these:
time is a parameter there, so a test or a replay passes the time it means.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

from schemas import ids


def utc_now() -> datetime:
    """Now, as an aware UTC time."""
    return datetime.now(UTC)


def new_id(now: datetime | None = None) -> str:
    """A fresh ULID for an event made at `now` (default: now)."""
    t = now if now is not None else utc_now()
    return ids.ulid(int(t.timestamp() * 1000), os.urandom(10))
