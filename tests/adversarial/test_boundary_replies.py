"""The adversarial suite at the plane's responders: a compromised GPU host holds one agent's
credentials (gpu-a1's) under the shipped deploy/nats roles, beside a running plane (`llmgw
up --nats` as `control`, a real process, with its gateway), and names as the reply of its
requests the subjects it may not publish on: the scheduler's lease, another node's
heartbeat and node subjects, the stream's purge. NATS sends a reply wherever a requester
says, with the responder's permissions; the plane's are the control role's. Each
responder it can reach (`up`'s hello, the gateway's in-flight answers) answers only under
the asking agent's own inbox (`_INBOX_<node>.`), so nothing lands there: a watcher (a
test-only user of the same server, which may read every subject) sees no answer on the
target, and the target's state is as before. It asks the gateway about another node's
replica, and sends heartbeats whose body is not its own; and 2,000 refused requests are
one line in a log, not 2,000. After each attack every process is alive, a sentinel event
is applied and the view equals an offline replay of the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from schemas import events as ev
from schemas import subjects
from services.agent import consumers as agent_consumers
from services.agent.agent import ctl_subject, inbox_prefix, reader_name
from services.bus import Publisher
from services.bus import connect as bus_connect
from services.bus.stream import node_stream_name
from services.clock import new_id
from services.plane import lease, liveness
from tests.adversarial.test_bad_input import Plane
from tests.adversarial.test_boundary_broker import (
    _checks,
    _connect,
    _hello,
    _stored,
    _until,
    _victim,
    plane_on,
)
from tests.agent.helpers import placement_of, start_cmd
from tests.deploy.natsconf import (
    CONTROL_PASSWORD,
    Rendered,
    agent_password,
    render_single,
)

pytestmark = [pytest.mark.timeout(90)]

A1, A2, A3 = "gpu-a1", "gpu-a2", "gpu-a3"  # the attacker, the node it attacks, a dead node
WATCHER, WATCHER_PASSWORD = "watcher", "test-watcher-pw"
NODE_TIMEOUT_S = 1.5
ROOT = subjects.DEFAULT_ROOT


@dataclass
class Boundary:
    plane: Plane
    rendered: Rendered
    base: Path

    def url(self, user: str) -> str:
        password = {"control": CONTROL_PASSWORD, WATCHER: WATCHER_PASSWORD}.get(user)
        return self.rendered.url(user, password or agent_password(user))


def _add_watcher(r: Rendered) -> None:
    """A user with every right, for the test to see what lands on a subject that no
    shipped role may read (`$JS.API.STREAM.PURGE.LLMGW`). No process of the plane uses
    it."""
    users = r.conf.parent / "users.conf"
    text = users.read_text()
    end = "]\n}\n"
    assert text.endswith(end), text[-200:]
    users.write_text(
        text[: -len(end)] + f'  {{user: {WATCHER}, password: "{WATCHER_PASSWORD}"}}\n' + end
    )


@pytest.fixture(scope="module")
def boundary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Boundary]:
    base = tmp_path_factory.mktemp("replies")
    r = render_single(base / "nats", [A1, A2, A3])
    _add_watcher(r)
    timing = ("--node-timeout", str(NODE_TIMEOUT_S), "--tick", "0.2")
    with plane_on(r, base, *timing, gateway=True) as b:
        # Its own Boundary: it knows the watcher's password too.
        yield Boundary(b.plane, b.rendered, b.base)


@pytest_asyncio.fixture(loop_scope="function")
async def js(boundary: Boundary) -> AsyncIterator[JetStreamContext]:
    nc, _ = await _connect(boundary.url("control"))
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def _agent(boundary: Boundary, node: str) -> AsyncIterator[Client]:
    """A connection as `node`'s agent, with its own inbox prefix."""
    nc, _ = await _connect(boundary.url(node), inbox_prefix(node))
    try:
        yield nc
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def _watching(boundary: Boundary, subject: str) -> AsyncIterator[tuple[Client, list[Msg]]]:
    nc, _ = await _connect(boundary.url(WATCHER))
    seen: list[Msg] = []

    async def on(msg: Msg) -> None:
        seen.append(msg)

    try:
        await nc.subscribe(subject, cb=on)
        await nc.flush()
        yield nc, seen
    finally:
        await nc.close()


def _answers(seen: list[Msg]) -> list[bytes]:
    """The plane's answers among what landed on a subject: a hello's (`ok`, `error`) or a
    gateway's in-flight count (`gateway`); a lease's renewals and a node's own reports
    are neither."""
    out = []
    for m in seen:
        with contextlib.suppress(ValueError):
            body = json.loads(m.data)
            if isinstance(body, dict) and {"ok", "error", "gateway"} & body.keys():
                out.append(m.data)
    return out


async def _inventory(boundary: Boundary, node: str) -> None:
    """`node` says hello (its node stream is made) and its inventory, as its agent."""
    async with _agent(boundary, node) as nc:
        await _hello(nc, node)
        e = ev.make(
            ev.NodeInventory(
                node=node,
                gpus=tuple(
                    ev.GpuInfo(index=i, uuid=f"{node}-{i}", model="NVIDIA H100 80GB", memory_gb=80)
                    for i in range(2)
                ),
                cpu_cores=16,
                memory_gb=128,
            ),
            id=new_id(),
            time=datetime.now(UTC),
            source="agent",
        )
        await Publisher(nc.jetstream()).publish(e)


async def _status_events(js: JetStreamContext, node: str, after: int = 0) -> list[str]:
    """The types of `node`'s status events in the log after seq `after`."""
    out = []
    for d in await _stored(js, after, subjects.node_status_subject(node)):
        out.append(json.loads(d.data)["type"])
    return out


# The responders an agent can reach, as (the subject gpu-a1 asks on, the question's body).
RESPONDERS = {
    "hello": (agent_consumers.hello_subject(A1), b"{}"),
    "inflight": (subjects.gateway_inflight_subject(A1, "r-mine"), b""),
}
# Where gpu-a1 aims their answers: what the control role may publish and it may not.
TARGETS = {
    "lease": f"$KV.{lease.DEFAULT_BUCKET}.{ROOT}.scheduler",
    "heartbeat": subjects.heartbeat_subject(A3),
    "node-stream": subjects.inventory_subject(A2),
    "purge": f"$JS.API.STREAM.PURGE.{subjects.STREAM}",
}


async def _attack(nc: Client, responder: str, target: str, n: int) -> None:
    """`n` questions to `responder` answered to `target`, then one answered to gpu-a1's
    own inbox: the responder takes its requests in order, so once that one is answered
    every earlier one was answered or refused."""
    subject, body = RESPONDERS[responder]
    for _ in range(n):
        await nc.publish(subject, body, reply=target)
    reply = await nc.request(subject, body, timeout=10)
    assert reply.data, "the plane answers gpu-a1 on its own inbox"


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("responder", list(RESPONDERS))
async def test_a_reply_aimed_elsewhere_gets_no_answer(
    boundary: Boundary, js: JetStreamContext, tmp_path: Path, responder: str, target: str
) -> None:
    """gpu-a1 asks `responder` with its reply on `target`: nothing lands there, and the
    lease still names the scheduler that leads, gpu-a2's node stream holds what it held,
    the dead node gpu-a3 is lost and stays lost, the log is not purged."""
    subject = TARGETS[target]
    await _inventory(boundary, A2)
    await _inventory(boundary, A3)
    kv = await js.key_value(lease.DEFAULT_BUCKET)
    node2 = (await js.stream_info(node_stream_name(A2))).state.messages
    log0 = (await js.stream_info(subjects.STREAM)).state
    async with _watching(boundary, subject) as (watcher, seen), _agent(boundary, A1) as nc:
        await _attack(nc, responder, subject, 20)
        if target == "heartbeat":
            # gpu-a3 sends nothing: within the node timeout it is lost, and it is not
            # found again while gpu-a1 keeps asking with its heartbeat as the reply.
            async def lost() -> bool:
                while True:
                    await _attack(nc, responder, subject, 5)
                    kinds = await _status_events(js, A3, log0.last_seq)
                    if kinds and kinds[-1] == "node.lost":
                        return True
                    await asyncio.sleep(0.1)

            async with asyncio.timeout(NODE_TIMEOUT_S + 15):
                await lost()
            was = (await js.stream_info(subjects.STREAM)).state.last_seq
            for _ in range(int(NODE_TIMEOUT_S / 0.1)):
                await _attack(nc, responder, subject, 5)
                await asyncio.sleep(0.1)
            assert "node.found" not in await _status_events(js, A3, was)
        await watcher.flush()
    assert _answers(seen) == []
    entry = await kv.get(f"{ROOT}.scheduler")
    holder, _ = lease.decode_value(entry.value)
    assert holder is not None and holder.endswith("-scheduler"), entry.value
    assert (await js.stream_info(node_stream_name(A2))).state.messages == node2
    log = (await js.stream_info(subjects.STREAM)).state
    assert log.first_seq == log0.first_seq and log.messages >= log0.messages
    await _checks(boundary, js, tmp_path, 1)


async def test_the_gateway_says_nothing_of_another_nodes_replica(
    boundary: Boundary, js: JetStreamContext, tmp_path: Path
) -> None:
    """gpu-a2 runs a replica; gpu-a1 asks the gateway, on its own node's subject and with
    its own inbox, how many requests are in flight there: no answer. About a replica of
    its own node it is answered."""
    replica = f"r-a2-{tmp_path.name[-6:]}"
    async with _victim(boundary, tmp_path) as victim:
        start = start_cmd(replica, A2, (0,), model="m-a2")
        # Placed first: only a placement makes a replica the views hold.
        await Publisher(js).publish(placement_of(start))
        await Publisher(js).publish(start, node=A2)
        # Ready, then (a model nobody declared) drained and stopped by the scheduler:
        # either way a replica of gpu-a2's in the gateway's view.
        await _until(
            "gpu-a2 to run it", lambda: victim.replicas().get(replica) in ("ready", "stopped")
        )
        async with _agent(boundary, A1) as nc:
            theirs = subjects.gateway_inflight_subject(A1, replica)
            # The gateway has folded the replica once its answer to gpu-a2's agent
            # is at the replica's latest state's seq.
            async with asyncio.timeout(10):
                while not (states := await _stored(js, 0, subjects.replica_subject(A2, replica))):  # noqa: ASYNC110 (a read)
                    await asyncio.sleep(0.05)
            async with _agent(boundary, A2) as nc2, asyncio.timeout(10):
                asked = subjects.gateway_inflight_subject(A2, replica)
                while json.loads((await nc2.request(asked, b"", timeout=5)).data)["seq"] < (  # noqa: ASYNC110
                    states[-1].seq
                ):
                    await asyncio.sleep(0.05)
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request(theirs, b"", timeout=1)
            mine = await nc.request(subjects.gateway_inflight_subject(A1, "r-none"), b"", timeout=5)
            assert json.loads(mine.data)["inflight"] == 0
    await _checks(boundary, js, tmp_path, 2)


HEARTBEATS = {
    "another-node": lambda: json.dumps(
        {"node": A3, "time": datetime.now(UTC).isoformat(), "every": 0.5}
    ).encode(),
    "undecodable": lambda: b"\xff not a heartbeat",
    "no-node": lambda: json.dumps({"time": datetime.now(UTC).isoformat()}).encode(),
}


@pytest.mark.parametrize("body", list(HEARTBEATS))
async def test_a_heartbeat_counts_only_for_the_node_its_body_names(
    boundary: Boundary, js: JetStreamContext, tmp_path: Path, body: str
) -> None:
    """gpu-a1 sends heartbeats on its own subject whose body is not its own heartbeat
    (naming gpu-a3, undecodable, naming no node): gpu-a1 is lost all the same and not
    found again, and `llmgw status` hears nothing from gpu-a3."""
    await _inventory(boundary, A1)
    start = (await js.stream_info(subjects.STREAM)).state.last_seq
    async with _agent(boundary, A1) as nc:

        async def beat_until_lost() -> None:
            while True:
                await nc.publish(subjects.heartbeat_subject(A1), HEARTBEATS[body]())
                kinds = await _status_events(js, A1, start)
                if kinds and kinds[-1] == "node.lost":
                    return
                await asyncio.sleep(0.1)

        async with asyncio.timeout(NODE_TIMEOUT_S + 15):
            await beat_until_lost()
        was = (await js.stream_info(subjects.STREAM)).state.last_seq
        cnc, _ = await _connect(boundary.url("control"))
        try:
            beats = asyncio.ensure_future(
                liveness.heartbeats(cnc, ROOT, [A1, A3], datetime.now(UTC), NODE_TIMEOUT_S)
            )
            while not beats.done():
                await nc.publish(subjects.heartbeat_subject(A1), HEARTBEATS[body]())
                await asyncio.sleep(0.1)
            assert await beats == {A1: None, A3: None}
        finally:
            await cnc.close()
    assert "node.found" not in await _status_events(js, A1, was)
    await _checks(boundary, js, tmp_path, 3)


FLOOD = 2_000


def _lines(text: str, *needles: str) -> int:
    return sum(1 for line in text.splitlines() if any(n in line for n in needles))


@pytest.mark.parametrize("responder", [*RESPONDERS, "ctl"])
async def test_a_flood_of_refused_requests_is_one_line(
    boundary: Boundary,
    js: JetStreamContext,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    responder: str,
) -> None:
    """2,000 requests from gpu-a1 whose replies go elsewhere (gpu-a2's node subject; for
    gpu-a2's agent's ctl subject, what the server delivers there as the reply of gpu-a1's
    own API requests): none answered, each counted, and the log says it in at most two
    lines (one, then at most one per 30 s)."""
    caplog.set_level(logging.INFO)
    target = subjects.replica_subject(A2, "r-flood")
    before = boundary.plane.log.read_text()
    if responder == "ctl":
        async with _victim(boundary, tmp_path) as victim, _agent(boundary, A1) as nc:
            await _hello(nc, A1)
            api = f"$JS.API.CONSUMER.INFO.{subjects.STREAM}.{reader_name(A1)}"
            for _ in range(FLOOD):
                await nc.publish(api, b"", reply=ctl_subject(A2))
            await nc.flush()

            def refused() -> int:
                guard = getattr(victim, "_ctl_guard", None)  # none before the rule
                if guard is not None:
                    return int(guard.refused)
                return sum("ctl request refused" in r.message for r in caplog.records)

            await _until("gpu-a2's agent to refuse them", lambda: refused() >= FLOOD, 30)
            # And an operator's request is answered still.
            cnc, _ = await _connect(boundary.url("control"))
            try:
                asked = await cnc.request(ctl_subject(A2), b'{"gpu": 99}', timeout=10)
            finally:
                await cnc.close()
            assert b"has no GPU 99" in asked.data
        said = [r.message for r in caplog.records if "ctl request refused" in r.message]
        assert 1 <= len(said) <= 2, said[:5]
    else:
        async with _watching(boundary, target) as (watcher, seen), _agent(boundary, A1) as nc:
            await _attack(nc, responder, target, FLOOD)
            await watcher.flush()
        assert _answers(seen) == []
        added = boundary.plane.log.read_text()[len(before) :]
        n = _lines(added, "left unanswered", "Permissions Violation", "ermissions violation")
        # Said at most twice (none here when an earlier attack on this plane began the
        # fault less than 30 s ago, as in this file).
        assert n <= 2, added[-3000:]
    await _checks(boundary, js, tmp_path, 4)


async def test_the_control_role_sends_no_heartbeat_and_its_refusals_are_one_line(
    boundary: Boundary, js: JetStreamContext, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever reaches the plane's connection, the server refuses it a heartbeat (the
    agents' alone, permissions.conf's deny): 2,000 for gpu-a3 sent as `control` land
    nowhere, and the connection says the server's refusals in one line (then at most
    one per 30 s), not 2,000."""
    caplog.set_level(logging.INFO, logger="llmgw.bus")
    subject = subjects.heartbeat_subject(A3)
    body = json.dumps({"node": A3, "time": datetime.now(UTC).isoformat()}).encode()
    async with _watching(boundary, subject) as (watcher, seen):
        nc = await bus_connect(boundary.url("control"), "test control")
        try:
            for _ in range(FLOOD):
                await nc.publish(subject, body)
            await nc.flush()

            def refusals() -> list[str]:
                return [r.message for r in caplog.records if "ermissions" in r.message]

            await _until("the server to refuse them", lambda: bool(refusals()))
            await nc.flush()
        finally:
            await nc.close()
        await watcher.flush()
    assert seen == []
    assert 1 <= len(refusals()) <= 2, refusals()[:5]
    await _checks(boundary, js, tmp_path, 5)
