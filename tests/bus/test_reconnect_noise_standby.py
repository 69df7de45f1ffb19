"""A standby says it stands by, naming the leader, once; and says when it takes over.

Two `Leader`s of one role on a real broker, with a short lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest

from services.bus import EmbeddedBroker, connect
from services.plane.leader import Leader

pytestmark = pytest.mark.timeout(30)

TTL_S = 0.6


async def until(cond: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within:g}s")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def leading(url: str, holder: str) -> AsyncIterator[tuple[Leader, asyncio.Event]]:
    nc = await connect(url, holder)
    leader = Leader(nc.jetstream(), role="scheduler", holder=holder, ttl_s=TTL_S)
    stop = asyncio.Event()
    task = asyncio.create_task(leader.run(stop))
    try:
        yield leader, stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await nc.close()


def lines(caplog: pytest.LogCaptureFixture, holder: str, words: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "llmgw.leader" and r.getMessage().startswith(f"scheduler {holder}: {words}")
    ]


async def test_standby_says_who_leads_once_and_when_it_takes_over(
    nats_server: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw.leader")
    async with leading(nats_server.url, "a") as (a, stop_a):
        await until(lambda: a.is_leader)
        async with leading(nats_server.url, "b") as (b, _):
            await until(lambda: bool(lines(caplog, "b", "standing by")))
            # Several of the standby's looks at the lease later, still the one line.
            since = time.monotonic()
            await until(lambda: time.monotonic() - since > 4 * b.lease.renew_every_s)
            assert lines(caplog, "b", "standing by") == [
                "scheduler b: standing by; a holds the lease llmgw.scheduler"
            ]
            assert not b.is_leader
            assert not lines(caplog, "a", "standing by")

            stop_a.set()  # a clean stop releases the lease: b takes over at once
            await until(lambda: b.is_leader)
            assert lines(caplog, "b", "taking over") == [
                "scheduler b: taking over the lease llmgw.scheduler from a"
            ]
    assert not lines(caplog, "a", "taking over")
