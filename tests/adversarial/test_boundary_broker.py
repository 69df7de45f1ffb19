"""The adversarial suite at the broker's boundary: a compromised GPU host holds one agent's
credentials under the shipped deploy/nats permissions, beside a running plane (`llmgw up
--nats` as `control`, a real process) and the agent of another node, and tries to act for
that node, keep its events off the log, or fill the broker. After each attack, as in
test_bad_input: every process is alive, a sentinel event sent after it is applied, and
the SQLite view equals an offline replay of the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, PubAck
from nats.js.client import JetStreamContext

from schemas import codec, ids, subjects
from schemas import events as ev
from services.agent import SimulatedRuntime, gpu_inventory, parse_gpus
from services.agent import consumers as agent_consumers
from services.agent.agent import Agent, ctl_subject, durable_name, inbox_prefix, reader_name
from services.bus import DLQ_STREAM, Publisher, consume
from services.bus.consume import DeadLetter
from services.bus.publish import COLLISIONS, scoped_id
from services.bus.stream import (
    DLQ_MAX_MSG_BYTES,
    MAX_MSG_BYTES,
    NODE_MAX_BYTES,
    is_full,
    node_stream_name,
)
from services.clock import new_id
from tests.adversarial.test_bad_input import (
    Plane,
    _dead_letter_for,
    _replayed_equals_live,
    _settle,
)
from tests.agent.helpers import drain_cmd, start_cmd
from tests.deploy.natsconf import (
    CONTROL_PASSWORD,
    Rendered,
    agent_password,
    render_single,
    server,
    wait_for,
)
from tests.up_process import FAST, UpProcess

pytestmark = [pytest.mark.timeout(60)]

A1, A2 = "gpu-a1", "gpu-a2"  # the attacker's node, and the node it attacks
BAD_GPU = 3
MODEL_OF_TEST = "two-node"


@dataclass
class Boundary:
    plane: Plane
    rendered: Rendered
    base: Path

    def url(self, user: str) -> str:
        password = CONTROL_PASSWORD if user == "control" else agent_password(user)
        return self.rendered.url(user, password)


@pytest.fixture(scope="module")
def boundary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Boundary]:
    base = tmp_path_factory.mktemp("boundary")
    with plane_on(render_single(base / "nats", [A1, A2]), base) as b:
        yield b


@contextlib.contextmanager
def plane_on(r: Rendered, base: Path, *args: str, gateway: bool = False) -> Iterator[Boundary]:
    """The rendered server with the shipped roles, and `llmgw up --nats` as `control` on
    it (FAST, and `args`), once its services run (and its gateway serves, with
    `gateway`); at the end, its log must hold no traceback."""
    with server(r, base / "nats.log"):
        control = r.url("control", CONTROL_PASSWORD)
        up = UpProcess(base / "data", base / "up.log", "--nats", control, *FAST, *args)
        try:
            wait_for(
                "llmgw up to run its services",
                lambda: (
                    (up.alive() or pytest.fail(up.text()[-3000:]))
                    and "preemption service" in up.text()
                    and (not gateway or "gateway: serving" in up.text())
                ),
            )
            yield Boundary(Plane(up, control), r, base)
        finally:
            up.stop()
    text = up.text()
    assert "Traceback" not in text, text[-3000:]


async def _connect(url: str, inbox: str = "_INBOX") -> tuple[Client, list[str]]:
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await nats.connect(url, inbox_prefix=inbox, error_cb=on_error, allow_reconnect=False)
    return nc, errors


@pytest_asyncio.fixture(loop_scope="function")
async def js(boundary: Boundary) -> AsyncIterator[JetStreamContext]:
    nc, _ = await _connect(boundary.url("control"))
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def _victim(boundary: Boundary, tmp: Path) -> AsyncIterator[Agent]:
    """The agent of A2, in this process, as A2's user: GPU BAD_GPU kept unhealthy."""
    health = tmp / "health.json"
    health.write_text(json.dumps({str(BAD_GPU): "uncorrected ECC errors"}))
    nc, _ = await _connect(boundary.url(A2), inbox_prefix(A2))
    agent = Agent(
        nc,
        nc.jetstream(),
        node=A2,
        gpus=gpu_inventory(A2, parse_gpus("8xH100-80GB")),
        cpu_cores=64,
        memory_gb=512,
        runtime=SimulatedRuntime(0.01, 0.05, 0.01),
        heartbeat_s=0.5,
        health_file=health,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    control, _ = await _connect(boundary.url("control"))
    try:
        # Up once its ctl subject answers (a request that asks nothing: an error back).
        async with asyncio.timeout(20):
            while True:
                assert not task.done(), task
                with contextlib.suppress(nats.errors.NoRespondersError):
                    await control.request(ctl_subject(A2), b"{}", timeout=5)
                    break
                await asyncio.sleep(0.02)
        await control.close()
        yield agent
        assert not task.done(), task
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await nc.close()


async def _hello(nc: Client, node: str) -> None:
    """What every agent does first: ask the plane for its consumers, which makes its
    node's stream too (the log takes nodes' reports through them here)."""
    hello = await nc.request(agent_consumers.hello_subject(node), b"{}", timeout=10)
    assert json.loads(hello.data) == {"ok": True, "stream": node_stream_name(node)}


async def _checks(boundary: Boundary, js: JetStreamContext, tmp: Path, n: int) -> None:
    """Every process alive, the sentinel applied, the view equal to the log's replay."""
    assert boundary.plane.alive(), boundary.plane.log.read_text()[-3000:]
    live = await _settle(js, boundary.plane, tmp, n)
    await _replayed_equals_live(js, live, tmp)


async def _until(what: str, cond: Any, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not cond():  # noqa: ASYNC110 (a condition of a log, no event to wait on)
            await asyncio.sleep(0.02)


async def test_an_agent_cannot_clear_another_nodes_quarantine(
    boundary: Boundary, js: JetStreamContext, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """gpu-a1 tries to make gpu-a2's agent bring back its faulty GPU: by a consumer that
    pushes to gpu-a2's ctl subject (refused: agents create no consumer), and by naming
    that subject as the reply of its own pull and API requests (the server delivers, and
    gpu-a2's agent refuses a request no operator sent). An operator's request still works,
    and the agent says who asked."""
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    target = ctl_subject(A2)
    async with _victim(boundary, tmp_path) as victim:
        assert BAD_GPU in victim._unhealthy
        nc, _ = await _connect(boundary.url(A1), inbox_prefix(A1))
        try:
            await agent_consumers.provide(js, A1)
            ajs = nc.jetstream()
            # 1. A push consumer of its own history, delivering to gpu-a2's ctl subject.
            forged = json.dumps({"gpu": BAD_GPU}).encode()
            await ajs.publish(subjects.inventory_subject(A1), forged)
            for name, filt in [
                (reader_name(A1), f"llmgw.node.{A1}.>"),
                (durable_name(A1), f"llmgw.cmd.{A1}.>"),
                ("push", f"llmgw.node.{A1}.>"),
            ]:
                config = ConsumerConfig(
                    name=name,
                    durable_name=name,
                    ack_policy=AckPolicy.NONE,
                    deliver_policy=DeliverPolicy.ALL,
                    filter_subject=filt,
                    deliver_subject=target,
                )
                with pytest.raises((nats.errors.Error, TimeoutError)):
                    await ajs._jsm.add_consumer("LLMGW", config, timeout=1)
            # The plane's own readers push to its inbox; nothing pushes anywhere else.
            pushing = [
                (c.name, c.config.deliver_subject)
                for c in await js.consumers_info("LLMGW")
                if c.config.deliver_subject and not c.config.deliver_subject.startswith("_INBOX.")
            ]
            assert pushing == []
            # 2. Its own pull and API requests, answered to gpu-a2's ctl subject.
            await nc.request(
                f"$JS.API.CONSUMER.RESET.LLMGW.{reader_name(A1)}", b'{"seq": 1}', timeout=5
            )
            await nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.LLMGW.{reader_name(A1)}",
                json.dumps({"batch": 5, "no_wait": True}).encode(),
                reply=target,
            )
            await nc.publish(f"$JS.API.CONSUMER.INFO.LLMGW.{reader_name(A1)}", b"", reply=target)
            await nc.flush()
            await _until(
                "gpu-a2's agent to refuse what the server delivered",
                lambda: victim._ctl_guard.refused >= 2,
            )
        finally:
            await nc.close()
        # Counted each, said once (then at most once per 30 s).
        said = [r.message for r in caplog.records if "ctl request refused" in r.message]
        assert len(said) == 1, said
        assert BAD_GPU in victim._unhealthy
        assert not any("healthy again" in r.message for r in caplog.records)
        # An operator's request (the control role) is answered, and the log says who.
        cnc, _ = await _connect(boundary.url("control"))
        try:
            reply = await cnc.request(
                target, json.dumps({"gpu": BAD_GPU, "by": "ops@bastion"}).encode(), timeout=5
            )
        finally:
            await cnc.close()
        assert json.loads(reply.data)["was"] == "uncorrected ECC errors"
        assert BAD_GPU not in victim._unhealthy
        said = [r.message for r in caplog.records if "healthy again" in r.message]
        assert len(said) == 1 and "by request of ops@bastion" in said[0], said
    await _checks(boundary, js, tmp_path, 1)


async def test_a_taken_message_id_keeps_no_event_off_the_log(
    boundary: Boundary, js: JetStreamContext, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica with shards on gpu-a1 and gpu-a2: gpu-a1 sees the placement, so it can
    derive gpu-a2's start command, gpu-a2's state reports and a drain, and send each id
    first on its own subject (scoped as publishers scope them, and bare as they were).
    Every one of gpu-a2's events and the plane's commands is stored all the same, and
    each taken id is said."""
    caplog.set_level(logging.INFO)
    replica = f"r-two-{tmp_path.name[-6:]}"
    placement = new_id()
    start = msgspec.structs.replace(
        start_cmd(replica, A2, (0, 1), model=MODEL_OF_TEST),
        id=ids.derived(placement, f"start\x00{A2}"),
        causation=placement,
    )
    start = msgspec.structs.replace(
        start,
        data=msgspec.structs.replace(
            start.data,
            shards=(ev.ShardSpec(node=A1, gpus=(0, 1)), ev.ShardSpec(node=A2, gpus=(0, 1))),
        ),
    )
    drain = msgspec.structs.replace(
        drain_cmd(replica, model=MODEL_OF_TEST), id=ids.derived(placement, f"drain\x00{A2}")
    )
    report = subjects.replica_subject(A2, replica)
    taken = [
        (subjects.command_subject(A2, "start"), start.id),
        (subjects.command_subject(A2, "drain"), drain.id),
        *[(report, ids.derived(start.id, f"state:{s}")) for s in ("starting", "loading", "ready")],
        *[(report, ids.derived(drain.id, f"state:{s}")) for s in ("draining", "stopped")],
    ]
    nc, _ = await _connect(boundary.url(A1), inbox_prefix(A1))
    try:
        await _hello(nc, A1)
        ajs = nc.jetstream()
        own = subjects.replica_subject(A1, replica)
        for subject, eid in taken:
            for header in (scoped_id(subject, eid), eid):
                await ajs.publish(own, b"{}", headers={"Nats-Msg-Id": header})
    finally:
        await nc.close()
    # In the log (from gpu-a1's node stream) before any real event is sent.
    async with asyncio.timeout(10):
        while len(await _stored(js, 0, own)) < 2 * len(taken):  # noqa: ASYNC110 (a read)
            await asyncio.sleep(0.02)
    before = sum(COLLISIONS.values())
    plane = Publisher(js)
    async with _victim(boundary, tmp_path) as victim:
        await plane.publish(start, node=A2)
        await _until(
            "gpu-a2 to report its shard ready", lambda: victim.replicas() == {replica: "ready"}
        )
        await plane.publish(drain, node=A2)
        await _until("gpu-a2 to stop it", lambda: victim.replicas() == {replica: "stopped"})
    stored: dict[tuple[str, str], int] = {}
    async for batch in consume.read_range(js, 1, filter_subject=f"llmgw.*.{A2}.>"):
        for d in batch:
            with contextlib.suppress(Exception):
                stored[(d.subject, codec.decode(d.data).id)] = d.seq
    assert [t for t in taken if t not in stored] == []
    # The plane's commands meet the taken ids and are stored again under fresh ones, each
    # said. gpu-a2's reports go to the log through its node's stream under sealed ids,
    # which gpu-a1 cannot know, so none meets one (nor is kept off the log unsaid).
    commands = [t for t in taken if t[0].startswith(f"llmgw.cmd.{A2}.")]
    assert sum(COLLISIONS.values()) - before == len(commands)
    said = [r.message for r in caplog.records if "was taken by seq" in r.message]
    assert len(said) == len(commands), said
    await _checks(boundary, js, tmp_path, 2)


FLOOD, FLOOD_BYTES = 2_000, 200_000
WINDOW = 100  # publishes in flight at once


async def _flood(ajs: JetStreamContext) -> list[Any]:
    """FLOOD messages of FLOOD_BYTES on gpu-a1's own replica subjects, WINDOW at a time:
    what the broker answered to each (an ack, or why not)."""
    body = b"x" * FLOOD_BYTES
    out: list[Any] = []
    for i in range(0, FLOOD, WINDOW):
        sends = [
            ajs.publish(subjects.replica_subject(A1, f"flood-{i + j}"), body, timeout=10)
            for j in range(WINDOW)
        ]
        out += await asyncio.gather(*sends, return_exceptions=True)
    return out


async def _stored(js: JetStreamContext, after: int, subject: str) -> list[consume.Delivery]:
    return [d async for b in consume.read_range(js, after + 1, filter_subject=subject) for d in b]


@pytest.mark.slow
async def test_a_flood_from_one_agent_is_contained_to_its_node_and_said_once(
    boundary: Boundary, js: JetStreamContext, tmp_path: Path
) -> None:
    """2,000 messages of 200 KB from gpu-a1 on its own subjects, as fast as it can send
    them. A message over the payload bound is refused outright; the rest go to gpu-a1's
    node stream, which takes NODE_MAX_BYTES of them and refuses the others, so the log
    grows by at most that (and the dead letters by a bounded record each). The plane
    says it in one line naming the node, and one dead letter. Another agent's events,
    the plane's on node subjects (a node's status; a use report on gpu-a2's replica, as
    the gateway sends) and the sentinel are stored and applied, every process alive,
    and the view equals an offline replay of the log."""
    said = "node gpu-a1 reached the limits of its stream"
    dlq0 = (await js.stream_info(DLQ_STREAM)).state
    log0 = (await js.stream_info(subjects.STREAM)).state
    text0 = boundary.plane.log.read_text()
    letters0 = text0.count("dead letter for")
    nc, _ = await _connect(boundary.url(A1), inbox_prefix(A1))
    try:
        await _hello(nc, A1)
        ajs = nc.jetstream()
        with pytest.raises(nats.errors.MaxPayloadError):
            await ajs.publish(subjects.inventory_subject(A1), b"x" * (MAX_MSG_BYTES + 1))
        sent = time.monotonic()
        answers = await _flood(ajs)
        took = time.monotonic() - sent
    finally:
        await nc.close()
    acks = [a for a in answers if isinstance(a, PubAck)]
    refused = [a for a in answers if not isinstance(a, PubAck)]
    assert {a.stream for a in acks} == {node_stream_name(A1)}, acks[:3]
    assert all(is_full(e) for e in refused), {repr(e) for e in refused}
    # The node stream took what fits its bound, and refused the rest.
    assert 0 < len(acks) <= NODE_MAX_BYTES // FLOOD_BYTES, len(acks)
    assert len(refused) >= FLOOD - NODE_MAX_BYTES // FLOOD_BYTES
    await _until("the plane to say gpu-a1's flood", lambda: said in boundary.plane.log.read_text())

    # The plane's events on node subjects, and another agent's, after it.
    plane = Publisher(js)
    status = await plane.publish(
        ev.make(ev.NodeUncordoned(node=A1), id=new_id(), time=datetime.now(UTC), source="test")
    )
    used = await plane.publish(
        ev.make(
            ev.ReplicaUsed(replica="r-used", at=datetime.now(UTC), requests=1),
            id=new_id(),
            time=datetime.now(UTC),
            source="gateway",
        ),
        node=A2,
    )
    assert status.stream == subjects.STREAM and used.stream == node_stream_name(A2)
    async with _victim(boundary, tmp_path):
        pass
    await _checks(boundary, js, tmp_path, 3)
    assert await _stored(js, log0.last_seq, subjects.inventory_subject(A2)), "gpu-a2's inventory"
    assert [d.seq for d in await _stored(js, log0.last_seq, status.subject)] == [status.seq]
    assert len(await _stored(js, log0.last_seq, used.subject)) == 1, "the use report"
    flood = await _stored(js, log0.last_seq, f"llmgw.node.{A1}.replica.*")
    assert len(flood) == len(acks)

    # Disk: the log grew by gpu-a1's bound and the few events after it, the node stream
    # holds its bound, the dead letters a bounded record for each consumer's letter.
    log = (await js.stream_info(subjects.STREAM)).state
    assert log.bytes - log0.bytes <= NODE_MAX_BYTES + 1024**2, log.bytes - log0.bytes
    node = (await js.stream_info(node_stream_name(A1))).state
    assert node.bytes <= NODE_MAX_BYTES
    dlq = (await js.stream_info(DLQ_STREAM)).state
    letters = dlq.messages - dlq0.messages
    assert dlq.bytes - dlq0.bytes <= letters * DLQ_MAX_MSG_BYTES
    assert letters <= 4 * len(acks) + 1, letters
    print(
        f"{FLOOD:,} x {FLOOD_BYTES // 1000} KB from one agent in {took:.1f} s: "
        f"{len(acks)} stored, {len(refused):,} refused (stream full); LLMGW "
        f"+{(log.bytes - log0.bytes) / 1024**2:.1f} MiB, {node_stream_name(A1)} "
        f"{node.bytes / 1024**2:.1f} MiB, LLMGW_DLQ +{(dlq.bytes - dlq0.bytes) / 1024**2:.1f} "
        f"MiB in {letters} records"
    )

    # Said once: one line naming the node (the plane looked again every WATCH_S since),
    # and one dead letter.
    text = boundary.plane.log.read_text()[len(text0) :]
    assert text.count(said) == 1, text[-3000:]
    assert text.count("dead letter for") - letters0 <= 2 * 4
    letter = await js.get_last_msg(DLQ_STREAM, subjects.dlq_subject(node_stream_name(A1)))
    assert said.encode() in letter.data
    assert boundary.plane.alive()


async def test_a_taken_id_keeps_no_dead_letter_off_the_dlq(
    boundary: Boundary, js: JetStreamContext, tmp_path: Path
) -> None:
    """The projector's dead letter for seq N has an id anyone can compute; gpu-a1 sends
    it first on its own dead-letter subject. The projector's letter is stored all the
    same, with its reason."""
    last = (await js.stream_info(subjects.STREAM)).state.last_seq
    nc, _ = await _connect(boundary.url(A1), inbox_prefix(A1))
    try:
        ajs = nc.jetstream()
        own = subjects.dlq_subject(durable_name(A1))
        for seq in range(last + 1, last + 6):
            record = msgspec.json.encode(
                DeadLetter(
                    consumer=durable_name(A1),
                    reason="forged",
                    subject=own,
                    seq=seq,
                    data_b64="",
                    at=datetime.now(UTC),
                )
            )
            for header in (
                scoped_id(subjects.dlq_subject("projector"), f"dlq.projector.{seq}"),
                f"dlq.projector.{seq}",
            ):
                await ajs.publish(own, record, headers={"Nats-Msg-Id": header})
    finally:
        await nc.close()
    bad = await js.publish(subjects.scale_subject("m-dlq"), b"hello {")
    assert last < bad.seq <= last + 5
    live = await _settle(js, boundary.plane, tmp_path, 4)
    async with asyncio.timeout(10):
        while (reason := await _dead_letter_for(js, bad.seq)) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert "forged" not in reason
    await _replayed_equals_live(js, live, tmp_path)
