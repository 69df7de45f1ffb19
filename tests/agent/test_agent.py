"""The agent against a real broker: inventory, heartbeats, commands carried out, states
reported with their causes, and nothing done twice when commands come back.

The tests share their module's broker: each runs its agent as a node of its own (`node`)
and reads back only that node's events and consumer."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import events as ev
from schemas import subjects
from services.agent import Agent, NoStream, SimulatedRuntime, durable_name, spec
from services.agent.agent import ACK_WAIT_S, ctl_subject
from services.bus import EmbeddedBroker, Publisher, connect, consume
from services.bus.publish import scoped_id
from services.bus.stream import ensure_stream
from tests.agent.helpers import (
    by_replica,
    drain_cmd,
    node_events,
    sim_agent,
    start_cmd,
    states,
    wait_for,
)

pytestmark = [pytest.mark.timeout(30), pytest.mark.module_broker]

_nodes = itertools.count(1)
FAST = SimulatedRuntime(start_delay_s=0.02, load_delay_s=0.05, stop_delay_s=0.05)


@pytest.fixture
def node() -> str:
    """This test's node, a name no other test of the module uses."""
    return f"gpu-a{next(_nodes)}"


@pytest.fixture
async def running(nc: Client, js: JetStreamContext, node: str) -> AsyncIterator[Callable[..., Any]]:
    """`await running(**overrides)` starts an agent of `node` (8 H100) in a task; every
    agent started is stopped at the end of the test."""
    started: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(**kw: Any) -> Agent:
        agent = sim_agent(nc, js, node, **kw)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        started.append((stop, task))
        # Up means its inventory is stored and its consumer exists.
        await wait_for(lambda: _consumer_exists(js, agent.durable), bool, within_s=5)
        return agent

    yield start
    for stop, _ in started:
        stop.set()
    for _, task in started:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


async def _consumer_exists(js: JetStreamContext, durable: str) -> bool:
    try:
        await js.consumer_info(subjects.STREAM, durable)
    except NotFoundError:
        return False
    return True


def _done(replica_states: dict[str, list[str]], want: dict[str, str]) -> bool:
    return all(replica_states.get(r, [""])[-1] == s for r, s in want.items())


async def test_start_reports_starting_loading_ready_then_drain_reports_draining_stopped(
    js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    await running()
    pub = Publisher(js)
    start = start_cmd("r-7", node, (0, 1, 2, 3), model="llama-70b", profile="tp4")
    await pub.publish(start)
    got = await wait_for(lambda: states(js, node), lambda s: _done(by_replica(s), {"r-7": "ready"}))
    assert [e.data.state for e in got] == ["starting", "loading", "ready"]
    for e in got:
        assert e.causation == start.id
        assert e.correlation == start.correlation
        assert e.source == f"agent/{node}"
        assert (e.data.model, e.data.profile) == ("llama-70b", "tp4")
        assert e.data.shards == start.data.shards

    drain = drain_cmd("r-7", grace_s=0.05)
    await pub.publish(drain, node=node)
    got = await wait_for(
        lambda: states(js, node), lambda s: _done(by_replica(s), {"r-7": "stopped"})
    )
    assert [e.data.state for e in got] == ["starting", "loading", "ready", "draining", "stopped"]
    assert {e.causation for e in got[3:]} == {drain.id}
    # Nothing reported a correlation of its own: the drain starts its chain.
    assert {e.correlation for e in got[3:]} == {drain.id}
    assert got[3].data.reason == "preempted"


async def test_the_agent_of_one_shard_of_a_multi_node_replica_names_its_node(
    js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    """Every report on its shard of a two-node replica names this node (the fold stops
    the replica at its last shard's `stopped`); a one-node replica's name none."""
    await running()
    pub = Publisher(js)
    gang = start_cmd("r-g", node, (0, 1, 2, 3), profile="pp2")
    shards = (*gang.data.shards, ev.ShardSpec(node=f"{node}-other", gpus=(0, 1, 2, 3)))
    gang = msgspec.structs.replace(gang, data=msgspec.structs.replace(gang.data, shards=shards))
    await pub.publish(gang, node=node)
    await pub.publish(start_cmd("r-1", node, (4,)), node=node)
    want = {"r-g": "ready", "r-1": "ready"}
    await wait_for(lambda: states(js, node), lambda s: _done(by_replica(s), want))
    await pub.publish(drain_cmd("r-g"), node=node)
    got = await wait_for(
        lambda: states(js, node), lambda s: _done(by_replica(s), {"r-g": "stopped"})
    )
    said = [(e.data.state, e.data.node) for e in got if e.data.replica == "r-g"]
    assert said == [
        (state, node) for state in ("starting", "loading", "ready", "draining", "stopped")
    ]
    assert {e.data.node for e in got if e.data.replica == "r-1"} == {None}


async def test_inventory_at_start_and_heartbeats_on_core_nats_only(
    nc: Client, js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    beats: list[dict[str, Any]] = []

    async def on_beat(msg: Msg) -> None:
        beats.append(json.loads(msg.data))

    sub = await nc.subscribe(subjects.heartbeat_subject(node), cb=on_beat)
    try:
        await running(labels={"zone": "a"}, heartbeat_s=0.02)
        inv = await wait_for(lambda: node_events(js, node, "inventory"), bool)
        await wait_for(_async(lambda: beats), lambda b: len(b) >= 3)
    finally:
        await sub.unsubscribe()

    assert len(inv) == 1
    report = inv[0]
    assert isinstance(report, ev.NodeInventoryEvent)
    assert report.data.node == node
    assert [g.index for g in report.data.gpus] == list(range(8))
    assert {(g.model, g.memory_gb) for g in report.data.gpus} == {("H100", 80.0)}
    assert (report.data.cpu_cores, report.data.memory_gb) == (96, 1024)
    assert report.data.labels == {"zone": "a"}

    assert beats[0]["node"] == node
    assert beats[0]["replicas"] == 0
    assert "time" in beats[0]
    # Heartbeats are chatter: no stream stores their subject, and none is in the log.
    with pytest.raises(NotFoundError):
        await js.find_stream_name_by_subject(subjects.heartbeat_subject(node))
    stored = [d.subject async for b in consume.read_range(js, 1) for d in b]
    assert stored
    assert not any(".heartbeat." in s for s in stored)


async def test_a_gpu_found_unhealthy_at_discovery_is_published_unhealthy_until_reset(
    nc: Client, js: JetStreamContext, running: Callable[..., Any], node: str, tmp_path: Any
) -> None:
    # As `gpus.Nvml.gpus` finds them: GPU 1 has uncorrected ECC errors already counted.
    found = tuple(
        msgspec.structs.replace(g, healthy=g.index != 1)
        for g in spec.gpu_inventory(node, spec.parse_gpus("2xH100-80GB"))
    )
    health_file = tmp_path / "health.json"
    await running(gpus=found, health_file=health_file)
    inv = await wait_for(lambda: node_events(js, node, "inventory"), bool)
    assert isinstance(inv[0], ev.NodeInventoryEvent)
    assert [(g.index, g.healthy) for g in inv[0].data.gpus] == [(0, True), (1, False)]
    assert "1" in json.loads(health_file.read_text())

    # `llmgw gpu reset-health NODE 1` brings it back, in a new inventory.
    reply = await nc.request(ctl_subject(node), b'{"gpu": 1}', timeout=5)
    assert json.loads(reply.data) == {"gpu": 1, "was": "uncorrected ECC errors found at start"}
    inv = await wait_for(lambda: node_events(js, node, "inventory"), lambda i: len(i) == 2)
    assert isinstance(inv[1], ev.NodeInventoryEvent)
    assert [(g.index, g.healthy) for g in inv[1].data.gpus] == [(0, True), (1, True)]
    assert json.loads(health_file.read_text()) == {}


def _async(f: Callable[[], Any]) -> Callable[[], Any]:
    async def probe() -> Any:
        return f()

    return probe


async def test_redelivered_commands_past_the_dedupe_window_do_nothing_twice(
    nc: Client, js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    # The duplicate window is the server's smallest, so JetStream cannot be what keeps a
    # second copy out: the agent must know from the log what it already did.
    await ensure_stream(js, duplicate_window_s=0.1)
    pub = Publisher(js)
    cmds: list[ev.Event] = [
        start_cmd("r-1", node, (0,)),
        start_cmd("r-2", node, (1,)),
        start_cmd("r-3", node, (2,)),
    ]
    for c in cmds:
        await pub.publish(c)
    await pub.publish(drain_cmd("r-2"), node=node)
    stop = asyncio.Event()
    agent = sim_agent(
        nc,
        js,
        node,
        "4xH100-80GB",
        runtime=SimulatedRuntime(0.01, 0.01, 0.01),
        ack_wait_s=ACK_WAIT_S,
    )
    task = asyncio.create_task(agent.run(stop))
    want = {"r-1": "ready", "r-2": "stopped", "r-3": "ready"}
    before = await wait_for(lambda: states(js, node), lambda s: _done(by_replica(s), want))
    stop.set()
    await asyncio.wait_for(task, 5)

    # The consumer is lost (as if recreated by an operator): every command comes back.
    await js.delete_consumer(subjects.STREAM, durable_name(node))
    agent2 = await running(gpus=spec.gpu_inventory(node, spec.parse_gpus("4xH100-80GB")))
    await wait_for(
        lambda: js.consumer_info(subjects.STREAM, agent2.durable),
        lambda ci: ci.num_pending == 0 and ci.num_ack_pending == 0,
    )
    after = await states(js, node)
    assert [e.id for e in after] == [e.id for e in before]
    assert agent2.replicas() == want


async def test_drain_of_unknown_replica_and_start_on_missing_gpu(
    js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    agent = await running(gpus=spec.gpu_inventory(node, spec.parse_gpus("2xL4-24GB")))
    pub = Publisher(js)
    await pub.publish(drain_cmd("r-ghost"), node=node)
    await pub.publish(start_cmd("r-big", node, (1, 2, 3)))
    await pub.publish(start_cmd("r-ok", node, (0, 1)))
    await pub.publish(start_cmd("r-clash", node, (1,)))
    got = await wait_for(
        lambda: states(js, node),
        lambda s: _done(by_replica(s), {"r-big": "failed", "r-ok": "ready", "r-clash": "failed"}),
    )
    rs = by_replica(got)
    assert "r-ghost" not in rs
    assert rs["r-big"] == ["failed"]
    reasons = {e.data.replica: e.data.reason for e in got if e.data.state == "failed"}
    assert reasons["r-big"] == f"node {node} has no GPU 2, 3"
    assert reasons["r-clash"] == "GPU 1 held by replica r-ok"
    ci = await js.consumer_info(subjects.STREAM, agent.durable)
    assert ci.num_ack_pending == 0


async def test_drain_wins_over_a_start_in_flight(
    js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    await running(runtime=SimulatedRuntime(0.01, 30.0, 0.01))
    pub = Publisher(js)
    await pub.publish(start_cmd("r-slow", node, (0,)))
    await wait_for(lambda: states(js, node), lambda s: _done(by_replica(s), {"r-slow": "loading"}))
    await pub.publish(drain_cmd("r-slow", grace_s=5), node=node)
    got = await wait_for(
        lambda: states(js, node), lambda s: _done(by_replica(s), {"r-slow": "stopped"})
    )
    assert by_replica(got)["r-slow"] == ["starting", "loading", "draining", "stopped"]


async def test_a_drain_that_overtakes_its_start_still_wins(
    js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    pub = Publisher(js)
    start = start_cmd("r-9", node, (0,))
    await pub.publish(start)
    # An agent before this one took the start and died before acking it: it comes back
    # only after the ack wait, behind the drain sent meanwhile.
    taken = await js.pull_subscribe(
        subjects.commands_for_node(node),
        durable=durable_name(node),
        stream=subjects.STREAM,
        config=ConsumerConfig(
            durable_name=durable_name(node),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=1.0,
            max_deliver=5,
            filter_subject=subjects.commands_for_node(node),
            deliver_policy=DeliverPolicy.ALL,
        ),
    )
    [msg] = await taken.fetch(1, timeout=5)
    assert msg.headers and msg.headers["Nats-Msg-Id"] == scoped_id(msg.subject, start.id)
    await taken.unsubscribe()
    drain = drain_cmd("r-9")
    await pub.publish(drain, node=node)

    agent = await running(ack_wait_s=1.0)
    # The start came back (a third delivery: start, drain, start again) and was acked:
    # nothing is left for the agent to do.
    await wait_for(
        lambda: js.consumer_info(subjects.STREAM, agent.durable),
        lambda ci: ci.delivered.consumer_seq >= 3 and ci.num_ack_pending == 0,
    )
    got = await states(js, node)
    assert [(e.data.state, e.causation) for e in got] == [("stopped", drain.id)]
    assert got[0].data.shards == start.data.shards
    assert got[0].data.reason == "preempted: drained before it started"


async def test_synthetic_traffic_reports_use_at_most_once_per_interval(
    js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    await running(
        traffic={"busy": 60_000.0, "quiet": 0.0},
        used_interval_s=0.15,
        heartbeat_s=0.02,
        rng=random.Random(7),
    )
    pub = Publisher(js)
    await pub.publish(start_cmd("r-busy", node, (0,), model="busy"))
    await pub.publish(start_cmd("r-quiet", node, (1,), model="quiet"))
    used = await wait_for(
        lambda: node_events(js, node, "replica.>"),
        lambda es: sum(isinstance(e, ev.ReplicaUsedEvent) for e in es) >= 3,
    )
    reports = [e for e in used if isinstance(e, ev.ReplicaUsedEvent)]
    assert {e.data.replica for e in reports} == {"r-busy"}
    times = [e.time for e in reports]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.14, gaps
    assert all(e.data.at <= e.time for e in reports)


async def test_no_stream_is_one_clear_error(nats_server: EmbeddedBroker, node: str) -> None:
    # A broker of its own: the module's has the stream.
    conn = await connect(nats_server.url, "bare")
    try:
        agent = Agent(
            conn,
            conn.jetstream(),
            node=node,
            gpus=(),
            cpu_cores=1,
            memory_gb=1,
            runtime=FAST,
        )
        with pytest.raises(NoStream, match="has no stream LLMGW: start the control plane"):
            await agent.run(asyncio.Event())
    finally:
        await conn.close()


async def _serving(
    js: JetStreamContext, running: Callable[..., Any], node: str, replica: str, serve: Any
) -> list[ev.ReplicaStateEvent]:
    """An agent of `node` whose simulated servers answer with the timing `serve`, and
    `replica` (qwen-7b on GPU 0) started there: its states once it is ready."""
    await running(runtime=SimulatedRuntime(0.01, 0.01, 0.01, serve=serve))
    await Publisher(js).publish(start_cmd(replica, node, (0,), model="qwen-7b", profile="one"))
    return await wait_for(
        lambda: states(js, node), lambda s: _done(by_replica(s), {replica: "ready"})
    )


async def test_a_simulated_replica_serves_at_its_endpoint_until_it_stops(
    js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    import aiohttp

    from services.agent.responder import Timing

    got = await _serving(js, running, node, "r-9", Timing(0.0, 0.0))
    pub = Publisher(js)
    endpoint = got[-1].data.endpoint
    assert endpoint is not None and endpoint.startswith("http://127.0.0.1:")
    assert [e.data.endpoint for e in got[:-1]] == [None, None]
    body = {"model": "qwen-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{endpoint}/v1/chat/completions", json=body) as r:
            answer = await r.json()
        async with http.post(f"{endpoint}/v1/chat/completions", json=body) as r:
            again = await r.json()
        # Deterministic: the same request, the same words.
        text = answer["choices"][0]["message"]["content"]
        assert len(text.split()) == 3 and text == again["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] == 3
        async with http.post(
            f"{endpoint}/v1/completions", json={"model": "qwen-7b", "prompt": "x", "stream": True}
        ) as r:
            raw = await r.read()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert raw.endswith(b"data: [DONE]\n\n") and raw.startswith(b"data: {")
        await pub.publish(drain_cmd("r-9", grace_s=0.05), node=node)
        await wait_for(lambda: states(js, node), lambda s: _done(by_replica(s), {"r-9": "stopped"}))
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(f"{endpoint}/health") as r:
                pass


async def test_a_drained_simulated_replica_finishes_its_streams_within_the_grace(
    js: JetStreamContext, running: Callable[..., Any], node: str
) -> None:
    import aiohttp

    from services.agent.responder import Timing

    got = await _serving(js, running, node, "r-10", Timing(0.0, 20.0))
    pub = Publisher(js)
    endpoint = got[-1].data.endpoint
    body = {"model": "qwen-7b", "prompt": "x", "stream": True, "max_tokens": 10}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{endpoint}/v1/completions", json=body) as r,
    ):
        first = await r.content.readany()
        # Drained mid-stream, with a grace longer than the stream: it runs to its end.
        await pub.publish(drain_cmd("r-10", grace_s=5.0), node=node)
        rest = await r.read()
    assert (first + rest).endswith(b"data: [DONE]\n\n")
    await wait_for(lambda: states(js, node), lambda s: _done(by_replica(s), {"r-10": "stopped"}))
    # A stream longer than the grace is cut when the grace ends: stopped is not late.
    await pub.publish(start_cmd("r-11", node, (1,), model="qwen-7b", profile="one"))
    got = await wait_for(
        lambda: states(js, node), lambda s: _done(by_replica(s), {"r-11": "ready"})
    )
    endpoint = got[-1].data.endpoint
    long = {**body, "max_tokens": 200}  # 10 s at 20 tokens a second
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{endpoint}/v1/completions", json=long) as r,
    ):
        await r.content.readany()
        t0 = time.monotonic()
        await pub.publish(drain_cmd("r-11", grace_s=0.3), node=node)
        with contextlib.suppress(aiohttp.ClientPayloadError):
            rest = await r.read()
            assert not rest.endswith(b"data: [DONE]\n\n")
    await wait_for(lambda: states(js, node), lambda s: _done(by_replica(s), {"r-11": "stopped"}))
    assert time.monotonic() - t0 < 3


async def test_a_restarted_simulated_agent_answers_at_the_endpoint_the_log_holds(
    nc: Client, js: JetStreamContext, node: str
) -> None:
    import aiohttp

    from services.agent.responder import Timing

    def agent(runtime: SimulatedRuntime) -> Agent:
        return sim_agent(nc, js, node, "2xH100-80GB", runtime=runtime)

    first = SimulatedRuntime(0.01, 0.01, 0.01, serve=Timing(0.0, 0.0))
    stop = asyncio.Event()
    task = asyncio.create_task(agent(first).run(stop))
    await Publisher(js).publish(start_cmd("r-12", node, (0,), model="qwen-7b", profile="one"))
    got = await wait_for(
        lambda: states(js, node), lambda s: _done(by_replica(s), {"r-12": "ready"})
    )
    endpoint = got[-1].data.endpoint
    stop.set()
    await asyncio.wait_for(task, 5)
    await first.close()  # the process gone, and its servers with it
    again = SimulatedRuntime(0.01, 0.01, 0.01, serve=Timing(0.0, 0.0))
    stop = asyncio.Event()
    task = asyncio.create_task(agent(again).run(stop))
    try:
        # Adopted from the log, it answers where the log says it does.
        async def where() -> str | None:
            return again.endpoint("r-12")

        assert await wait_for(where, lambda e: e is not None, 5) == endpoint
        async with aiohttp.ClientSession() as http, http.get(f"{endpoint}/health") as r:
            assert r.status == 200
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await again.close()
