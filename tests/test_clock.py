"""A loop's pause until it is stopped (`services.clock.until`, `settle_after`): it ends
when the stop is set or when its time has passed, whichever is first, says which, and
makes no task of its own to end it (`asyncio.wait_for` made one, cancelled it and waited
for it at every pause of every loop that ticks, a gateway's at rest too)."""

from __future__ import annotations

import asyncio

import pytest

from services import clock

pytestmark = pytest.mark.timeout(30)


async def test_a_pause_ends_at_its_time_with_no_task_of_its_own() -> None:
    stop = asyncio.Event()
    seen: list[int] = []

    async def count_tasks() -> None:
        await asyncio.sleep(0)
        seen.append(len(asyncio.all_tasks()))

    counter = asyncio.create_task(count_tasks())
    assert await clock.until(stop, 0.01) is False
    await counter
    # This test's task and the counter's, no third one waiting on the event.
    assert seen == [2]


async def test_a_pause_ends_when_it_is_stopped_and_says_so() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.call_soon(stop.set)
    t0 = loop.time()
    assert await clock.until(stop, 60) is True
    assert loop.time() - t0 < 5
    assert await clock.until(stop, 60) is True  # set already: at once


async def test_a_pause_cancelled_from_outside_is_cancelled() -> None:
    """Its timer is not the only thing that may end it: a cancel of the task that waits
    reaches the task, as it would through `asyncio.wait_for`."""
    stop = asyncio.Event()
    task = asyncio.create_task(clock.until(stop, 60))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_future_settled_after_its_time_unless_it_was_first() -> None:
    loop = asyncio.get_running_loop()
    late = loop.create_future()
    clock.settle_after(0.01, late)
    assert await late is None
    early = loop.create_future()
    timer = clock.settle_after(60, early)
    early.set_result(None)
    timer.cancel()
    assert await early is None
