"""Helpers for the agent tests: commands as the scheduler would send them, reading back
what an agent stored, and waiting on real conditions with a deadline."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TypeVar

from nats.js.client import JetStreamContext

from schemas import codec, ids, names, subjects
from schemas import events as ev
from services.bus import consume

_n = itertools.count()
T = TypeVar("T")


def new_id() -> str:
    return ids.ulid(time.time_ns() // 1_000_000, os.urandom(10))


def start_cmd(
    replica: str, node: str, gpus: tuple[int, ...], model: str = "llama-70b", profile: str = "tp1"
) -> ev.ReplicaStartEvent:
    return ev.ReplicaStartEvent(
        id=new_id(),
        time=datetime.now(UTC),
        source="scheduler",
        correlation=f"placement-{next(_n)}",
        data=ev.ReplicaStart(
            replica=replica,
            model=model,
            profile=profile,
            shards=(ev.ShardSpec(node=node, gpus=gpus),),
        ),
    )


def drain_cmd(
    replica: str, model: str = "llama-70b", grace_s: float = 0.05
) -> ev.ReplicaDrainEvent:
    return ev.ReplicaDrainEvent(
        id=new_id(),
        time=datetime.now(UTC),
        source="preemption",
        data=ev.ReplicaDrain(replica=replica, model=model, reason="preempted", grace_s=grace_s),
    )


async def node_events(js: JetStreamContext, node: str, kind: str = ">") -> list[ev.Event]:
    """Every event stored under `<root>.node.<node>.<kind>`, in order."""
    out: list[ev.Event] = []
    filt = f"{subjects.DEFAULT_ROOT}.node.{names.escape(node)}.{kind}"
    async for batch in consume.read_range(js, 1, filter_subject=filt):
        out.extend(codec.decode(d.data) for d in batch)
    return out


async def states(js: JetStreamContext, node: str) -> list[ev.ReplicaStateEvent]:
    return [
        e for e in await node_events(js, node, "replica.>") if isinstance(e, ev.ReplicaStateEvent)
    ]


def by_replica(events: list[ev.ReplicaStateEvent]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in events:
        out.setdefault(e.data.replica, []).append(e.data.state)
    return out


async def wait_for(
    probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], within_s: float = 10.0
) -> T:
    """Poll `await probe()` until `done(result)`, or fail with the last result seen."""
    deadline = time.monotonic() + within_s
    while True:
        got = await probe()
        if done(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s}s; last: {got!r}")
        await asyncio.sleep(0.02)
