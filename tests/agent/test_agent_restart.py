"""An agent restarted while commands are pending still carries out each command once.

The agent runs as its own process (`python -m services.cli agent`, which is `llmgw agent`),
and dies the hard way twice: once by its fault-injection point right after a state is
stored and before the command behind it is acked, once by SIGKILL mid-flight. Commands
also arrive while it is down. The stream's duplicate window is the server's smallest, so
JetStream's dedupe cannot hide a second copy: every (replica, state) must be in the log
exactly once because the agent knew, from the log, what it had already done.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import events as ev
from schemas import subjects
from services.agent import durable_name
from services.bus import EmbeddedBroker, Publisher
from services.bus.stream import ensure_stream
from tests.agent.helpers import by_replica, drain_cmd, start_cmd, states, wait_for

pytestmark = pytest.mark.timeout(60)

NODE = "sim-0"
REPO = Path(__file__).resolve().parents[2]


class AgentProcess:
    """`llmgw agent --simulate` for NODE as a child process, its log in a file."""

    def __init__(self, url: str, log: Path, *extra: str) -> None:
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "agent",
                "--simulate",
                "--nats",
                url,
                "--node",
                NODE,
                "--gpus",
                "8xH100-80GB",
                "--start-delay",
                "0.05",
                "--load-delay",
                "0.4",
                "--stop-delay",
                "0.3",
                "--heartbeat",
                "0.2",
                "--ack-wait",
                "1",
                *extra,
            ],
            cwd=REPO,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    async def exited(self, within_s: float = 15.0) -> int:
        deadline = time.monotonic() + within_s
        while (rc := self.proc.poll()) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"agent still running after {within_s}s:\n{self.text()}")
            await asyncio.sleep(0.02)
        self._out.close()
        return rc

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._out.close()


async def test_agent_killed_with_commands_pending_carries_out_each_once(
    nats_server: EmbeddedBroker, js: JetStreamContext, tmp_path: Path
) -> None:
    await ensure_stream(js, duplicate_window_s=0.1)
    pub = Publisher(js)
    starts = {f"r-{i}": start_cmd(f"r-{i}", NODE, (i,)) for i in range(6)}
    drains: dict[str, ev.ReplicaDrainEvent] = {}

    async def drain(replica: str) -> None:
        drains[replica] = drain_cmd(replica, grace_s=0.3)
        await pub.publish(drains[replica], node=NODE)

    for r in ("r-0", "r-1", "r-2", "r-3"):
        await pub.publish(starts[r])
    await drain("r-0")
    await drain("r-1")

    procs: list[AgentProcess] = []
    try:
        # 1. Dies right after its third state is stored, before that command is acked.
        p1 = AgentProcess(nats_server.url, tmp_path / "agent-1.log", "--exit-after-states", "3")
        procs.append(p1)
        assert await p1.exited() == 137, p1.text()
        after_p1 = len(await states(js, NODE))
        assert after_p1 == 3

        # 2. Killed with SIGKILL as soon as it has stored anything of its own.
        p2 = AgentProcess(nats_server.url, tmp_path / "agent-2.log")
        procs.append(p2)
        await wait_for(lambda: states(js, NODE), lambda s: len(s) > after_p1, within_s=15)
        p2.kill()
        await p2.exited()

        # 3. Commands sent while no agent runs wait in its durable consumer.
        await pub.publish(starts["r-4"])
        await pub.publish(starts["r-5"])
        await drain("r-2")
        await drain("r-3")
        await drain("r-4")

        p3 = AgentProcess(nats_server.url, tmp_path / "agent-3.log")
        procs.append(p3)
        want = {r: "stopped" for r in ("r-0", "r-1", "r-2", "r-3", "r-4")} | {"r-5": "ready"}
        await wait_for(
            lambda: states(js, NODE),
            lambda s: all(by_replica(s).get(r, [""])[-1] == w for r, w in want.items()),
            within_s=20,
        )
        await wait_for(
            lambda: js.consumer_info(subjects.STREAM, durable_name(NODE)),
            lambda ci: ci.num_pending == 0 and ci.num_ack_pending == 0,
            within_s=10,
        )
        p3.proc.send_signal(signal.SIGTERM)
        assert await p3.exited() == 0, p3.text()
    finally:
        for p in procs:
            p.close()

    got = await states(js, NODE)
    counts = Counter((e.data.replica, e.data.state) for e in got)
    twice = {k: n for k, n in counts.items() if n != 1}
    logs = "\n".join(f"--- {p.log.name}\n{p.text()}" for p in procs)
    assert not twice, f"published more than once: {twice}\n{logs}"

    order = ev.STATE_ORDER
    for replica, seen in by_replica(got).items():
        assert [order[s] for s in seen] == sorted(order[s] for s in seen), (replica, seen)
        if replica in drains:
            # A drain that overtook its own start (the start waited out the ack wait of
            # the agent that died holding it) stops the replica before it ever runs.
            assert seen[-2:] == ["draining", "stopped"] or seen == ["stopped"], (replica, seen)
        else:
            assert seen == ["starting", "loading", "ready"], (replica, seen)
    for e in got:
        by_drain = e.data.state in ("draining", "stopped")
        cause = drains[e.data.replica].id if by_drain else starts[e.data.replica].id
        assert e.causation == cause, (e.data.replica, e.data.state)

    # The scenario really happened: a command came back to a restarted agent.
    assert "(redelivered)" in p2.text() + p3.text(), logs
