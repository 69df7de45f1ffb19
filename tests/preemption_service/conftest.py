"""Helpers for the preemption service tests: a small full cluster, a clock the test moves,
a service running in-process, and reading back what landed on the stream.

The cluster (`full_cluster`): two nodes of four GPUs, filled by four replicas of an
opportunistic on-demand model `batch` (two GPUs each), idle for different times; a critical
model `chat` needing four GPUs on one node has nowhere to go. The policy's pick for `chat`
is the two longest idle replicas, which share node n1: b1 and b2.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import codec
from schemas import events as ev
from services.bus import Publisher, connect
from services.bus.consume import read_range
from services.core import policy
from services.preemption import Config, PreemptionService
from tests.scenario import Scenario

T0 = "2026-01-01T12:00:00Z"

# FAST shortens the service's timings to what a test can wait out.
CONFIG = policy.Config(hold_s=60.0)
FAST = Config(policy=CONFIG, lease_ttl_s=1.0, tick_s=0.05, ack_wait_s=1.0)


def full_cluster(t0: str | datetime = T0) -> Scenario:
    s = Scenario(t0)
    s.node("n1", "4xH100-80GB").node("n2", "4xH100-80GB")
    s.model("batch", cls="opportunistic", min=0, max=8, profiles=["two:2"])
    s.model("chat", cls="critical", min=1, profiles=["tp4:4"])
    s.model("chat2", cls="critical", min=1, profiles=["tp4:4"])
    s.replica("b1", "batch", on=("n1", [0, 1]), ready="-3h", used="-50m")
    s.replica("b2", "batch", on=("n1", [2, 3]), ready="-3h", used="-40m")
    s.replica("b3", "batch", on=("n2", [0, 1]), ready="-3h", used="-30m")
    s.replica("b4", "batch", on=("n2", [2, 3]), ready="-3h", used="-20m")
    return s


def failed(s: Scenario, model: str = "chat", reason: str = "no_fit") -> ev.Event:
    """A placement.failed for one more replica of `model`."""
    return s.emit(
        ev.PlacementFailed(model=model, profiles=("tp4",), live=0, desired=1, reason=reason)
    )


async def publish(js: JetStreamContext, s: Scenario, since: int = 0) -> int:
    """Publish the scenario's events after its event number `since`; returns the count."""
    items = [(subj, codec.encode(e), e.id) for seq, subj, e in s.events() if seq > since]
    await Publisher(js).publish_many(items)
    return len(s.events())


class Clock:
    """A clock the test moves; the service reads it for `now`."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


async def until(cond: Callable[[], Awaitable[bool] | bool], within: float = 10.0) -> None:
    """Poll `cond` until true; fail after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        r = cond()
        if not isinstance(r, bool):
            r = await r
        if r:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within:g}s")
        await asyncio.sleep(0.02)


@dataclass
class Stored:
    seq: int
    subject: str
    event: ev.Event


async def stored(js: JetStreamContext) -> list[Stored]:
    """Every event on the stream, in order."""
    out: list[Stored] = []
    async for batch in read_range(js):
        out.extend(Stored(d.seq, d.subject, codec.decode(d.data)) for d in batch)
    return out


def of_type(events: list[Stored], cls: type[ev.Envelope]) -> list[Stored]:
    return [x for x in events if isinstance(x.event, cls)]


async def acked_through(js: JetStreamContext, seq: int, durable: str = "preemption") -> bool:
    """Whether the service's consumer has acked every trigger up to `seq`: it delivered
    the last of them, its ack floor is there, and nothing delivered is unacked.

    The last trigger's own sequence is what says it was reached: a filtered consumer's
    floor can stand past a trigger not yet delivered, and right after a publish its count
    of what is left to deliver may not include the new trigger yet."""
    try:
        info = await js.consumer_info("LLMGW", durable)
    except Exception:
        return False
    triggers = [
        x.seq
        for x in await stored(js)
        if x.seq <= seq and isinstance(x.event, ev.PlacementFailedEvent)
    ]
    last = triggers[-1] if triggers else 0
    return (
        info.delivered.stream_seq >= last
        and info.ack_floor.stream_seq >= last
        and not info.num_ack_pending
        and not info.num_pending
    )


@contextlib.asynccontextmanager
async def running(
    url: str,
    *,
    holder: str,
    clock: Callable[[], datetime],
    config: Config = FAST,
    lead: bool = True,
) -> AsyncIterator[tuple[PreemptionService, asyncio.Task[None]]]:
    """A service on its own connection, running in a task; waits until it leads (when
    `lead`). Stopped cleanly at the end unless the test cancelled the task already."""
    nc: Client = await connect(url, holder)
    js = nc.jetstream()
    svc = PreemptionService(nc, js, config=config, clock=clock, holder=holder)
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    try:
        if lead:
            # Leading, and consuming: a trigger published before the service noted its
            # backlog would count as backlog (looked up in the log, not decided anew).
            await until(lambda: (svc.is_leader and svc.consuming) or task.done())
            if task.done():
                task.result()
        yield svc, task
    finally:
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 10)
        else:
            with contextlib.suppress(asyncio.CancelledError):
                task.result()
        await nc.close()


@pytest.fixture
def clock() -> Clock:
    return Clock(full_cluster().now)
