"""A drain waits for the gateways: each gateway answers a draining agent how many requests
it has in flight on the replica and whether it would still route new ones there; the
agent stops the server once every gateway has folded the drain and has nothing in flight
there, or at the end of the grace; with no gateway running it does not wait at all.
A simulated server that stops at once on a drain (`server_drains=False`, as one that
exits on SIGTERM) then still cuts no request that came through a gateway."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import inflight, subjects
from services.agent import SimulatedRuntime, gateways
from services.agent.responder import Responder, Timing
from services.gateway.server import Gateway
from tests.agent.helpers import (
    drain_cmd,
    placement_of,
    running_agent,
    sim_agent,
    start_cmd,
    states,
    wait_for,
)
from tests.gateway.conftest import Plane

pytestmark = [pytest.mark.timeout(30), pytest.mark.module_broker]

SLOW = Timing(0.0, 20.0)  # 20 tokens a second: max_tokens 20 is a one-second stream


async def _stream(plane: Plane, model: str, tokens: int) -> tuple[int, str, bytes]:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with plane.http.post(f"{plane.url}/v1/chat/completions", json=body) as r:
        got = b""
        try:
            async for chunk in r.content.iter_any():
                got += chunk
        except aiohttp.ClientPayloadError:
            got += b"(cut)"
        return r.status, r.headers.get("x-llmgw-replica", ""), got


async def test_a_gateway_answers_its_in_flight_and_routing_until_the_drain_is_folded_and_done(
    nc: Client, plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("gwq")
    s = await servers("gwq-1", "gwq", SLOW)
    await plane.ready("gwq-1", "gwq", s.endpoint)
    # A ten-second stream: the two waits below (each its whole `within_s`, since the
    # gateway stays busy) leave it running when the drain comes, on a loaded host too,
    # where a gateway's first answer can take most of a second.
    t = asyncio.create_task(_stream(plane, "gwq", 200))
    await wait_for(lambda: asyncio.sleep(0, plane.gateway.router.inflight), bool, 5)
    # Not drained yet: it is routable and has one in flight; a wait says so.
    q = await gateways.until_quiet(nc, plane.node, "gwq-1", within_s=2)
    assert (q.gateways, q.inflight, q.routing, q.clear) == (1, 1, 1, False)
    # A drain not folded yet (its seq past the view's) counts as still routing.
    ahead = plane.gateway.follower.seq + 1000
    q = await gateways.until_quiet(nc, plane.node, "gwq-1", within_s=2, drain_seq=ahead)
    assert q.routing == 1
    await plane.drain("gwq-1", "gwq")
    seq = plane.gateway.follower.seq
    q = await gateways.until_quiet(nc, plane.node, "gwq-1", within_s=20, drain_seq=seq)
    # It ended when the stream did (a ten-second stream, four seconds in), not before,
    # and the stream is whole.
    assert q.waited_s > 0.5
    status, replica, body = await asyncio.wait_for(t, 5)
    assert status == 200 and replica == "gwq-1" and body.rstrip().endswith(b"data: [DONE]")
    assert (q.gateways, q.inflight, q.routing, q.clear) == (1, 0, 0, True)


async def test_every_gateway_running_answers(
    nc: Client, js: JetStreamContext, plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    second = Gateway(js, nc=nc, listen="127.0.0.1:0")
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(second.run(stop, on_ready=lambda _: ready.set()))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        await plane.model("gwt")
        s = await servers("gwt-1", "gwt", SLOW)
        await plane.ready("gwt-1", "gwt", s.endpoint)
        await second.follower.wait_for(plane.gateway.follower.seq, 5)
        q = await gateways.until_quiet(nc, plane.node, "gwt-1", within_s=2)
        assert q.gateways == 2 and q.routing == 2
        await plane.drain("gwt-1", "gwt")
        await second.follower.wait_for(plane.gateway.follower.seq, 5)
        q = await gateways.until_quiet(nc, plane.node, "gwt-1", within_s=5)
        assert q.gateways == 2 and q.clear
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def test_the_question_is_core_nats_not_stored() -> None:
    """The stream stores what it matches; a question stored would be a dead letter (and
    its publisher's reply a stored-ack, so that no gateway would never read as none)."""
    asked = subjects.gateway_inflight_subject("n-1", "r-1")
    assert subjects.replica_of_inflight(asked) == "r-1"
    assert not any(_matches(p, asked) for p in subjects.stream_subjects())
    assert _matches(subjects.gateway_inflight_wildcard(), asked)


async def test_with_no_gateway_a_drain_does_not_wait(nc: Client) -> None:
    # Nobody subscribed: the broker says so (at once, but for a loaded host).
    t0 = time.monotonic()
    q = await gateways.until_quiet(nc, "gw-none", "r-1", within_s=30)
    assert q.gateways == 0 and q.clear and time.monotonic() - t0 < gateways.WINDOW_S + 0.5
    # Someone listening who never answers is asked again for `mute_s`, not the grace.
    silent = await nc.subscribe(subjects.gateway_inflight_subject("gw-mute", "r-1"))
    try:
        t0 = time.monotonic()
        q = await gateways.until_quiet(nc, "gw-mute", "r-1", within_s=30, window_s=0.2, mute_s=0.6)
        took = time.monotonic() - t0
        assert q.gateways == 0 and 0.6 <= took < 0.6 + 0.2 + 0.5
    finally:
        await silent.unsubscribe()


async def test_a_gateway_that_answers_late_is_waited_for(nc: Client) -> None:
    """A gateway whose loop is busy misses the first window: its silence is not taken for
    "no gateway" (which would cut its streams), it is asked again and its answer counts."""
    subject = subjects.gateway_inflight_subject("gw-slow", "r-1")
    asked = 0

    async def late(msg: Any) -> None:
        nonlocal asked
        asked += 1
        if asked < 3:
            return  # the first questions go unanswered, as from a starved loop
        a = inflight.InflightAnswer(gateway="g-1", replica="r-1", inflight=0, routable=False)
        await msg.respond(inflight.encode(a))

    sub = await nc.subscribe(subject, cb=late)
    try:
        q = await gateways.until_quiet(nc, "gw-slow", "r-1", within_s=30, window_s=0.2)
        assert q.gateways == 1 and q.clear and asked == 3
    finally:
        await sub.unsubscribe()


@pytest.mark.parametrize("wait", [True, False], ids=["waits for the gateway", "does not wait"])
async def test_an_agents_drain_cuts_no_request_in_flight_through_a_gateway(
    nc: Client, js: JetStreamContext, plane: Plane, wait: bool
) -> None:
    """A server that stops at once on a drain: the agent's wait for the gateway is what
    keeps a stream in flight whole (and without it the stream is cut)."""
    node = f"gw-ag-{int(wait)}"
    model = f"gwa{int(wait)}"
    await plane.model(model)
    runtime = SimulatedRuntime(0.0, 0.0, 0.0, serve=SLOW, server_drains=False)
    agent = sim_agent(nc, js, node, "2xH100-80GB", runtime=runtime, gateway_wait=wait)
    async with running_agent(agent):
        rid = f"{model}-1"
        start = start_cmd(rid, node, (0,), model=model, profile="p")
        # Placed once the gateway knows the node, as a scheduler places: only a
        # placement makes a replica.
        nodes = plane.gateway.follower.view.state.nodes
        await wait_for(lambda: asyncio.sleep(0, node in nodes), bool)
        await plane.pub.publish(placement_of(start))
        await plane.pub.publish(start, node=node)
        await wait_for(
            lambda: asyncio.sleep(0, plane.gateway.follower.view.replicas.get(rid)),
            lambda r: r is not None and r.state == "ready",
        )
        t = asyncio.create_task(_stream(plane, model, 20))
        await wait_for(lambda: asyncio.sleep(0, plane.gateway.router.inflight), bool, 5)
        await plane.pub.publish(drain_cmd(rid, model=model, grace_s=10), node=node)
        status, _, body = await asyncio.wait_for(t, 10)
        await wait_for(lambda: states(js, node), lambda es: es[-1].data.state == "stopped")
        assert status == 200
        whole = body.rstrip().endswith(b"data: [DONE]")
        assert whole is wait, body[-200:]


async def test_a_drain_with_no_gateway_stops_at_once_and_says_so_once(
    nc: Client, js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw.agent")
    node = "gw-lone"
    agent = sim_agent(nc, js, node, "2xH100-80GB", runtime=SimulatedRuntime(0.0, 0.0, 0.0))
    async with running_agent(agent):
        for i in (1, 2):
            await agent_ready_then_drained(js, node, f"lone-{i}", grace_s=30)
    said = [r for r in caplog.records if "no gateway answers" in r.getMessage()]
    assert len(said) == 1


async def agent_ready_then_drained(
    js: JetStreamContext, node: str, rid: str, grace_s: float
) -> None:
    from services.bus import Publisher

    pub = Publisher(js)
    await pub.publish(start_cmd(rid, node, (0,), model="lone"), node=node)
    await wait_for(
        lambda: states(js, node),
        lambda es: any(e.data.replica == rid and e.data.state == "ready" for e in es),
    )
    t0 = time.monotonic()
    await pub.publish(drain_cmd(rid, model="lone", grace_s=grace_s), node=node)
    await wait_for(
        lambda: states(js, node),
        lambda es: any(e.data.replica == rid and e.data.state == "stopped" for e in es),
    )
    assert time.monotonic() - t0 < 2, "a drain with no gateway waited"
