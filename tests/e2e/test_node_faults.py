"""Nodes under ordinary faults, on real processes: an external broker, `llmgw up --nats`
joined to it, and real agents (`llmgw agent`, two running their model servers as
processes, one simulated).

- The broker is killed and, once the plane has seen it gone, restarted on the same
  store: every node is ready again with its replicas ready, its agent heard again, and
  no replica was failed while its server served (the same server processes run
  throughout). An outage past the node timeout loses no node either: that is the
  scheduler's rule on its own clock, moved by the test rather than waited for
  (tests/scheduler/test_scheduler.py).
- A second agent for a live node is refused with one line naming the other;
  `--takeover` replaces it.
- An agent that takes over with a smaller inventory (fewer GPUs, another model, less
  memory) fails the replicas it no longer has the GPUs of: GPUs in use never exceed
  GPUs present, `explain node` says why, and the view is an offline replay's.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.agent import procs
from services.bus import EmbeddedBroker, consume
from services.core.ingest import Ingest
from services.core.view import View
from tests.adversarial.test_bad_input import _replayed_equals_live
from tests.agent.helpers import new_id
from tests.agent.realagent import REPO, RealAgent, fake_runtime, publish, servers, sweep
from tests.up_process import UpProcess

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]

NODE_TIMEOUT_S = 1.0
REAL = ("gpu-a", "gpu-b")
SIMULATED = "gpu-c"


@dataclass
class Plane:
    broker: EmbeddedBroker
    up: UpProcess
    agents: dict[str, RealAgent]
    simulated: SimAgent
    agent_data: Path


class SimAgent:
    """`llmgw agent --simulate`, its output in `log`."""

    def __init__(self, url: str, node: str, gpus: str, log: Path, *extra: str) -> None:
        self.log = log
        self._out = log.open("ab")
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "services.cli", "agent", "--simulate", "--nats", url),
                *("--node", node, "--gpus", gpus, "--heartbeat", "0.3"),
                *("--load-delay", "0.05", "--start-delay", "0.01", *extra),
            ],
            cwd=REPO,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        code = self.proc.wait(10)
        self._out.close()
        return code


@pytest.fixture(scope="module")
def plane(
    module_nats_server: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Plane]:
    base = tmp_path_factory.mktemp("node-faults")
    url = module_nats_server.url
    up = UpProcess(
        base / "data",
        base / "up.log",
        *("--nats", url, "--tick", "0.2", "--node-timeout", str(NODE_TIMEOUT_S)),
        *("--lost-grace", "30"),
    )
    agents: dict[str, RealAgent] = {}
    simulated = None
    try:
        # The agents need the stream, which `up` makes.
        deadline = time.monotonic() + 30
        while "up: scheduler, preemption service" not in up.text():
            assert up.alive(), up.text()[-3000:]
            assert time.monotonic() < deadline, up.text()[-3000:]
            time.sleep(0.05)
        data = base / "agents"
        data.mkdir()
        agents = {n: RealAgent(url, n, data) for n in REAL}
        simulated = SimAgent(url, SIMULATED, "2xA100-80GB", base / "gpu-c.log")
        yield Plane(module_nats_server, up, agents, simulated, data)
    finally:
        if simulated is not None:
            simulated.stop()
        for a in agents.values():
            a.stop()
        up.stop()
        for n in REAL:
            sweep(n)


async def _view(js: JetStreamContext) -> View:
    """The whole log folded here, as any reader of it would."""
    step = Ingest()
    async for batch in consume.read_range(js, 1, None):
        for d in batch:
            step.raw(d.seq, d.subject, d.data, d.time_ns)
    return step.view


async def _until(js: JetStreamContext, what: str, cond, within: float = 20.0) -> View:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while True:
        view = await _view(js)
        if cond(view):
            return view
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        await asyncio.sleep(0.1)


def _ready(view: View, model: str) -> list[str]:
    return sorted(r.id for r in view.replicas_of(model) if r.state == "ready")


def _in_use_within_present(view: View) -> bool:
    """Every node: the GPUs its replicas hold are GPUs it has, and no more than it has."""
    for name, rec in view.state.nodes.items():
        present = {g.index for g in rec.report.gpus}
        held = [
            i
            for r in view.state.replicas.values()
            if r.holds_capacity
            for sh in r.shards
            if sh.node == name
            for i in sh.gpus
        ]
        if len(held) > len(present) or not set(held) <= present:
            return False
    return True


async def _up_says(up: UpProcess, words: str, before: int, within: float = 20.0) -> None:
    """Once `up`'s log says `words` more than the `before` times it had."""
    deadline = time.monotonic() + within
    while up.text().count(words) <= before:
        assert up.alive(), up.text()[-3000:]
        assert time.monotonic() < deadline, f"llmgw up never said {words!r}"
        await asyncio.sleep(0.05)


def _heartbeat_ages(up: UpProcess, url: str) -> dict[str, float | None]:
    """Each node's heartbeat age, as `llmgw status -o json` on the broker at `url` hears
    it (its exit status says whether the plane leads yet, which is not asked here)."""
    done = up.llmgw("status", "--nats", url, "-o", "json")
    assert done.returncode in (0, 1) and done.stdout, done.stdout + done.stderr
    return {n["node"]: n["heartbeat_age_s"] for n in json.loads(done.stdout)["nodes"]}


async def _declare(js: JetStreamContext, data: ev.Data) -> None:
    await publish(js, ev.make(data, id=new_id(), time=datetime.now(UTC), source="test/operator"))


async def test_a_broker_down_and_back_leaves_every_node_and_replica_ready(
    plane: Plane, js: JetStreamContext
) -> None:
    # Two servers on the real nodes (H100s; gpu-c has A100s), wherever the scheduler puts
    # them: both must come back as they were.
    await _declare(
        js,
        ev.ModelDeclared(
            name="web",
            min=2,
            profiles=(ev.ProfileSpec(name="tp1", gpus=1, gpu_model="H100"),),
            runtime=fake_runtime(),
        ),
    )
    before = await _until(
        js,
        "2 web replicas ready on the real nodes",
        lambda v: (
            len(_ready(v, "web")) == 2 and all(n in v.state.nodes for n in (*REAL, SIMULATED))
        ),
    )
    ready = _ready(before, "web")
    pids = {e["replica"]: e["pid"] for n in REAL for e in servers(plane.agent_data, n).values()}
    assert set(ready) <= set(pids), pids

    killed_at = datetime.now(UTC)
    said = plane.up.text().count("lost the connection to")
    plane.broker.kill()
    await _up_says(plane.up, "lost the connection to", said)
    await asyncio.to_thread(plane.broker.start)

    def healed(v: View) -> bool:
        nodes = v.state.nodes
        return all(not nodes[n].lost for n in (*REAL, SIMULATED)) and _ready(v, "web") == ready

    def reannounced(v: View) -> bool:
        # Each agent said its inventory again after its reconnect.
        return all(v.state.nodes[n].updated_at > killed_at for n in (*REAL, SIMULATED))

    await _until(
        js,
        "every node re-announced and ready, with its replicas ready",
        lambda v: reannounced(v) and healed(v),
        within=20,
    )
    # Every agent heard again, as `llmgw status` hears their heartbeats, within a node
    # timeout; and the nodes still back.
    ages = await asyncio.to_thread(_heartbeat_ages, plane.up, plane.broker.url)
    assert all(a is not None and a <= NODE_TIMEOUT_S for a in ages.values()), ages
    v = await _until(js, "every node back", healed, within=5)
    assert healed(v), [(n, r.lost, r.lost_reason) for n, r in v.state.nodes.items()]
    # No replica was failed while its server served: the same processes run, and the log
    # holds no failed replica and no loss without a grace.
    for rid in ready:
        assert procs.alive(pids[rid]), rid
    assert [r.id for r in v.state.replicas.values() if r.state == "failed"] == []
    assert all(r.failing_at is None for r in v.state.nodes.values())


async def test_a_second_agent_for_a_live_node_is_refused_and_takeover_replaces_it(
    plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    url = plane.broker.url
    second = await asyncio.to_thread(
        subprocess.run,
        [
            *(sys.executable, "-m", "services.cli", "agent", "--simulate", "--nats", url),
            *("--node", SIMULATED, "--gpus", "4xL4-24GB"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 1, second.stderr
    lines = [ln for ln in second.stderr.splitlines() if "already has a live agent" in ln]
    assert len(lines) == 1, second.stderr
    assert (
        f"node {SIMULATED} already has a live agent (pid {plane.simulated.proc.pid} on" in lines[0]
    )
    assert "--takeover" in lines[0] and "Traceback" not in second.stderr
    assert plane.simulated.proc.poll() is None, "the live agent kept running"

    # A model of two 80 GB A100s: only gpu-c has them.
    await _declare(
        js,
        ev.ModelDeclared(
            name="chat",
            min=1,
            profiles=(ev.ProfileSpec(name="tp2", gpus=2, gpu_model="A100", gpu_memory_gb=80),),
        ),
    )
    await _until(
        js,
        "chat ready on gpu-c",
        lambda v: any(
            r.state == "ready" and r.shards[0].node == SIMULATED for r in v.replicas_of("chat")
        ),
    )
    # Taking over with a smaller inventory: one 24 GB L4 where two H100 were.
    log = tmp_path / "takeover.log"
    taker = SimAgent(url, SIMULATED, "1xL4-24GB", log, "--takeover")
    try:
        assert await asyncio.to_thread(plane.simulated.proc.wait, 15) == 0
        view = await _until(
            js,
            "chat failed on gpu-c's new inventory",
            lambda v: (
                len(v.state.nodes[SIMULATED].report.gpus) == 1
                and all(r.state == "failed" for r in v.replicas_of("chat"))
            ),
        )
        assert "taking over from its agent" in log.read_text()
        (chat,) = view.replicas_of("chat")
        assert chat.reason is not None and chat.reason.startswith(
            f"node {SIMULATED} no longer has its GPUs: GPU 1 is gone"
        ), chat.reason
        assert _in_use_within_present(view)
        assert view.inventory.free_gpus(SIMULATED) == [0]

        explained = plane.up.llmgw("explain", "node", SIMULATED, "--nats", url)
        assert explained.returncode == 0, explained.stderr
        assert "replicas failed with the node" in explained.stdout
        assert f"{chat.id} (chat)" in explained.stdout
        assert "no longer has its GPUs: GPU 1 is gone" in explained.stdout

        # The live view (the projector's SQLite) is what an offline replay gives.
        live = tmp_path / "live.sqlite"
        await _live_copy(plane, live)
        await _replayed_equals_live(js, live, tmp_path)
    finally:
        taker.stop()


async def _live_copy(plane: Plane, dst: Path) -> None:
    """A consistent copy of the projector's view, once it has folded the whole log."""
    import sqlite3

    info = await asyncio.wait_for(_last_seq(plane), 10)
    src_path = plane.up.data / "view.sqlite"
    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(f"file:{src_path}?mode=ro", uri=True) as src:
            (seq,) = src.execute("SELECT seq FROM position").fetchone()
            if seq >= info:
                out = sqlite3.connect(dst)
                src.backup(out)
                out.close()
                return
        assert time.monotonic() < deadline, f"projector at {seq}, log at {info}"
        await asyncio.sleep(0.05)


async def _last_seq(plane: Plane) -> int:
    from services.bus import connect

    nc = await connect(plane.broker.url, "test-last-seq")
    try:
        return (await nc.jetstream().stream_info("LLMGW")).state.last_seq
    finally:
        await nc.close()
