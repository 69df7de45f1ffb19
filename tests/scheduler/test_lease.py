"""The lease on a real broker: acquire, renew, expire, take over, release."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.client import JetStreamContext

from services.lease import Lease
from tests.scheduler.helpers import eventually

pytestmark = pytest.mark.timeout(30)

TTL = 1.0


async def test_acquire_is_exclusive(js: JetStreamContext) -> None:
    a = Lease(js, name="scheduler", holder="a", ttl_s=TTL)
    b = Lease(js, name="scheduler", holder="b", ttl_s=TTL)
    assert await a.acquire()
    assert a.is_leader
    assert not await b.acquire()
    assert not b.is_leader
    assert await a.current_holder() == "a"


async def test_renew_keeps_it_past_the_ttl(js: JetStreamContext) -> None:
    a = Lease(js, name="scheduler", holder="a", ttl_s=TTL)
    b = Lease(js, name="scheduler", holder="b", ttl_s=TTL)
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop))
    await eventually(lambda: a.is_leader)
    t_end = time.monotonic() + 2.5 * TTL
    while time.monotonic() < t_end:
        assert a.is_leader
        assert not await b.acquire()
        await asyncio.sleep(0.1)
    stop.set()
    await task
    assert not a.is_leader


async def test_expired_lease_is_taken_over_and_the_old_holder_knows(
    js: JetStreamContext,
) -> None:
    a = Lease(js, name="scheduler", holder="a", ttl_s=TTL)
    b = Lease(js, name="scheduler", holder="b", ttl_s=TTL)
    assert await a.acquire()
    acquired = time.monotonic()
    # a stops renewing (a pause, a partition); b tries until the entry has expired.
    await eventually(b.acquire, within=TTL + 3.0, every=0.05)
    won = time.monotonic()
    assert not a.is_leader
    assert won - acquired >= TTL * 0.9, "taken before the entry could have expired"
    assert won - acquired < TTL + 2.0
    # The old holder's renewal is a compare-and-set on a revision that is gone.
    assert not await a.acquire()
    assert await b.acquire()
    assert await b.current_holder() == "b"


async def test_deposed_belief_ends_before_takeover(js: JetStreamContext) -> None:
    a = Lease(js, name="scheduler", holder="a", ttl_s=TTL)
    b = Lease(js, name="scheduler", holder="b", ttl_s=TTL)
    assert await a.acquire()
    seen: list[bool] = []

    async def b_wins() -> bool:
        won = await b.acquire()
        seen.append(a.is_leader)
        return won

    await eventually(b_wins, within=TTL + 3.0)
    assert not any(seen[-1:]), "the old holder still believed it led when b took over"
    assert a.remaining_s() == 0.0


async def test_release_hands_over_at_once(js: JetStreamContext) -> None:
    changes: list[tuple[str, bool]] = []
    a = Lease(
        js, name="scheduler", holder="a", ttl_s=5.0, on_change=lambda v: changes.append(("a", v))
    )
    b = Lease(
        js, name="scheduler", holder="b", ttl_s=5.0, on_change=lambda v: changes.append(("b", v))
    )
    assert await a.acquire()
    assert not await b.acquire()
    await a.release()
    assert not a.is_leader
    assert await b.acquire()
    assert changes == [("a", True), ("a", False), ("b", True)]


async def test_standby_run_takes_over_within_the_ttl_after_a_crash(js: JetStreamContext) -> None:
    a = Lease(js, name="scheduler", holder="a", ttl_s=TTL)
    b = Lease(js, name="scheduler", holder="b", ttl_s=TTL)
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    ta = asyncio.create_task(a.run(stop_a))
    await eventually(lambda: a.is_leader)
    tb = asyncio.create_task(b.run(stop_b))
    await asyncio.sleep(TTL)
    assert not b.is_leader
    ta.cancel()  # a crash: no release
    with pytest.raises(asyncio.CancelledError):
        await ta
    took = await eventually(lambda: b.is_leader, within=TTL + 3.0)
    assert took <= TTL + 1.5
    stop_b.set()
    await tb


async def test_leases_of_different_names_are_independent(js: JetStreamContext) -> None:
    s = Lease(js, name="scheduler", holder="x", ttl_s=TTL)
    p = Lease(js, name="preemption", holder="y", ttl_s=TTL)
    assert await s.acquire()
    assert await p.acquire()


async def test_same_holder_restarted_renews_its_own_entry(js: JetStreamContext) -> None:
    a1 = Lease(js, name="scheduler", holder="a", ttl_s=TTL)
    assert await a1.acquire()
    a2 = Lease(js, name="scheduler", holder="a", ttl_s=TTL)
    assert await a2.acquire()


async def test_run_without_release_leaves_release_to_the_owner(js: JetStreamContext) -> None:
    a = Lease(js, name="scheduler", holder="a", ttl_s=5.0)
    b = Lease(js, name="scheduler", holder="b", ttl_s=5.0)
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop, release=False))
    await eventually(lambda: a.is_leader)
    stop.set()
    await task
    assert not a.is_leader
    assert await a.current_holder() == "a"  # not released yet: the owner's work may run on
    await a.release()
    assert await b.acquire()
