"""Helpers for the scheduler and lease tests: polling with a deadline, never sleeping
to let time pass."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


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
