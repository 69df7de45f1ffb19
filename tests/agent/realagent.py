"""Helpers for the process runtime's tests: a real `llmgw agent` (no --simulate) as a child
process, models whose runtime is the fake server, and the check that no process of a
test is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from nats.js.client import JetStreamContext

from schemas import events as ev
from services.agent import procs
from services.bus import Publisher
from tests.agent.helpers import new_id, states, wait_for

REPO = Path(__file__).resolve().parents[2]
FAKE = str(REPO / "tests" / "agent" / "fakeserver.py")
FAKE_NVML_DIR = str(REPO / "tests" / "agent" / "fakenvml")
FAKE_VLLM_DIR = str(REPO / "tests" / "agent" / "fakevllm")


def fake_runtime(*switches: str, ready_timeout: float = 30.0) -> ev.ModelRuntime:
    """The fake server as a model's runtime, with vLLM-style metrics."""
    return ev.ModelRuntime(
        engine="command",
        command=(sys.executable, FAKE, "--host", "{host}", "--port", "{port}", *switches),
        ready_timeout=ready_timeout,
        metrics="/metrics",
    )


def fake_vllm_runtime(
    *switches: str, weights: str | None = "/models/tiny", ready_timeout: float = 30.0
) -> ev.ModelRuntime:
    """The fake server as vLLM run by its module from an engine environment (`python`):
    this interpreter, with the stand-in `vllm` package (tests/agent/fakevllm) on its
    path; `switches` are the fake server's."""
    return ev.ModelRuntime(
        engine="vllm",
        python=sys.executable,
        weights=weights,
        env={"PYTHONPATH": FAKE_VLLM_DIR},
        args=switches,
        ready_timeout=ready_timeout,
    )


def declared(model: str, runtime: ev.ModelRuntime | None) -> ev.Event:
    return ev.make(
        ev.ModelDeclared(
            name=model,
            min=0,
            profiles=(ev.ProfileSpec(name="tp1", gpus=1),),
            runtime=runtime,
        ),
        id=new_id(),
        time=datetime.now(UTC),
        source="test/operator",
    )


class RealAgent:
    """`llmgw agent --node NODE --gpus 2xH100-80GB` (the process runtime), its log in a file.

    In its own session, so that killing it never reaches the test; its servers are in
    sessions of their own and outlive it, as they would a real agent's crash."""

    def __init__(
        self,
        url: str,
        node: str,
        data: Path,
        *extra: str,
        gpus: str | None = "2xH100-80GB",
        env: dict[str, str] | None = None,
        n: int = 0,
    ) -> None:
        self.node = node
        self.log = data / f"agent-{node}-{n}.log"
        self._out = self.log.open("wb")
        argv = [
            sys.executable,
            "-m",
            "services.cli",
            "agent",
            "--nats",
            url,
            "--data",
            str(data),
            "--node",
            node,
            "--heartbeat",
            "0.5",
            "--ack-wait",
            "2",
            *(["--gpus", gpus] if gpus else []),
            *extra,
        ]
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._out.close()
        return self.proc.returncode

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def servers(data: Path, node: str) -> dict[str, dict]:
    """The agent's state file: replica -> its server's entry."""
    f = data / f"agent-{node}" / "state.json"
    try:
        return {e["replica"]: e for e in json.loads(f.read_text())}
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def leftovers(node: str) -> dict[str, set[int]]:
    return procs.tagged(f"llmgw/{node}/")


def sweep(node: str) -> dict[str, set[int]]:
    """Kill whatever of `node`'s servers is left; return what was found."""
    found = leftovers(node)
    for pids in found.values():
        procs.kill(pids)
    deadline = time.monotonic() + 5
    while leftovers(node) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


async def state_of(js: JetStreamContext, node: str, replica: str) -> list[str]:
    return [e.data.state for e in await states(js, node) if e.data.replica == replica]


async def until_state(
    js: JetStreamContext, node: str, replica: str, state: str, within_s: float = 20.0
) -> list[ev.ReplicaStateEvent]:
    """Wait for `replica` to reach `state` (or a final one); its state events."""

    async def probe() -> list[ev.ReplicaStateEvent]:
        return [e for e in await states(js, node) if e.data.replica == replica]

    def done(es: list[ev.ReplicaStateEvent]) -> bool:
        got = {e.data.state for e in es}
        return state in got or bool(got & {"stopped", "failed"})

    return await wait_for(probe, done, within_s)


async def publish(js: JetStreamContext, e: ev.Event, node: str | None = None) -> None:
    await Publisher(js).publish(e, node=node)


async def gone(pids: set[int], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while any(procs.alive(p) for p in pids):
        if time.monotonic() > deadline:
            raise AssertionError(f"still alive: {[p for p in pids if procs.alive(p)]}")
        await asyncio.sleep(0.02)


def ghost(node: str) -> subprocess.Popen[bytes]:
    """A process tagged as a server of `node` that no state file knows."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time\nwhile True: time.sleep(60)"],
        env={**os.environ, procs.TAG_ENV: f"llmgw/{node}/ghost/0"},
        start_new_session=True,
    )


def text(path: str | Path) -> str:
    return Path(path).read_text(errors="replace")
