"""The gateway's waiting room, in this process on a real broker: a request for a model
that cannot take it now is held, its demand published, and released by the fold of a
replica's ready (the test writes the log, so it says exactly when), FIFO and at the
replica's admission limit; past the line's length or its wait a 429 with Retry-After;
a model the plane cannot place a 503 with the decision's reason; a held stream kept
alive with SSE comments; nothing held or in flight once every request has ended."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client

from schemas import codec, subjects
from schemas import events as ev
from services.agent.responder import Responder, Timing
from services.bus import Publisher
from services.clock import utc_now
from tests.agent.helpers import new_id, wait_for
from tests.gateway.conftest import Plane

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]

CHAT = "/v1/chat/completions"


def _body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


async def _held(plane: Plane, n: int, model: str | None = None) -> None:
    async def count() -> int:
        room = plane.gateway.room
        return room.held() if model is None else room.waiting(model)

    await wait_for(count, lambda c: c == n, 10)


async def _state(plane: Plane, replica: str, model: str, state: str, endpoint: str = "") -> None:
    shards = (ev.ShardSpec(node=plane.node, gpus=(0,)),)
    if replica not in plane.gateway.follower.view.state.replicas:
        # Placed first, as the scheduler would: a report creates no replica.
        await plane.say(
            ev.PlacementDecided(replica=replica, model=model, profile="p", shards=shards, reason="")
        )
    await plane.say(
        ev.ReplicaState(
            replica=replica,
            model=model,
            profile="p",
            state=state,  # type: ignore[arg-type]
            shards=shards,
            endpoint=endpoint or None,
        ),
        node=plane.node,
    )


async def test_a_request_at_zero_is_held_its_demand_published_and_served_on_ready(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], nc: Client
) -> None:
    await plane.model("cold")
    demands: list[ev.ModelDemanded] = []

    async def heard(msg: Any) -> None:
        demands.append(codec.decode(msg.data).data)  # type: ignore[arg-type]

    sub = await nc.subscribe(subjects.demand_subject("cold"), cb=heard)
    s = await servers("cold-1", "cold")
    task = asyncio.create_task(plane.chat("cold", max_tokens=3))
    await _held(plane, 1)
    await wait_for(lambda: asyncio.sleep(0, len(demands)), lambda n: n >= 1, 5)
    first = demands[0]
    assert (first.model, first.waiting) == ("cold", 1)
    assert abs((utc_now() - first.since).total_seconds()) < 5
    assert not task.done()
    await plane.ready("cold-1", "cold", s.endpoint)
    status, h, body = await asyncio.wait_for(task, 5)
    assert status == 200 and h["x-llmgw-replica"] == "cold-1"
    assert len(json.loads(body)["choices"][0]["message"]["content"].split()) == 3
    assert plane.gateway.room.held() == 0 and plane.gateway.router.inflight == {}
    assert len(plane.gateway.counts.wakes) >= 1
    # The wait's end is said too: waiting 0, since when it began.
    await wait_for(lambda: asyncio.sleep(0, demands[-1].waiting), lambda n: n == 0, 5)
    assert demands[-1].since == first.since
    await sub.unsubscribe()


async def test_a_held_stream_gets_keepalive_comments_then_its_tokens(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    plane.gateway.keepalive_s = 0.02
    await plane.model("cold-stream")
    s = await servers("cs-1", "cold-stream")
    async with plane.http.post(
        f"{plane.url}{CHAT}", json=_body("cold-stream", stream=True, max_tokens=4)
    ) as r:
        # The 200 and the stream's headers come when it starts waiting.
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        got = b""
        while got.count(b": waiting\n\n") < 3:
            got += await asyncio.wait_for(r.content.readany(), 5)
        await plane.ready("cs-1", "cold-stream", s.endpoint)
        got += await asyncio.wait_for(r.content.read(), 5)
    comments, _, events = got.partition(b"data: ")
    assert set(comments.split(b"\n\n")) <= {b": waiting", b""}
    assert (b"data: " + events).rstrip().endswith(b"data: [DONE]")
    tokens = [
        json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        for line in (b"data: " + events).split(b"\n")
        if line.startswith(b"data: {")
    ]
    assert len("".join(tokens).split()) == 4
    assert plane.gateway.room.held() == 0


async def test_the_line_is_released_in_order_at_the_replicas_admission_limit(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    # target_inflight 1: two in flight a replica (INFLIGHT_FACTOR), the rest held.
    await plane.model("paced", target_inflight=1)
    s = await servers("pa-1", "paced", Timing(0.2, 0.0))
    order: list[int] = []

    async def one(i: int) -> int:
        status, _, _ = await plane.chat("paced", max_tokens=1)
        order.append(i)
        return status

    tasks = []
    for i in range(6):
        tasks.append(asyncio.create_task(one(i)))
        await _held(plane, i + 1)
    await plane.ready("pa-1", "paced", s.endpoint)
    assert plane.gateway.router.inflight == {"pa-1": 2}
    assert plane.gateway.room.held() == 4
    peak = 0
    while not all(t.done() for t in tasks):
        peak = max(peak, s.active)
        await asyncio.sleep(0.01)
    assert [t.result() for t in tasks] == [200] * 6
    assert peak <= 2
    # Released two at a time in arrival order: each pair ends before the next.
    assert sorted(order[:2]) == [0, 1] and sorted(order[2:4]) == [2, 3]
    assert plane.gateway.room.held() == 0 and plane.gateway.router.inflight == {}


async def test_past_the_lines_length_a_429_with_the_predicted_start(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    plane.gateway.room.per_model = 3
    await plane.model("full")
    tasks = [asyncio.create_task(plane.chat("full")) for _ in range(3)]
    await _held(plane, 3)
    # No start in the log: the default prediction, ten minutes.
    status, h, body = await plane.chat("full")
    assert status == 429 and h["Retry-After"] == "600"
    assert h["x-llmgw-reason"].startswith("queue_full: ")
    assert "3 requests already wait for full" in json.loads(body)["error"]["message"]
    s = await servers("full-1", "full")
    await plane.ready("full-1", "full", s.endpoint)
    assert [(await t)[0] for t in tasks] == [200] * 3
    assert plane.gateway.room.held() == 0


async def test_a_wait_is_bounded_by_the_clients_own_timeout(plane: Plane) -> None:
    await plane.model("slow-start")
    t0 = time.monotonic()
    status, h, _ = await plane.post(
        CHAT, _body("slow-start"), headers={"x-stainless-read-timeout": "0.4"}
    )
    waited = time.monotonic() - t0
    assert status == 429 and h["x-llmgw-reason"].startswith("not_ready_in_time: ")
    assert h["Retry-After"] == "600"
    assert 0.3 <= waited < 2
    assert plane.gateway.room.held() == 0


async def test_a_model_that_cannot_be_placed_is_a_503_with_the_decisions_reason(
    plane: Plane,
) -> None:
    await plane.model("nofit")
    task = asyncio.create_task(plane.chat("nofit"))
    await _held(plane, 1)
    failed = ev.make(
        ev.PlacementFailed(
            model="nofit",
            profiles=("p",),
            live=0,
            desired=1,
            reason="no_fit",
            why={"p": "needs 1 GPU, the most free on a node is 0"},
        ),
        id=new_id(),
        time=utc_now(),
        source="test",
    )
    p = await plane.pub.publish(failed)
    await plane.gateway.follower.wait_for(p.seq, 5)
    assert not task.done()  # the policy has not answered yet: it may preempt
    decided = ev.make(
        ev.PreemptionDecided(for_model="nofit", outcome="no_candidates", trigger=failed.id),
        id=new_id(),
        time=utc_now(),
        source="test",
        causation=failed.id,
    )
    p = await plane.pub.publish(decided)
    status, h, body = await asyncio.wait_for(task, 5)
    assert status == 503 and h["x-llmgw-reason"].startswith("no_candidates: ")
    msg = json.loads(body)["error"]["message"]
    assert "no replica may be stopped for it" in msg and "the most free on a node is 0" in msg
    assert "Retry-After" not in h
    # The plane has asked for it and said it cannot: the next one is told at once.
    await plane.say(ev.ScaleDesired(model="nofit", replicas=1))
    status, h, _ = await asyncio.wait_for(plane.chat("nofit"), 5)
    assert status == 503 and h["x-llmgw-reason"].startswith("no_candidates: ")
    assert plane.gateway.room.held() == 0


async def test_a_held_model_is_a_503_with_the_holds_end(plane: Plane) -> None:
    await plane.model("held-off")
    until = utc_now() + timedelta(seconds=42)
    await plane.say(ev.HoldCreated(model="held-off", for_model="other", until=until))
    status, h, body = await plane.chat("held-off")
    assert status == 503 and h["x-llmgw-reason"].startswith("held: ")
    assert 40 <= int(h["Retry-After"]) <= 43
    assert "gave up its room for other" in json.loads(body)["error"]["message"]


async def test_a_held_stream_refused_gets_the_refusal_as_its_event(plane: Plane) -> None:
    plane.gateway.keepalive_s = 0.02
    await plane.model("gone-model")
    async with plane.http.post(f"{plane.url}{CHAT}", json=_body("gone-model", stream=True)) as r:
        assert r.status == 200
        await _held(plane, 1)
        await plane.say(ev.ModelRemoved(name="gone-model"))
        got = await asyncio.wait_for(r.content.read(), 5)
    event = got.split(b"data: ", 1)[1]
    assert json.loads(event)["error"]["code"] == "unknown_model"
    assert plane.gateway.room.held() == 0


async def test_a_client_gone_while_held_leaves_nothing_held(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("leaver")
    tasks = [asyncio.create_task(plane.chat("leaver")) for _ in range(5)]
    await _held(plane, 5)
    for t in tasks[:3]:
        t.cancel()
    await _held(plane, 2)
    s = await servers("lv-1", "leaver")
    await plane.ready("lv-1", "leaver", s.endpoint)
    assert [(await t)[0] for t in tasks[3:]] == [200, 200]
    assert plane.gateway.room.held() == 0 and plane.gateway.router.inflight == {}
    assert s.served == 2


async def test_a_hundred_cold_starts_lose_no_held_request_and_each_ready_wakes_its_own(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    # Correctness only: the 50 ms wake target is a figure of tests/bench/bench_coldstart.py
    # (in the README), not a bound a loaded host can be held to here.
    plane.gateway.demand_interval_s = 60.0  # "at once" is then far from "an interval on"
    await plane.model("again")
    s = await servers("ag", "again")
    before = len(plane.gateway.counts.wakes)
    for i in range(100):
        rid = f"ag-{i}"
        demanded = plane.gateway.counts.demanded
        task = asyncio.create_task(plane.chat("again", max_tokens=1))
        await _held(plane, 1)
        # Each start's first request is demanded at once, though the last demand was
        # far less than the interval ago: it is the first of its wait.
        await wait_for(
            lambda: asyncio.sleep(0, plane.gateway.counts.demanded),
            lambda n, d=demanded: n > d,  # type: ignore[misc]
            10,
        )
        await _state(plane, rid, "again", "ready", s.endpoint)
        status, h, _ = await asyncio.wait_for(task, 5)
        assert status == 200 and h["x-llmgw-replica"] == rid
        await plane.say(
            ev.ReplicaDrain(replica=rid, model="again", reason="scale_down"), node=plane.node
        )
        await _state(plane, rid, "again", "stopped")
    # Every ready woke the request held for it, and none waited on anything but the fold
    # (a second is a sanity bound: a wake on a poll or a timer would be a wait's length).
    wakes = list(plane.gateway.counts.wakes)[before:]
    assert len(wakes) == 100
    assert max(wakes) < 1.0, f"slowest wake {max(wakes) * 1000:.0f} ms"
    assert plane.gateway.room.held() == 0 and plane.gateway.router.inflight == {}


async def test_demand_is_said_at_most_once_an_interval_while_requests_wait(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], nc: Client
) -> None:
    plane.gateway.demand_interval_s = 0.05
    await plane.model("steady")
    got: list[ev.ModelDemandedEvent] = []

    async def heard(msg: Any) -> None:
        got.append(codec.decode(msg.data))  # type: ignore[arg-type]

    sub = await nc.subscribe(subjects.demand_subject("steady"), cb=heard)
    tasks = [asyncio.create_task(plane.chat("steady")) for _ in range(3)]
    await _held(plane, 3)
    await wait_for(lambda: asyncio.sleep(0, len(got)), lambda n: n >= 4, 5)
    s = await servers("st-1", "steady")
    await plane.ready("st-1", "steady", s.endpoint)
    assert [(await t)[0] for t in tasks] == [200] * 3
    await wait_for(lambda: asyncio.sleep(0, got[-1].data.waiting), lambda n: n == 0, 5)
    await sub.unsubscribe()
    waiting = [e for e in got if e.data.waiting]
    assert waiting[-1].data.waiting == 3
    assert len({e.data.since for e in got}) == 1  # one wait, from its first request
    gaps = [(b.time - a.time).total_seconds() for a, b in itertools.pairwise(waiting)]
    assert min(gaps) >= 0.04, gaps  # the interval (the clock's grain aside)


@pytest.mark.parametrize("outcome", ["no_fit", "no_candidates", "quota_limit"])
@pytest.mark.parametrize("after", [False, True], ids=["held-before", "arriving-after"])
async def test_a_busy_model_the_plane_cannot_grow_still_holds_its_requests(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], outcome: str, after: bool
) -> None:
    # A model whose one replica is at its admission limit (target_inflight 1: two in
    # flight) asks for a second replica that cannot be placed. The requests held when the
    # policy says so, and those that come after it, wait for a slot of the replica that
    # serves: a 503 is for a model with nothing to route to.
    plane.gateway.min_wait_s = 30.0  # the wait outlasts the two streams holding the slots
    name = f"busy-{outcome}-{after}".replace("_", "-").lower()
    await plane.model(name, target_inflight=1, max=4)
    s = await servers(f"{name}-1", name, Timing(0.2, 5.0))  # a token every 0.2 s
    await plane.ready(f"{name}-1", name, s.endpoint)
    # Two streams of 6 tokens (1.2 s) fill both slots; the rest are of one token each.
    tasks = [asyncio.create_task(plane.chat(name, stream=True, max_tokens=6)) for _ in range(2)]
    await wait_for(
        lambda: asyncio.sleep(0, sum(plane.gateway.router.inflight.values())),
        lambda n: n == 2,
        10,
    )
    if not after:
        tasks += [asyncio.create_task(plane.chat(name, max_tokens=1)) for _ in range(2)]
        await _held(plane, 2, name)
    await plane.say(ev.ScaleDesired(model=name, replicas=2))
    failed = ev.make(
        ev.PlacementFailed(model=name, profiles=("p",), live=1, desired=2, reason=outcome),
        id=new_id(),
        time=utc_now(),
        source="test",
    )
    await plane.say(failed.data)
    await plane.say(ev.PreemptionDecided(for_model=name, outcome=outcome, trigger=failed.id))
    await wait_for(
        lambda: asyncio.sleep(0, plane.gateway.follower.view.state.decisions[-1].type),
        lambda t: t == "preemption.decided",
        10,
    )
    if after:
        tasks += [asyncio.create_task(plane.chat(name, max_tokens=1)) for _ in range(2)]
        await _held(plane, 2, name)  # held, not refused: the slots are still taken
    # No room for a second replica, but the first serves: nothing is refused.
    got = [await t for t in tasks]
    assert [status for status, _, _ in got] == [200] * 4, got
    assert s.served == 4
    assert plane.gateway.room.held() == 0 and plane.gateway.router.inflight == {}


async def test_a_gateway_stopped_with_requests_held_stops_and_their_demand_with_it(js: Any) -> None:
    from services.gateway.server import Gateway

    gw = Gateway(js, listen="127.0.0.1:0", demand_interval_s=0.05)
    sock = gw.bind()
    stop = asyncio.Event()
    ready = asyncio.Event()
    run = asyncio.create_task(gw.run(stop, sock, on_ready=lambda _: ready.set()))
    await asyncio.wait_for(ready.wait(), 10)
    pub = Publisher(js)
    p = await pub.publish(
        ev.make(
            ev.ModelDeclared(name="stopping", min=0, profiles=(ev.ProfileSpec(name="p", gpus=1),)),
            id=new_id(),
            time=utc_now(),
            source="test",
        )
    )
    await gw.follower.wait_for(p.seq, 5)
    async with aiohttp.ClientSession() as http:
        held = asyncio.create_task(http.post(f"{gw.url}{CHAT}", json=_body("stopping")))
        await wait_for(lambda: asyncio.sleep(0, gw.room.held()), lambda n: n == 1, 5)
        demand = gw.room.lines["stopping"].demand
        assert demand is not None
        stop.set()
        await asyncio.wait_for(run, 10)
        assert demand.done()
        with contextlib.suppress(aiohttp.ClientError):
            (await held).close()
