"""A control plane with a real engine, for the engine tier: `llmgw up` (its broker, the
scheduler, the preemption service and the gateway; no simulated nodes), one real
`llmgw agent` whose replicas are vLLM's CPU build serving the tiny model, the official
`openai` client on the gateway, and a follower of the log (its view, read on its own
loop's thread).

Started once per test module (a vLLM start takes half a minute of a core): the tests of
a module go on from where the one before left the cluster."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import openai

from services.agent import procs
from services.bus import connect
from services.core.view import View
from services.plane.follower import ViewFollower
from tests.agent import realagent as ra
from tests.agent.test_process_runtime import _ports
from tests.engine import engine
from tests.up_process import UpProcess

T = TypeVar("T")

NODE = "cpu-1"


def cluster(python: Path, weights: Path) -> str:
    """Three on-demand models of the tiny model, one 'GPU' each: `chat` (standard),
    `batch` (opportunistic, what a critical model may take the room of) and `urgent`
    (critical)."""
    runtime = {
        "engine": "vllm",
        "python": str(python),
        "weights": str(weights),
        "args": list(engine.ARGS),
        "env": dict(engine.ENV),
        "ready_timeout": engine.READY_S,
    }
    models = [
        {
            "name": name,
            "class": cls,
            "min": 0,
            "max": 1,
            "profiles": [{"name": "cpu", "gpus": 1}],
            "runtime": runtime,
        }
        for name, cls in (("chat", "standard"), ("batch", "opportunistic"), ("urgent", "critical"))
    ]
    return json.dumps({"models": models}, indent=2)  # JSON is YAML


class _Follower:
    """A ViewFollower on a loop of its own thread; `ask(fn)` runs fn(view) there, so a
    test reads a view the fold is not changing under it."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.follower: ViewFollower | None = None
        self._nc: Any = None
        self._run(self._start(url))

    def _run(self, coro: Any, timeout: float = 30) -> Any:
        f: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return f.result(timeout)

    async def _start(self, url: str) -> None:
        self._nc = await connect(url, "engine-tier")
        self.follower = ViewFollower(self._nc.jetstream(), consumer="engine-tier")
        self.follower.start()

    def ask(self, fn: Callable[[View], T]) -> T:
        async def on_loop() -> T:
            assert self.follower is not None
            return fn(self.follower.view)

        return self._run(on_loop())  # type: ignore[no-any-return]

    def close(self) -> None:
        async def stop() -> None:
            if self.follower is not None:
                await self.follower.stop()
            if self._nc is not None:
                await self._nc.close()

        try:
            self._run(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class EnginePlane:
    def __init__(self, base: Path, python: Path, weights: Path) -> None:
        self.base = base
        self.data = base / "data"
        self.up = UpProcess(
            self.data,
            base / "up.log",
            "--no-ui",
            "--gateway-listen", "127.0.0.1:0",
            "--tick", "0.2",
            "--node-timeout", "60",
            "--drain-grace", "60",
            "--min-lifetime", "0",
            "--used-interval", "0.5",
            "--upstream-timeout", "120",
        )  # fmt: skip
        self.agent: ra.RealAgent | None = None
        self.view: _Follower | None = None
        try:
            self.url = self.up.wait_url()
            url_file = self.data / "gateway.url"
            deadline = time.monotonic() + 30
            while not url_file.exists() or not url_file.read_text().strip():
                assert self.up.alive() and time.monotonic() < deadline, self.up.text()[-3000:]
                time.sleep(0.05)
            self.gateway = url_file.read_text().strip()
            self.client = openai.OpenAI(
                base_url=self.gateway, api_key="unused", max_retries=0, timeout=600
            )
            self.agent = ra.RealAgent(
                self.url,
                NODE,
                base,
                "--ports", _ports(16),
                "--used-interval", "0.5",
                "--scrape", "0.5",
                gpus="2xH100-80GB",
            )  # fmt: skip
            self.view = _Follower(self.url)
            spec = base / "cluster.yaml"
            spec.write_text(cluster(python, weights))
            applied = self.llmgw("apply", "-f", str(spec))
            assert applied.returncode == 0, applied.stderr
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ reading

    def llmgw(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.up.llmgw(*args)

    def ask(self, fn: Callable[[View], T]) -> T:
        assert self.view is not None
        return self.view.ask(fn)

    def until(self, what: str, check: Callable[[View], T], within_s: float = 240) -> T:
        """Wait for `check(view)` to be truthy; its value. Fails at once if a process of
        the plane died."""
        deadline = time.monotonic() + within_s
        while True:
            got = self.ask(check)
            if got:
                return got
            assert self.up.alive(), self.up.text()[-3000:]
            assert self.agent is not None and self.agent.proc.poll() is None, self.agent.text()[
                -3000:
            ]
            assert time.monotonic() < deadline, f"{what}: not within {within_s}s"
            time.sleep(0.1)

    def replicas(self, model: str) -> Callable[[View], list[Any]]:
        return lambda v: sorted(
            (r for r in v.replicas.values() if r.model == model), key=lambda r: r.created_at
        )

    def ready(self, model: str, within_s: float = 240, *, but: set[str] = frozenset()) -> Any:  # type: ignore[assignment]
        """The first replica of `model` that is ready (none of `but`), once there is one."""

        def one(v: View) -> Any:
            for r in self.replicas(model)(v):
                if r.state == "ready" and r.id not in but:
                    return r
            return None

        return self.until(f"a ready replica of {model}", one, within_s)

    def events(self, *types: str) -> list[dict[str, Any]]:
        """The log's events of `types`, as `llmgw events export` writes them."""
        out = self.llmgw("events", "export", "--out", "-")
        assert out.returncode == 0, out.stderr
        got = []
        for line in out.stdout.splitlines():
            e = json.loads(line)
            e = e.get("event", e)
            if not types or e.get("type") in types:
                got.append(e)
        return got

    def server(self, replica: str) -> dict[str, Any]:
        """The agent's entry for the replica's server (pid, port, ...)."""
        return ra.servers(self.base, NODE)[replica]

    def group(self, replica: str, leader: int | None = None) -> set[int]:
        """The live processes of a replica's server: its group and descendants, and what
        carries its tag (vLLM's engine core renames itself, which can wipe the tag from
        what /proc shows of its environment; it stays in the server's group)."""
        if leader is None:
            leader = ra.servers(self.base, NODE).get(replica, {}).get("pid")
        tag = f"llmgw/{NODE}/{replica}/"
        if leader is not None and not procs.alive(leader):
            return procs.members(tag, None, group=leader)
        return procs.members(tag, leader)

    def close(self) -> None:
        """Every model scaled to 0 and its servers stopped by the agent (which kills a
        server's whole group), then the agent and the plane stopped; nothing of an engine
        may be left."""
        left: dict[str, set[int]] = {}
        try:
            if self.view is not None and self.up.alive():
                for m in ("chat", "batch", "urgent"):
                    self.llmgw("scale", m, "0")
                self.until(
                    "every replica stopped",
                    lambda v: all(r.state in ("stopped", "failed") for r in v.replicas.values()),
                    within_s=120,
                )
            servers = ra.servers(self.base, NODE)
            left = {r: self.group(r) for r in servers}
            left = {r: p for r, p in left.items() if p}
        finally:
            if self.view is not None:
                self.view.close()
            try:
                if self.agent is not None:
                    self.agent.stop()
            finally:
                self.up.stop()
                for r, pids in ra.sweep(NODE).items():
                    left.setdefault(r, set()).update(pids)
                for pids in left.values():
                    procs.kill(pids)
        assert not left, f"engine processes left behind: {left}"


def parse_time(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def chunks(stream: Iterator[Any]) -> list[Any]:
    return list(stream)
