"""An agent's credentials, on a real nats-server running the shipped deploy/nats config:
what its agent needs works, and everything else is refused by the server.

Refused means the server said so: a permissions violation for that subject arrives
(nats-py hands it to `error_cb`), and the request that needed it never got an answer, or
JetStream answered with an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import subjects
from services.agent import SimulatedRuntime, gpu_inventory, parse_gpus
from services.agent import consumers as agent_consumers
from services.agent.agent import Agent, durable_name, inbox_prefix, reader_name
from services.bus import consume, ensure_streams
from tests.deploy.natsconf import (
    CONTROL_PASSWORD,
    Rendered,
    agent_password,
    render_single,
    server,
)

pytestmark = pytest.mark.timeout(60)

A1, A2 = "gpu-a1", "gpu-a2"


@dataclass
class Conn:
    nc: Client
    errors: list[str] = field(default_factory=list)

    def violations(self, subject: str, since: int = 0) -> list[str]:
        """The server's refusals of `subject` (nats-py lowercases them) after the first
        `since` errors."""
        want = f'permissions violation for {{}} to "{subject.lower()}"'
        return [
            e
            for e in self.errors[since:]
            if any(want.format(kind) in e.lower() for kind in ("publish", "subscription"))
        ]


async def _connect(r: Rendered, user: str, password: str, inbox: str = "_INBOX") -> Conn:
    c = Conn(nc=Client())

    async def on_error(e: Exception) -> None:
        c.errors.append(str(e))

    await c.nc.connect(
        servers=[r.url(user, password)],
        name=f"test {user}",
        error_cb=on_error,
        inbox_prefix=inbox,
        allow_reconnect=False,
    )
    return c


@dataclass
class Env:
    rendered: Rendered
    control: Conn
    a1: Conn


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    r = render_single(tmp_path / "nats", [A1, A2])
    with server(r, tmp_path / "nats.log"):
        control = await _connect(r, "control", CONTROL_PASSWORD)
        a1 = await _connect(r, A1, agent_password(A1), inbox_prefix(A1))
        try:
            await ensure_streams(control.nc.jetstream())
            yield Env(r, control, a1)
        finally:
            await a1.nc.close()
            await control.nc.close()


async def _violation(c: Conn, subject: str, since: int) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while not c.violations(subject, since):
        assert asyncio.get_running_loop().time() < deadline, (subject, c.errors)
        await asyncio.sleep(0.01)


async def _refused(c: Conn, subject: str, request: Callable[[], Awaitable[Any]]) -> None:
    """`request` needs `subject`, which the server refuses: the violation arrives, and the
    request has no answer (it is cancelled once the refusal is in) or failed."""
    since = len(c.errors)
    task = asyncio.ensure_future(request())
    try:
        await _violation(c, subject, since)
        await asyncio.sleep(0)
        if task.done():
            assert task.exception() is not None, f"{subject}: answered {task.result()!r}"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _publish_refused(c: Conn, subject: str) -> None:
    since = len(c.errors)
    await c.nc.publish(subject, b"{}")
    await c.nc.flush()
    await _violation(c, subject, since)


async def _subscribe_refused(c: Conn, subject: str) -> None:
    got: list[Any] = []

    async def cb(msg: Any) -> None:
        got.append(msg)

    since = len(c.errors)
    sub = await c.nc.subscribe(subject, cb=cb)
    await c.nc.flush()
    await _violation(c, subject, since)
    assert got == []
    await sub.unsubscribe()


def _cmd_consumer(name: str, filt: str, **extra: Any) -> ConsumerConfig:
    return ConsumerConfig(
        name=name,
        durable_name=name,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        filter_subject=filt,
        **extra,
    )


async def test_an_agent_reads_model_runtimes_and_answers_its_ctl_requests(env: Env) -> None:
    """The process runtime needs a model's declaration (its `runtime`), and
    `llmgw gpu reset-health` asks the agent on llmgw.ctl.<node>: both allowed, and
    another node's ctl subject refused."""
    a1 = env.a1
    await agent_consumers.provide(env.control.nc.jetstream(), A1)
    ack = await env.control.nc.jetstream().publish("llmgw.catalog.model.chat", b"declared")
    seen = []
    async for batch in consume.read_pulled(
        a1.nc.jetstream(), reader_name(A1), 1, only="llmgw.catalog.model.chat"
    ):
        seen += [d.seq for d in batch]
    assert seen == [ack.seq]

    async def answer(msg: Any) -> None:
        await msg.respond(b"ok")

    sub = await a1.nc.subscribe(f"llmgw.ctl.{A1}.gpu.reset-health", cb=answer)
    await a1.nc.flush()
    # The server has the subscription once the flush is answered; on a loaded machine its
    # interest has been seen to arrive a moment later, so "no responders" is asked again.
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            reply = await env.control.nc.request(
                f"llmgw.ctl.{A1}.gpu.reset-health", b"{}", timeout=5
            )
            break
        except nats.errors.NoRespondersError:
            assert asyncio.get_running_loop().time() < deadline, a1.errors
            await asyncio.sleep(0.05)
    assert reply.data == b"ok"
    await sub.unsubscribe()
    assert a1.errors == []
    await _subscribe_refused(a1, f"llmgw.ctl.{A2}.gpu.reset-health")


async def test_what_an_agent_needs_is_allowed(env: Env) -> None:
    a1 = env.a1
    js = a1.nc.jetstream()
    # Its consumers, asked of the control plane on its hello subject.
    stop = asyncio.Event()
    control_js = env.control.nc.jetstream()
    served = asyncio.create_task(agent_consumers.serve(env.control.nc, control_js, "llmgw", stop))
    try:
        async with asyncio.timeout(10):
            while True:  # until the responder's subscription is in
                try:
                    reply = await a1.nc.request(
                        agent_consumers.hello_subject(A1), b'{"ack_wait_s": 2.5}', timeout=5
                    )
                    break
                except nats.errors.NoRespondersError:
                    await asyncio.sleep(0.02)
        assert json.loads(reply.data) == {"ok": True}
    finally:
        stop.set()
        await served
    for name in (durable_name(A1), reader_name(A1)):
        info = await js.consumer_info("LLMGW", name)
        assert info.config.deliver_subject is None
    # Its commands' redelivery, as it asked (`llmgw agent --ack-wait`).
    assert (await js.consumer_info("LLMGW", durable_name(A1))).config.ack_wait == 2.5
    # Its own node's reports, stored.
    ack = await js.publish(f"llmgw.node.{A1}.inventory", b'{"x":1}')
    await js.publish(f"llmgw.node.{A1}.replica.r-1", b'{"x":2}')
    await a1.nc.publish(f"llmgw.heartbeat.{A1}", b"{}")
    await a1.nc.flush()
    # Its commands, through its durable consumer, filtered to them.
    await control_js.publish(f"llmgw.cmd.{A1}.replica.start", b"cmd-a1")
    await control_js.publish(f"llmgw.cmd.{A2}.replica.start", b"cmd-a2")
    psub = await js.pull_subscribe_bind(durable_name(A1), "LLMGW")
    msgs = await psub.fetch(10, timeout=5)
    assert [m.data for m in msgs] == [b"cmd-a1"]
    await msgs[0].ack_sync()
    # Its own history, through its reader, from the first sequence every time.
    for _ in range(2):
        seen = []
        async for batch in consume.read_pulled(js, reader_name(A1), 1, only=f"llmgw.node.{A1}.>"):
            seen += [d.seq for d in batch]
        assert seen == [ack.seq, ack.seq + 1]
    async for batch in consume.read_pulled(
        js, reader_name(A1), 1, only=f"llmgw.cmd.{A1}.replica.start"
    ):
        assert [d.data for d in batch] == [b"cmd-a1"]
    assert a1.errors == []


async def test_other_nodes_and_the_operators_subjects_are_refused(env: Env) -> None:
    a1 = env.a1
    for subject in [
        f"llmgw.node.{A2}.inventory",
        f"llmgw.node.{A2}.replica.r-1",
        f"llmgw.heartbeat.{A2}",
        f"llmgw.node.{A1}.status",  # node.uncordoned (and cordoned, lost): the operator's
        f"llmgw.cmd.{A1}.replica.start",
        "llmgw.catalog.scale.chat",
        "llmgw.preemption.decided.chat",
        f"llmgw.dlq.{durable_name(A2)}",
        f"llmgw.hello.{A2}",
        f"llmgw.ctl.{A2}.gpu.reset-health",
        f"llmgw.ctl.{A1}.gpu.reset-health",
    ]:
        await _publish_refused(a1, subject)
    # No command is readable off the bus, its own neither: only through its consumer.
    for subject in ["llmgw.>", "llmgw.cmd.>", f"llmgw.cmd.{A2}.>", f"llmgw.cmd.{A1}.>"]:
        await _subscribe_refused(a1, subject)
    # The stream stored nothing of it.
    info = await env.control.nc.jetstream().stream_info("LLMGW")
    assert info.state.messages == 0


async def test_an_agent_creates_no_consumer(env: Env) -> None:
    """Not even its own with its own filter: a create's body is the agent's, and a
    `deliver_subject` in it makes the server re-send what the agent stored anywhere."""
    a1 = env.a1
    jsm = a1.nc.jetstream()
    await agent_consumers.provide(env.control.nc.jetstream(), A1)
    api = "$JS.API.CONSUMER"
    mine, reader = durable_name(A1), reader_name(A1)
    elsewhere = f"llmgw.ctl.{A2}.gpu.reset-health"
    cases = [
        # Its own consumers, as made (an update), and pushing to another node's ctl subject,
        # another node's heartbeat, the control plane's inbox, a DLQ subject.
        (mine, f"llmgw.cmd.{A1}.>", {}),
        (mine, f"llmgw.cmd.{A1}.>", {"deliver_subject": elsewhere}),
        (reader, f"llmgw.node.{A1}.>", {"deliver_subject": f"llmgw.heartbeat.{A2}"}),
        (reader, f"llmgw.node.{A1}.>", {"deliver_subject": "_INBOX.x"}),
        (reader, "llmgw.catalog.model.*", {"deliver_subject": "llmgw.dlq.projector"}),
        # Its durable, reading everything, or another node's commands.
        (mine, "llmgw.>", {}),
        (mine, f"llmgw.cmd.{A2}.>", {}),
        (reader, f"llmgw.node.{A2}.>", {}),
        # Another node's durable, or any other name (a control-plane consumer).
        (durable_name(A2), f"llmgw.cmd.{A1}.>", {}),
        ("preemption", f"llmgw.cmd.{A1}.>", {}),
    ]
    for name, filt, extra in cases:
        subject = f"{api}.CREATE.LLMGW.{name}.{filt}"
        await _refused(
            a1,
            subject,
            lambda n=name, f=filt, x=extra: jsm._jsm.add_consumer(
                "LLMGW", _cmd_consumer(n, f, **x)
            ),
        )
    # The create subjects whose filter no permission can see: ephemeral, legacy durable,
    # and the multi-filter create of its own reader.
    body = json.dumps(
        {
            "stream_name": "LLMGW",
            "config": {"filter_subject": "llmgw.>", "ack_policy": "none", "deliver_subject": "x"},
        }
    ).encode()
    for subject in [
        f"{api}.CREATE.LLMGW",
        f"{api}.CREATE.LLMGW.{reader}",
        f"{api}.DURABLE.CREATE.LLMGW.{mine}",
    ]:
        await _refused(a1, subject, lambda s=subject: a1.nc.request(s, body, timeout=30))
    # Someone else's consumer, or its own deleted: pulled, reset, deleted, looked at, listed.
    for subject in [
        f"{api}.MSG.NEXT.LLMGW.{durable_name(A2)}",
        f"{api}.MSG.NEXT.LLMGW.{reader_name(A2)}",
        f"{api}.RESET.LLMGW.{reader_name(A2)}",
        f"{api}.RESET.LLMGW.{mine}",
        f"{api}.DELETE.LLMGW.{durable_name(A2)}",
        f"{api}.DELETE.LLMGW.{mine}",
        f"{api}.DELETE.LLMGW.{reader}",
        f"{api}.INFO.LLMGW.{durable_name(A2)}",
        f"{api}.LIST.LLMGW",
        f"{api}.NAMES.LLMGW",
        f"$JS.ACK.LLMGW.{durable_name(A2)}.1.1.1.1.1.0",
    ]:
        await _refused(a1, subject, lambda s=subject: a1.nc.request(s, b"{}", timeout=30))
    # 0 consumers that push anywhere.
    control_js = env.control.nc.jetstream()
    made = [c async for c in _consumers(control_js)]
    assert sorted(c.name for c in made) == sorted([mine, reader])
    assert [c.name for c in made if c.config.deliver_subject] == []


async def _consumers(js: Any) -> AsyncIterator[Any]:
    for c in await js.consumers_info("LLMGW"):
        yield c


async def test_inboxes_stream_and_leases_are_refused(env: Env) -> None:
    a1 = env.a1
    # Others' inboxes: the control plane's (_INBOX.) and another agent's.
    for subject in ["_INBOX.>", "_INBOX.abc.*", f"{inbox_prefix(A2)}.>", ">"]:
        await _subscribe_refused(a1, subject)
    for subject in ["_INBOX.abc.1", f"{inbox_prefix(A2)}.x.1"]:
        await _publish_refused(a1, subject)
    # The stream: delete, purge, update, read any message of it.
    api = "$JS.API.STREAM"
    for subject in [
        f"{api}.DELETE.LLMGW",
        f"{api}.PURGE.LLMGW",
        f"{api}.UPDATE.LLMGW",
        f"{api}.MSG.GET.LLMGW",
        f"{api}.INFO.LLMGW",  # its subjects name every node, replica and model
        f"{api}.MSG.DELETE.LLMGW",
        "$JS.API.DIRECT.GET.LLMGW",
        f"{api}.DELETE.LLMGW_DLQ",
    ]:
        await _refused(a1, subject, lambda s=subject: a1.nc.request(s, b"{}", timeout=30))
    # The leader leases (KV llmgw_leases): write, watch, read.
    await _publish_refused(a1, "$KV.llmgw_leases.scheduler")
    await _subscribe_refused(a1, "$KV.llmgw_leases.>")
    for subject in [
        "$JS.API.STREAM.INFO.KV_llmgw_leases",
        "$JS.API.DIRECT.GET.KV_llmgw_leases.$KV.llmgw_leases.scheduler",
        "$JS.API.STREAM.PURGE.KV_llmgw_leases",
    ]:
        await _refused(a1, subject, lambda s=subject: a1.nc.request(s, b"{}", timeout=30))
    await _refused(
        a1,
        "$JS.API.STREAM.INFO.KV_llmgw_leases",
        lambda: a1.nc.jetstream().key_value("llmgw_leases"),
    )


async def test_no_credentials_no_connection(env: Env) -> None:
    for url in [f"nats://127.0.0.1:{env.rendered.port}", env.rendered.url(A1, "wrong")]:
        nc = Client()
        try:
            with pytest.raises((nats.errors.Error, OSError)):
                await nc.connect(
                    servers=[url], allow_reconnect=False, connect_timeout=5, error_cb=_quiet
                )
        finally:
            await nc.close()


async def _quiet(e: Exception) -> None:
    pass


async def test_a_node_named_with_dots_logs_in_as_its_name(tmp_path: Path) -> None:
    """A cloud host's name (`ip-10-0-1-2.ec2.internal`): the agent logs in as the name as
    it is, and its subjects are the name's subject token (dots escaped)."""
    node = "ip-10-0-1-2.ec2.internal"
    r = render_single(tmp_path / "nats", [node, A2])
    with server(r, tmp_path / "nats.log"):
        c = await _connect(r, node, agent_password(node), inbox_prefix(node))
        try:
            since = len(c.errors)
            await c.nc.publish(subjects.inventory_subject(node), b"{}")
            await c.nc.publish(subjects.heartbeat_subject(node), b"{}")
            await c.nc.flush()
            await _publish_refused(c, subjects.inventory_subject(A2))
            assert c.violations(subjects.inventory_subject(node), since) == []
            assert c.violations(subjects.heartbeat_subject(node), since) == []
        finally:
            await c.nc.close()


async def test_an_agent_started_before_the_plane_waits_for_its_consumers(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """No plane answers its hello and it may not make them itself: it says so once, and
    comes up as soon as a plane answers."""
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    agent = Agent(
        env.a1.nc,
        env.a1.nc.jetstream(timeout=1),
        node=A1,
        gpus=gpu_inventory(A1, parse_gpus("1xH100-80GB")),
        cpu_cores=8,
        memory_gb=64,
        runtime=SimulatedRuntime(0.01, 0.01, 0.01),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    served = None
    try:
        async with asyncio.timeout(10):
            while not any("waiting for its consumers" in r.message for r in caplog.records):
                assert not task.done(), task
                await asyncio.sleep(0.02)
        control = env.control.nc
        served = asyncio.create_task(
            agent_consumers.serve(control, control.jetstream(), "llmgw", stop)
        )
        async with asyncio.timeout(10):
            while not any(": up:" in r.message for r in caplog.records):
                assert not task.done(), task
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        if served is not None:
            await served
    waits = [r.message for r in caplog.records if "waiting for its consumers" in r.message]
    assert len(waits) == 1 and "may not make them" in waits[0], waits


async def test_an_agent_hears_the_gateways_announcements_and_cannot_forge_one(env: Env) -> None:
    """The gateways (control role) announce themselves; an agent hears them (so that a
    drain does not wait for a gone one), and may neither announce as a gateway, say one
    leaves, nor ask for a roll call."""
    from datetime import UTC, datetime

    from schemas import fleet as schema
    from services.bus.fleet import Fleet

    gateway = Fleet(
        env.control.nc,
        me=lambda: schema.GatewayAnnouncement(gateway="g-1", started=datetime.now(UTC)),
    )
    heard = Fleet(env.a1.nc, rollcall=False)
    await heard.start()
    await gateway.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while "g-1" not in heard.live():
            assert asyncio.get_running_loop().time() < deadline, env.a1.errors
            await asyncio.sleep(0.01)
        assert env.a1.violations(subjects.gateway_announce_wildcard()) == []
        await _publish_refused(env.a1, subjects.gateway_announce_subject("g-1"))
        await _publish_refused(env.a1, subjects.gateway_rollcall_subject())
        assert "g-1" in heard.live()
    finally:
        await gateway.stop()
        await heard.stop()
