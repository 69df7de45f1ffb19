"""Helpers for the agent tests: an agent on a simulated runtime and its run, commands as
the scheduler would send them, reading back what an agent stored, and waiting on real
conditions with a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import codec, ids, names, subjects
from schemas import events as ev
from services.agent import Agent, SimulatedRuntime, spec
from services.bus import consume

_n = itertools.count()
T = TypeVar("T")


def sim_agent(
    nc: Client, js: JetStreamContext, node: str, gpu_spec: str = "8xH100-80GB", **kw: Any
) -> Agent:
    """An agent of `node` as these tests run one: the GPUs of `gpu_spec` on a host of
    12 cores and 128 GB a GPU, a quick simulated runtime, a heartbeat every 0.05 s and
    commands redelivered after 1 s; `kw` overrides any of the agent's arguments."""
    inventory = spec.gpu_inventory(node, spec.parse_gpus(gpu_spec))
    args: dict[str, Any] = {
        "gpus": inventory,
        "cpu_cores": 12 * len(inventory),
        "memory_gb": 128 * len(inventory),
        "runtime": SimulatedRuntime(0.02, 0.05, 0.05),
        "heartbeat_s": 0.05,
        "ack_wait_s": 1.0,
    }
    return Agent(nc, js, node=node, **(args | kw))


@contextlib.asynccontextmanager
async def running_agent(agent: Agent) -> AsyncIterator[Agent]:
    """`agent` run in a task while the block runs, then stopped (5 s at the most)."""
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield agent
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


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


def placement_of(start: ev.ReplicaStartEvent) -> ev.PlacementDecidedEvent:
    """The `placement.decided` a scheduler publishes before `start`: only a placement
    makes a replica, so a view follows an agent's reports only after it."""
    d = start.data
    return ev.PlacementDecidedEvent(
        id=new_id(),
        time=start.time,
        source="scheduler",
        data=ev.PlacementDecided(
            replica=d.replica, model=d.model, profile=d.profile, shards=d.shards, reason="test"
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
