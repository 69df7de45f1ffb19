"""Helpers for the scheduler and lease tests: polling with a deadline, never sleeping
to let time pass."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta


async def eventually(
    cond: Callable[[], bool | Awaitable[bool]], within: float = 5.0, every: float = 0.02
) -> float:
    """Poll `cond()` until it is true; the seconds it took. Fails past `within`."""
    t0 = time.monotonic()
    while True:
        r = cond()
        if inspect.isawaitable(r):
            r = await r
        if r:
            return time.monotonic() - t0
        if time.monotonic() - t0 > within:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(every)


class Clock:
    """A scheduler's two clocks, moved only by the test: the wall clock a pass decides at
    (and stamps its events with), starting at the real time now, and the monotonic one it
    times heartbeats by. `advance` moves both."""

    def __init__(self) -> None:
        self._start = datetime.now(UTC)
        self.elapsed = 0.0

    def wall(self) -> datetime:
        return self._start + timedelta(seconds=self.elapsed)

    def monotonic(self) -> float:
        return 1000.0 + self.elapsed

    def advance(self, seconds: float) -> None:
        self.elapsed += seconds
