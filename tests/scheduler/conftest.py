"""Fixtures for the scheduler tests: a cluster driven by publishing events, schedulers run
as tasks with small timings, and the stream read back to see what they decided."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import codec, ids
from schemas import events as ev
from services.bus import Publisher
from services.bus.consume import read_range
from services.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.helpers import Clock

FAST = SchedulerConfig(
    tick_s=0.1,
    node_timeout_s=60.0,
    start_timeout_s=60.0,
    failed_backoff_s=60.0,
    failed_quiet_s=0.0,
    drain_grace_s=1.0,
    lease_ttl_s=1.0,
)

_n = itertools.count()


def new_id() -> str:
    n = next(_n)
    return ids.ulid(int(datetime.now(UTC).timestamp() * 1000), os.urandom(8) + n.to_bytes(2, "big"))


class Cluster:
    """Publishes what operators and agents would, and reads back the stream."""

    def __init__(self, nc: Client, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js
        self.pub = Publisher(js)

    async def emit(
        self, data: ev.Data, node: str | None = None, time: datetime | None = None
    ) -> int:
        e = ev.make(data, id=new_id(), time=time or datetime.now(UTC), source="test")
        return (await self.pub.publish(e, node=node)).seq

    async def node(self, name: str, gpus: int = 8, model: str = "NVIDIA H100 80GB") -> int:
        return await self.emit(
            ev.NodeInventory(
                node=name,
                gpus=tuple(
                    ev.GpuInfo(index=i, uuid=f"{name}-{i}", model=model, memory_gb=80)
                    for i in range(gpus)
                ),
                cpu_cores=96,
                memory_gb=1024,
            )
        )

    async def declare(
        self,
        name: str,
        *,
        gpus: int = 4,
        shards: int = 1,
        min: int = 1,
        max: int | None = None,
        cls: str = "standard",
        owner: str = "default",
        profiles: tuple[ev.ProfileSpec, ...] | None = None,
    ) -> int:
        return await self.emit(
            ev.ModelDeclared(
                name=name,
                owner=owner,
                cls=cls,  # type: ignore[arg-type]
                min=min,
                max=max,
                profiles=profiles
                or (
                    ev.ProfileSpec(
                        name=f"tp{gpus}" + (f"x{shards}" if shards > 1 else ""),
                        gpus=gpus,
                        shards=shards,
                    ),
                ),
            )
        )

    async def scale(self, model: str, n: int) -> int:
        return await self.emit(ev.ScaleDesired(model=model, replicas=n))

    async def state(self, start: ev.ReplicaStart, state: str, node: str | None = None) -> int:
        d = start
        return await self.emit(
            ev.ReplicaState(
                replica=d.replica,
                model=d.model,
                profile=d.profile,
                state=state,  # type: ignore[arg-type]
                shards=d.shards,
            ),
            node=node or d.shards[0].node,
        )

    async def heartbeat(self, node: str) -> None:
        await self.nc.publish(f"llmgw.heartbeat.{node}", json.dumps({"node": node}).encode())

    async def events(self) -> list[tuple[int, str, ev.Event]]:
        out = []
        info = await self.js.stream_info("LLMGW")
        if not info.state.last_seq:
            return out
        async for batch in read_range(self.js, 1):
            for d in batch:
                out.append((d.seq, d.subject, codec.decode(d.data)))
        return out

    async def of(self, kind: type[ev.Envelope], model: str | None = None) -> list[ev.Event]:
        got = []
        for _, _, e in await self.events():
            if isinstance(e, kind) and (model is None or _model_of(e) == model):
                got.append(e)
        return got

    async def with_subjects(self, kind: type[ev.Envelope]) -> list[tuple[str, ev.Event]]:
        return [(s, e) for _, s, e in await self.events() if isinstance(e, kind)]


def _model_of(e: ev.Event) -> str | None:
    d = e.data
    return getattr(d, "model", None) or getattr(d, "name", None)


@pytest.fixture
async def cluster(nc: Client, js: JetStreamContext) -> Cluster:
    return Cluster(nc, js)


@dataclass
class Running:
    scheduler: Scheduler
    stop: asyncio.Event
    task: asyncio.Task[None]
    done: bool = field(default=False)

    async def stop_clean(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 10)
        self.done = True

    async def crash(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.done = True


@pytest.fixture
async def start_scheduler(
    nc: Client, js: JetStreamContext
) -> AsyncIterator[Callable[..., Running]]:
    """`start_scheduler(config=FAST, holder=..., clock=...)`: a scheduler running as a
    task, on the real clocks or a test's `Clock`; every one started is stopped at the end
    of the test."""
    running: list[Running] = []

    def start(
        config: SchedulerConfig = FAST, holder: str | None = None, clock: Clock | None = None
    ) -> Running:
        clocks = {} if clock is None else {"clock": clock.wall, "monotonic": clock.monotonic}
        s = Scheduler(nc, js, config=config, holder=holder or f"test-{len(running)}", **clocks)
        stop = asyncio.Event()
        r = Running(s, stop, asyncio.create_task(s.run(stop)))
        running.append(r)
        return r

    yield start
    for r in running:
        if not r.done:
            r.stop.set()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(r.task, 10)
