"""The shell's clock and entropy: the wall-clock time, fresh event ids, and a loop's
pause until it is stopped.

Used by every service and command that stamps an event. The core never calls these:
time is a parameter there, so a test or a replay passes the time it means.
"""

from __future__ import annotations

import asyncio
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


async def until(stop: asyncio.Event, seconds: float) -> bool:
    """Until `stop` is set or `seconds` have passed, whichever comes first; whether
    `stop` is set. A timer on the event's own wait (`asyncio.timeout`): not
    `asyncio.wait_for`'s task, made, cancelled and waited for at every pause of a loop
    that ticks (a gateway's use reports, its heap's settling: several a second, at rest
    too)."""
    if not stop.is_set():
        try:
            async with asyncio.timeout(seconds):
                await stop.wait()
        except TimeoutError:
            pass
    return stop.is_set()


def settle_after(seconds: float, waiter: asyncio.Future[None]) -> asyncio.TimerHandle:
    """A timer that gives `waiter` its result after `seconds` (unless it has one): a
    wait on a future of one's own that ends at the latest then, with no task or
    cancellation (`asyncio.wait_for`'s) to end it. Cancel the timer once it is woken."""
    return asyncio.get_running_loop().call_later(seconds, _settle, waiter)


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
