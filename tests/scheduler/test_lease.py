"""The lease on a real broker: acquire, renew, expire, take over, release.

Time is a parameter: each lease gets a clock the test moves, so its local deadline is
checked without sleeping. The server's expiry of an entry (at the bucket's TTL) is
played by deleting the entry, which is what the server does then; that the bucket is
made with the lease's TTL is checked on its own.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.js.client import JetStreamContext

from services.plane.lease import DEFAULT_BUCKET, Lease
from tests.scheduler.helpers import eventually

pytestmark = pytest.mark.timeout(30)

# TTL is long on the server's side: no entry expires on its own while a test runs, so
# only the test's clocks and deletes move time.
TTL = 30.0


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def lease(js: JetStreamContext, holder: str, clock: Clock, ttl_s: float = TTL) -> Lease:
    return Lease(js, name="scheduler", holder=holder, ttl_s=ttl_s, clock=clock)


async def expire(js: JetStreamContext, name: str = "scheduler") -> None:
    """What the server does when an entry's TTL runs out: the entry is gone."""
    kv = await js.key_value(DEFAULT_BUCKET)
    await kv.delete(name)


async def test_acquire_is_exclusive(js: JetStreamContext) -> None:
    clock = Clock()
    a, b = lease(js, "a", clock), lease(js, "b", clock)
    assert await a.acquire()
    assert a.is_leader
    assert not await b.acquire()
    assert not b.is_leader
    assert await a.current_holder() == "a"


async def test_bucket_expires_entries_at_the_ttl(js: JetStreamContext) -> None:
    a = lease(js, "a", Clock(), ttl_s=7.0)
    assert await a.acquire()
    info = await js.stream_info(f"KV_{DEFAULT_BUCKET}")
    assert info.config.max_age == pytest.approx(7.0)


async def test_belief_ends_before_the_ttl_without_a_renewal(js: JetStreamContext) -> None:
    clock = Clock()
    a = lease(js, "a", clock)
    assert await a.acquire()
    assert a.remaining_s() == pytest.approx(TTL - a.margin_s)
    clock.advance(TTL - a.margin_s - 0.01)
    assert a.is_leader
    clock.advance(0.02)
    assert not a.is_leader
    assert a.remaining_s() == 0.0


async def test_renew_keeps_it_past_the_ttl(js: JetStreamContext) -> None:
    clock = Clock()
    a, b = lease(js, "a", clock), lease(js, "b", clock)
    assert await a.acquire()
    for _ in range(8):  # well past one TTL, renewed every ttl/3
        clock.advance(a.renew_every_s)
        assert a.is_leader
        assert await a.acquire()
        assert not await b.acquire()
    assert a.terms == 1


async def test_expired_lease_is_taken_over_and_the_old_holder_knows(
    js: JetStreamContext,
) -> None:
    clock = Clock()
    a, b = lease(js, "a", clock), lease(js, "b", clock)
    assert await a.acquire()
    # a stops renewing (a pause, a partition); b cannot take a live entry.
    clock.advance(TTL / 2)
    assert not await b.acquire()
    # The TTL runs out: a's belief has ended by its own clock, and the server drops it.
    clock.advance(TTL / 2)
    assert not a.is_leader
    await expire(js)
    assert await b.acquire()
    # The old holder's renewal is a compare-and-set on a revision that is gone.
    assert not await a.acquire()
    assert await b.acquire()
    assert await b.current_holder() == "b"


async def test_deposed_belief_ends_before_takeover(js: JetStreamContext) -> None:
    clock = Clock()
    a, b = lease(js, "a", clock), lease(js, "b", clock)
    assert await a.acquire()
    # The earliest the server can drop a's entry is TTL after a sent its renewal; a
    # stops believing a margin before that.
    clock.advance(TTL)
    assert not a.is_leader
    await expire(js)
    assert await b.acquire()
    assert a.remaining_s() == 0.0


async def test_release_hands_over_at_once(js: JetStreamContext) -> None:
    changes: list[tuple[str, bool]] = []
    clock = Clock()
    a = Lease(
        js,
        name="scheduler",
        holder="a",
        ttl_s=TTL,
        clock=clock,
        on_change=lambda v: changes.append(("a", v)),
    )
    b = Lease(
        js,
        name="scheduler",
        holder="b",
        ttl_s=TTL,
        clock=clock,
        on_change=lambda v: changes.append(("b", v)),
    )
    assert await a.acquire()
    assert not await b.acquire()
    await a.release()
    assert not a.is_leader
    assert await b.acquire()
    assert changes == [("a", True), ("a", False), ("b", True)]


async def test_standby_run_takes_over_after_a_crash(js: JetStreamContext) -> None:
    a = Lease(js, name="scheduler", holder="a", ttl_s=1.0)
    b = Lease(js, name="scheduler", holder="b", ttl_s=1.0)
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    ta = asyncio.create_task(a.run(stop_a))
    await eventually(lambda: a.is_leader)
    tb = asyncio.create_task(b.run(stop_b))
    assert not b.is_leader
    ta.cancel()  # a crash: no release
    with pytest.raises(asyncio.CancelledError):
        await ta
    assert not a.is_leader
    assert await a.current_holder() == "a"  # left for the server to expire
    await expire(js)
    # b's run tries again every ttl/3 and takes the key once it is gone.
    await eventually(lambda: b.is_leader, within=5.0)
    stop_b.set()
    await tb


async def test_leases_of_different_names_are_independent(js: JetStreamContext) -> None:
    clock = Clock()
    s = Lease(js, name="scheduler", holder="x", ttl_s=TTL, clock=clock)
    p = Lease(js, name="preemption", holder="y", ttl_s=TTL, clock=clock)
    assert await s.acquire()
    assert await p.acquire()


async def test_same_holder_restarted_renews_its_own_entry(js: JetStreamContext) -> None:
    clock = Clock()
    a1 = lease(js, "a", clock)
    assert await a1.acquire()
    a2 = lease(js, "a", clock)
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
