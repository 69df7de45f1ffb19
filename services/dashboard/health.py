"""The log's health, for the dashboard: its last sequence, the projector's lag in events
and seconds, the dead letters per consumer, and whether the plane runs (`plane`, from
`services.plane.liveness`: who leads, the projector's last commit, the `up` of the data
directory), which the page shows as a banner when it does not.

Called by the dashboard's server every few seconds; what it returns is shown on the page
and exported as metrics. The projector's position is read from its SQLite view
(`db_path`), read-only; without one the lag is unknown (None), never guessed.
It must not write anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections import deque
from pathlib import Path
from typing import Any

import nats.errors
from nats.js.errors import NotFoundError

from schemas import subjects
from services.bus import DLQ_STREAM
from services.clock import utc_now
from services.plane import liveness

# LOCK_WAIT_S bounds the wait for the projector's lock; past it the lag is unknown
# until the next check.
LOCK_WAIT_S = 1.0


def _projector_seq(db: Path) -> int | None:
    """The projector's position, or None. Runs in a thread: the projector may hold the
    database's lock, and waiting for it on the event loop would stall everything that
    shares the loop (in `llmgw up`, the projector itself)."""
    if not db.exists():
        return None
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=LOCK_WAIT_S)
        ) as c:
            row = c.execute("SELECT seq FROM position WHERE id = 1").fetchone()
    except sqlite3.Error:
        return None
    return int(row[0]) if row else 0


async def check(js: Any, db_path: Path | None, root: str = subjects.DEFAULT_ROOT) -> dict[str, Any]:
    """`{"last_seq", "projector": {"seq", "lag_events", "lag_s"} | None, "dead_letters",
    "plane"}`; an empty dict when the broker does not answer. The view `db_path` is the
    one in an `llmgw up` data directory (its parent), whose `up` the plane is judged by."""
    try:
        info = await js.stream_info(subjects.STREAM)
        last = info.state.last_seq
        out: dict[str, Any] = {"last_seq": last, "projector": None}
        at = await asyncio.to_thread(_projector_seq, db_path) if db_path is not None else None
        if at is not None:
            lag_s = 0.0
            if at < last:
                newest = await js.get_msg(subjects.STREAM, last)
                oldest = await js.get_msg(subjects.STREAM, at + 1)
                if newest.time is not None and oldest.time is not None:
                    lag_s = max((newest.time - oldest.time).total_seconds(), 0.0)
            out["projector"] = {
                "seq": at,
                "lag_events": max(last - at, 0),
                "lag_s": round(lag_s, 3),
            }
        dead: dict[str, int] = {}
        with contextlib.suppress(NotFoundError):
            dlq = await js.stream_info(DLQ_STREAM, subjects_filter=">")
            for subject, n in (dlq.state.subjects or {}).items():
                dead[subject.rsplit(".", 1)[-1]] = n
        out["dead_letters"] = dict(sorted(dead.items()))
        out["plane"] = await liveness.check(
            js,
            root,
            utc_now(),
            time.time(),
            data=None if db_path is None else db_path.parent,
            db=db_path,
            projector=out["projector"],
        )
        return out
    except (nats.errors.Error, TimeoutError, NotFoundError):
        return {}


def growth(
    seen: deque[tuple[float, dict[str, int]]],
    now: float,
    dead: dict[str, int],
    window_s: float,
) -> dict[str, int]:
    """Per consumer, the dead letters added within the last `window_s` seconds: `dead`
    (the counts at `now`, monotonic seconds) less the oldest counts kept in `seen`, which
    this appends to and trims to the window. A count that fell (the dead letters were
    purged) is no growth."""
    seen.append((now, dict(dead)))
    while len(seen) > 1 and seen[0][0] < now - window_s:
        seen.popleft()
    first = seen[0][1]
    return {c: n - first.get(c, 0) for c, n in sorted(dead.items()) if n > first.get(c, 0)}
