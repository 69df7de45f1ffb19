"""The adversarial suite at the boundary of an agent's reports: a compromised GPU host
holds one agent's credentials under the shipped deploy/nats permissions, beside a
running plane (`llmgw up --nats` as `control`, with its gateway) and two real agents
(`llmgw agent --simulate`, real processes), and reports what no placement gave it: a
replica it invents, an endpoint off its own address or on a port of the plane, a use in
the far future. Each report is dead-lettered or rejected (or its time bounded), the
gateway, asked with the official `openai` client, never sends a request there, the
plane's real replica keeps serving, and after each: every process alive, a sentinel
applied, the SQLite view equal to an offline replay of the log (as test_bad_input).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import openai
import pytest
import pytest_asyncio
from aiohttp import web
from nats.js.client import JetStreamContext

from schemas import codec, subjects
from schemas import events as ev
from services.agent import consumers as agent_consumers
from services.agent.agent import inbox_prefix
from services.bus import consume
from services.bus.stream import node_stream_name
from services.clock import new_id
from tests.adversarial.test_bad_input import (
    Plane,
    _dead_letter_for,
    _live_db,
    _replayed_equals_live,
    _settle,
)
from tests.deploy.natsconf import (
    CONTROL_PASSWORD,
    Rendered,
    agent_password,
    render_single,
    server,
    wait_for,
)
from tests.up_process import FAST, UpProcess

pytestmark = [pytest.mark.timeout(120)]

A1, A2 = "gpu-a1", "gpu-a2"
CHAT, LAZY = "chat", "lazy"
INVENTED = "chat-feedfacecafe"
FAR = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)
CLUSTER = f"""\
models:
  - name: {CHAT}
    class: standard
    min: 1
    max: 1
    profiles: [{{name: tp1, gpus: 1}}]
  - name: {LAZY}
    class: standard
    min: 0
    max: 1
    idle_after_s: 5
    profiles: [{{name: tp1, gpus: 1}}]
"""


@dataclass
class Scene:
    plane: Plane
    rendered: Rendered
    agents: dict[str, UpProcess]
    gateway: str
    """http://127.0.0.1:PORT/v1"""
    dashboard: str
    """http://127.0.0.1:PORT"""
    chat: tuple[str, str, dict[str, Any]]
    """The plane's replica of chat as it first was ready: (id, node, record)."""

    def url(self, user: str) -> str:
        password = CONTROL_PASSWORD if user == "control" else agent_password(user)
        return self.rendered.url(user, password)

    def alive(self) -> bool:
        return self.plane.alive() and all(a.alive() for a in self.agents.values())


def _ready(db: Path, model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(id, node, record) of each ready replica of `model` in a copy of the view that
    the plane placed (an invented one, were it in the view, is left out: each attack
    is judged on its own)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        rows = c.execute(
            "SELECT id, nodes, doc FROM replicas WHERE model = ? AND state = 'ready'", (model,)
        ).fetchall()
    return [(str(i), str(n).split(",")[0], json.loads(d)) for i, n, d in rows if i != INVENTED]


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    base = tmp_path_factory.mktemp("reports")
    r = render_single(base / "nats", [A1, A2])
    with server(r, base / "nats.log"):
        control = r.url("control", CONTROL_PASSWORD)
        up = UpProcess(base / "data", base / "up.log", "--nats", control, *FAST)
        agents: dict[str, UpProcess] = {}
        try:
            wait_for(
                "llmgw up to run its services",
                lambda: (
                    (up.alive() or pytest.fail(up.text()[-3000:]))
                    and "preemption service" in up.text()
                ),
            )
            gw = wait_for(
                "the gateway's address",
                lambda: (
                    (base / "data" / "gateway.url").is_file()
                    and (base / "data" / "gateway.url").read_text().strip()
                ),
            )
            ui = wait_for(
                "the dashboard's address",
                lambda: (
                    (base / "data" / "dashboard.url").is_file()
                    and (base / "data" / "dashboard.url").read_text().strip()
                ),
            )
            for node in (A1, A2):
                agents[node] = UpProcess(
                    base / node,
                    base / f"{node}.log",
                    "--nats",
                    r.url(node, agent_password(node)),
                    "--node",
                    node,
                    "--simulate",
                    "--gpus",
                    "8xH100-80GB",
                    *FAST,
                    command=("agent",),
                )
            spec = base / "cluster.yaml"
            spec.write_text(CLUSTER)
            applied = up.llmgw("apply", "-f", str(spec), "--nats", control)
            assert applied.returncode == 0, applied.stderr
            plane = Plane(up, control)
            tmp = base / "copies"
            tmp.mkdir()
            [chat] = wait_for(
                f"a ready replica of {CHAT}",
                lambda: (
                    (up.alive() or pytest.fail(up.text()[-3000:]))
                    and _ready(_live_db(plane, tmp), CHAT)
                ),
            )
            yield Scene(plane, r, agents, gw, ui.split("?")[0].rstrip("/"), chat)
        finally:
            for a in agents.values():
                a.stop()
            up.stop()
    for p in (up, *agents.values()):
        assert "Traceback" not in p.text(), p.text()[-3000:]


@pytest_asyncio.fixture(loop_scope="function")
async def js(scene: Scene) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(scene.url("control"))
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def _capture(host: str = "127.0.0.1") -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server that takes any request and answers it as a model would: where an
    attacker wants the gateway to send other tenants' prompts. (its URL, what it got)"""
    got: list[bytes] = []

    async def take(request: web.Request) -> web.Response:
        got.append(await request.read())
        return web.json_response(
            {
                "id": "captured",
                "object": "chat.completion",
                "created": 0,
                "model": CHAT,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "captured"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", take)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind((host, 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://{host}:{sock.getsockname()[1]}", got
    finally:
        await runner.cleanup()


async def _report(scene: Scene, js: JetStreamContext, node: str, data: ev.Data, **env: Any) -> int:
    """`data` sent as the agent on `node` would send it, with that agent's credentials:
    the log's sequence it was stored at."""
    e = ev.make(
        data,
        id=new_id(),
        time=env.pop("time", datetime.now(UTC)),
        source=f"agent/{node}",
    )
    subject = subjects.subject_for(e, node=node)
    nc = await nats.connect(scene.url(node), inbox_prefix=inbox_prefix(node), allow_reconnect=False)
    try:
        hello = await nc.request(agent_consumers.hello_subject(node), b"{}", timeout=10)
        assert json.loads(hello.data)["stream"] == node_stream_name(node)
        await nc.jetstream().publish(subject, codec.encode(e))
    finally:
        await nc.close()
    async with asyncio.timeout(10):
        while True:
            async for batch in consume.read_range(js, 1, filter_subject=subject):
                for d in batch:
                    if codec.decode(d.data).id == e.id:
                        return d.seq
            await asyncio.sleep(0.02)


async def _checks(scene: Scene, js: JetStreamContext, tmp: Path, n: int) -> Path:
    """Every process alive, the sentinel applied, the view equal to the log's replay;
    the view's copy."""
    assert scene.alive(), scene.plane.log.read_text()[-3000:]
    live = await _settle(js, scene.plane, tmp, n)
    await _replayed_equals_live(js, live, tmp)
    return live


def _client(scene: Scene) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=scene.gateway, api_key="unused", max_retries=0, timeout=20)


async def _ask(scene: Scene, model: str, n: int) -> list[str]:
    """`n` chat requests for `model`, one after another: each answer's content, or the
    error the gateway answered with."""
    out = []
    async with _client(scene) as client:
        for i in range(n):
            try:
                got = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": f"tenant secret {i}"}],
                    max_tokens=3,
                )
                out.append(got.choices[0].message.content or "")
            except openai.APIStatusError as e:
                out.append(f"{e.status_code}: {e.message}")
    return out


def _rejection(db: Path, seq: int) -> str | None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        row = c.execute("SELECT reason FROM rejections WHERE seq = ?", (seq,)).fetchone()
    return None if row is None else str(row[0])


_case = iter(range(1, 10_000))


async def test_an_invented_replica_is_dead_lettered_and_never_routed_to(
    scene: Scene, js: JetStreamContext, tmp_path: Path
) -> None:
    """The other node's agent reports chat-feedfacecafe starting, loading and ready on
    its GPU 7, its endpoint a capture server: each report is dead-lettered with its
    reason and folded into nothing; the real replica is not drained as surplus, and
    the next 10 requests for chat (other tenants' prompts) all go to it."""
    [(real, node, _)] = _ready(_live_db(scene.plane, tmp_path), CHAT)
    other = A1 if node == A2 else A2
    async with _capture() as (endpoint, captured):
        seqs = []
        for state in ("starting", "loading", "ready"):
            data = ev.ReplicaState(
                replica=INVENTED,
                model=CHAT,
                profile="tp1",
                state=state,
                shards=(ev.ShardSpec(node=other, gpus=(7,)),),
                endpoint=endpoint if state == "ready" else None,
            )
            seqs.append(await _report(scene, js, other, data))
        live = await _checks(scene, js, tmp_path, next(_case))
        reason = f"replica {INVENTED} was never placed on {other}"
        assert [_rejection(live, seq) for seq in seqs] == [reason] * 3
        for seq in seqs:
            async with asyncio.timeout(10):
                while (letter := await _dead_letter_for(js, seq)) is None:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert letter == reason, letter
        answers = await _ask(scene, CHAT, 10)
        assert captured == [], f"{len(captured)} prompts went to the invented replica"
        assert "captured" not in answers and all(not a[:3].isdigit() for a in answers), answers
    live = await _checks(scene, js, tmp_path, next(_case))
    with sqlite3.connect(f"file:{live}?mode=ro", uri=True) as c:
        rows = c.execute("SELECT id, state FROM replicas WHERE model = ?", (CHAT,)).fetchall()
    assert [(r, s) for r, s in rows if s != "stopped"] == [(real, "ready")], rows
    [(_, _, doc)] = _ready(live, CHAT)
    assert doc.get("drained_by") is None, "the real replica was drained as surplus"


# Where the replica's own agent says its server answers, besides its own address.
FOREIGN = [
    "another host",
    "the gateway's port",
    "the dashboard's port",
    "the broker's port",
]


def _port(url: str) -> int:
    return int(url.split("://", 1)[1].split("/", 1)[0].rpartition(":")[2].split("@")[-1])


@pytest.mark.parametrize("kind", FOREIGN)
async def test_a_foreign_endpoint_is_never_routed_to(
    kind: str, scene: Scene, js: JetStreamContext, tmp_path: Path
) -> None:
    """The agent of chat's node re-reports its real replica ready with an endpoint off
    its address (127.0.0.1, as its inventory says): rejected by the fold. One on the
    plane's own ports is on its address, so the fold takes it; the gateway refuses to
    send a request there and says why. Then the agent's true endpoint is back."""
    real, node, doc = scene.chat
    true_endpoint = doc["endpoint"]
    assert true_endpoint.startswith("http://127.0.0.1:"), true_endpoint

    def ready(endpoint: str) -> ev.ReplicaState:
        return ev.ReplicaState(
            replica=real,
            model=CHAT,
            profile=doc["profile"],
            state="ready",
            shards=tuple(
                ev.ShardSpec(node=s["node"], gpus=tuple(s["gpus"])) for s in doc["shards"]
            ),
            endpoint=endpoint,
        )

    async with contextlib.AsyncExitStack() as stack:
        match kind:
            case "another host":
                endpoint, captured = await stack.enter_async_context(_capture("127.0.0.2"))
            case "the gateway's port":
                endpoint, captured = f"http://127.0.0.1:{_port(scene.gateway)}", []
            case "the dashboard's port":
                endpoint, captured = f"http://127.0.0.1:{_port(scene.dashboard)}", []
            case "the broker's port":
                endpoint, captured = f"http://127.0.0.1:{scene.rendered.port}", []
            case _:
                raise AssertionError(kind)
        seq = await _report(scene, js, node, ready(endpoint))
        try:
            live = await _checks(scene, js, tmp_path, next(_case))
            answers = await _ask(scene, CHAT, 3)
            assert captured == [], f"{len(captured)} prompts went to {endpoint}"
            text = scene.plane.log.read_text()
            if kind == "another host":
                why = _rejection(live, seq)
                assert why == (
                    f"replica {real}'s endpoint {endpoint} is not on {node}'s address 127.0.0.1"
                ), why
                assert all(not a[:3].isdigit() for a in answers), answers
            else:
                # On its address: the fold takes it, and the gateway sends nothing there.
                assert _rejection(live, seq) is None
                assert all(a.startswith(("502", "503")) for a in answers), answers
                assert f"its endpoint {endpoint} is a port of the plane" in text, text[-3000:]
        finally:
            # The agent's own endpoint again (whatever the attack did): served again.
            await _report(scene, js, node, ready(true_endpoint))
        await _checks(scene, js, tmp_path, next(_case))
        answers = await _ask(scene, CHAT, 2)
        assert all(not a[:3].isdigit() for a in answers), answers
    assert scene.alive()


def _explain(scene: Scene, replica: str) -> str:
    got = scene.plane.up.llmgw("explain", "replica", replica, "--nats", scene.url("control"))
    assert got.returncode == 0, got.stderr
    return got.stdout


@pytest.mark.parametrize(
    "kind",
    ["a use at 9999-12-31", "a use from a clock at 9999-12-31"],
)
async def test_a_far_future_use_is_bounded(
    kind: str, scene: Scene, js: JetStreamContext, tmp_path: Path
) -> None:
    """One `replica.used` at 9999-12-31 from the replica's own agent: its time is bounded
    by the time the log stored it (the event's own, or that plus the skew when the
    event's time is as far), `explain` says minutes, not millions of days, and the
    on-demand model still goes back to zero when idle."""
    model = LAZY if kind == "a use at 9999-12-31" else CHAT
    if model == LAZY:
        answers = await _ask(scene, LAZY, 1)  # wakes it
        assert all(not a[:3].isdigit() for a in answers), answers
    [(rid, node, _)] = _ready(_live_db(scene.plane, tmp_path), model)
    before = datetime.now(UTC)
    env = {"time": FAR} if kind == "a use from a clock at 9999-12-31" else {}
    await _report(scene, js, node, ev.ReplicaUsed(replica=rid, at=FAR), **env)
    live = await _checks(scene, js, tmp_path, next(_case))
    with sqlite3.connect(f"file:{live}?mode=ro", uri=True) as c:
        (used,) = c.execute("SELECT last_used_at FROM replicas WHERE id = ?", (rid,)).fetchone()
    assert before <= datetime.fromisoformat(used) <= datetime.now(UTC) + timedelta(minutes=6)
    said = _explain(scene, rid)
    line = next(x for x in said.splitlines() if "last used" in x)
    assert "9999" not in line and "d ago" not in line and "d)" not in line, line
    if model == LAZY:
        # Idle after its 5 s from the report's time: the autoscaler takes it to zero.
        async with asyncio.timeout(30):
            while True:
                with sqlite3.connect(
                    f"file:{_live_db(scene.plane, tmp_path)}?mode=ro", uri=True
                ) as c:
                    row = c.execute(
                        "SELECT replicas FROM desired WHERE model = ?", (LAZY,)
                    ).fetchone()
                if row is not None and row[0] == 0:
                    break
                await asyncio.sleep(0.1)
    await _checks(scene, js, tmp_path, next(_case))
