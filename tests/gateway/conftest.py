"""The gateway's test fixtures: a gateway in this process on the module's broker, the
test's hand on the log it follows (`Plane`), and simulated model servers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.agent.responder import Responder, Timing
from services.bus import Publisher
from services.clock import utc_now
from services.gateway.server import Gateway
from tests.agent.helpers import new_id
from tests.core.test_fold import inventory

FAST = Timing(0.0, 0.0)
_nodes = itertools.count(1)


def _event(data: ev.Data) -> ev.Event:
    return ev.make(data, id=new_id(), time=utc_now(), source="test")


class Plane:
    """The test's hand on the log and on the gateway that follows it."""

    def __init__(self, js: JetStreamContext, gateway: Gateway, http: aiohttp.ClientSession):
        self.pub = Publisher(js)
        self.gateway = gateway
        self.http = http
        self.url = gateway.url
        self.node = f"gw-n{next(_nodes)}"
        """This test's node: the module's broker is shared, each test has a node of its own."""
        self._gpu = 0

    async def say(self, data: ev.Data, node: str | None = None) -> None:
        p = await self.pub.publish(_event(data), node=node)
        await self.gateway.follower.wait_for(p.seq, 5)

    async def inventory(self, node: str, gpus: int) -> None:
        await self.say(inventory(node, gpus), node=node)

    async def model(
        self,
        name: str,
        aliases: tuple[str, ...] = (),
        target_inflight: int | None = None,
        cls: str = "standard",
        max: int | None = None,
    ) -> None:
        await self.say(
            ev.ModelDeclared(
                name=name,
                min=0,
                max=max,
                aliases=aliases,
                profiles=(ev.ProfileSpec(name="p", gpus=1),),
                target_inflight=target_inflight,
                cls=cls,  # type: ignore[arg-type]
            )
        )

    async def ready(self, replica: str, model: str, endpoint: str, node: str | None = None) -> None:
        node = node or self.node
        gpu, self._gpu = self._gpu, self._gpu + 1
        shards = (ev.ShardSpec(node=node, gpus=(gpu,)),)
        # Placed first, as the scheduler would: a report creates no replica.
        await self.say(
            ev.PlacementDecided(replica=replica, model=model, profile="p", shards=shards, reason="")
        )
        await self.say(
            ev.ReplicaState(
                replica=replica,
                model=model,
                profile="p",
                state="ready",
                shards=shards,
                endpoint=endpoint,
            ),
            node=node,
        )

    async def drain(self, replica: str, model: str) -> None:
        node = self.gateway.follower.view.replicas[replica].shards[0].node
        await self.say(
            ev.ReplicaDrain(replica=replica, model=model, reason="scale_down"), node=node
        )

    async def post(
        self, path: str, body: Any = None, *, raw: bytes | None = None, **kw: Any
    ) -> tuple[int, dict[str, str], bytes]:
        data = raw if raw is not None else json.dumps(body).encode()
        # The gateway takes only bodies said to be JSON (`guard.Boundary`).
        kw["headers"] = {"Content-Type": "application/json", **kw.get("headers", {})}
        async with self.http.post(f"{self.url}{path}", data=data, **kw) as r:
            return r.status, dict(r.headers), await r.read()

    async def chat(self, model: str, **extra: Any) -> tuple[int, dict[str, str], bytes]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
        return await self.post("/v1/chat/completions", body)


def gateway_for(js: JetStreamContext, **extra: Any) -> Gateway:
    """A gateway with the tests' settings (short timeouts and intervals, a 64 KiB body)."""
    return Gateway(
        js,
        listen="127.0.0.1:0",
        connect_timeout_s=2,
        upstream_timeout_s=1,
        max_body=65536,
        used_interval_s=0.3,
        min_wait_s=0.3,
        **extra,
    )


@contextlib.asynccontextmanager
async def serving(gw: Gateway) -> AsyncIterator[Gateway]:
    """`gw` running (bound, following the log, serving) for the body, then stopped."""
    sock = gw.bind()
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(gw.run(stop, sock, on_ready=lambda _: ready.set()))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield gw
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.fixture
async def plane(nc: Client, js: JetStreamContext) -> AsyncIterator[Plane]:
    async with serving(gateway_for(js, nc=nc)) as gw, aiohttp.ClientSession() as http:
        p = Plane(js, gw, http)
        await p.inventory(p.node, 16)
        yield p


@pytest.fixture
async def servers() -> AsyncIterator[Callable[..., Awaitable[Responder]]]:
    """`await servers(replica, model)`: a simulated model server, closed at the end."""
    made: list[Responder] = []

    async def make(replica: str, model: str, timing: Timing = FAST) -> Responder:
        r = Responder(replica, model, timing)
        await r.start()
        made.append(r)
        return r

    yield make
    for r in made:
        await r.close()
