"""The seam between the agent and what actually runs replicas on a host.

`Agent` (services/agent/agent.py) calls a `Runtime` to start and stop replicas; the
runtime calls back `report(state, reason)` as each replica moves along its life. The
agent turns those reports into `replica.state` events; the runtime never publishes,
never touches NATS, and never decides anything about the cluster. `SimulatedRuntime`
walks the states with configurable delays so the whole control plane runs on a laptop;
`services.agent.process.ProcessRuntime` runs real model servers behind the same Protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Protocol

from schemas import events as ev
from services.agent.responder import Responder, Timing

log = logging.getLogger("llmgw.agent")


class Report(Protocol):
    """What a runtime calls as a replica reaches a state. It returns once the agent has
    recorded the state (published it, or found it already said). A report that would move
    the replica backwards, or repeat its state, is ignored by the agent."""

    async def __call__(self, state: ev.ReplicaStateName, reason: str | None = None) -> None: ...


class Runtime(Protocol):
    """Starts and stops replicas on one host.

    Contract the agent relies on:
    - `start` reports starting, loading, then ready (or failed, with a reason), and
      returns once the replica is ready or failed. It may raise; the agent then reports
      failed with the error as the reason.
    - `start` may be called again for a replica it was already starting (the agent
      restarted mid-flight and re-drives it from the log): it carries on from where the
      replica is, and reporting an earlier state again is harmless.
    - The agent may cancel a `start` in flight (a drain arrived first); the runtime then
      stops bringing the replica up and leaves stopping it to `stop`.
    - `stop` reports draining, then stopped once the replica is gone, taking at most
      `grace_s` to let it finish its requests. It is called for replicas this process may
      never have started (the agent restarted), and must stop them anyway.
    - `running` is what the runtime holds now, replica -> state, for heartbeats and status.
    - `needs_model_runtime`: the agent passes `start` the model's declared `runtime`
      (read from the log), or None when the model declares none.
    - `adopt` is called once at the agent's start, before anything is re-driven, with the
      replicas the log says hold GPUs on this node: the runtime takes back what it still
      runs of them and stops whatever else it finds of its own.
    - `resume` is called, after `adopt`, for each replica the log says is ready: it
      reports ready (or failed, when the replica's server is gone) and watches it again.
    - `served` is replica -> when it last served a request, as the runtime has seen it.
    - `loads` is replica -> what its engine last said of its load (a server's metrics),
      for the agent's `replica.used`; empty where no engine says.
    - `endpoint` is where a ready replica's server answers, as other hosts reach it
      (`http://host:port`), or None when it has none to offer; the agent puts it in the
      replica's `ready` report.
    """

    needs_model_runtime: bool

    async def start(
        self,
        replica: str,
        *,
        model: str,
        profile: str,
        shards: tuple[ev.ShardSpec, ...],
        report: Report,
        runtime: ev.ModelRuntime | None = None,
    ) -> None: ...

    async def stop(self, replica: str, *, grace_s: float, report: Report) -> None: ...

    def running(self) -> dict[str, str]: ...

    async def adopt(self, known: Mapping[str, ev.ReplicaState]) -> None: ...

    async def resume(self, replica: str, *, report: Report) -> None: ...

    def served(self) -> dict[str, datetime]: ...

    def loads(self) -> dict[str, ev.EngineLoad]: ...

    def endpoint(self, replica: str) -> str | None: ...


class SimulatedRuntime:
    """A runtime with no GPUs: replicas go starting -> loading -> ready after
    `start_delay_s` and `load_delay_s`, and draining -> stopped after
    min(grace, `stop_delay_s`). Replicas of a model in `fail_models` fail while loading,
    for tests of what the control plane does with a replica that never comes up.

    The sleeps are the simulation itself: they stand for pulling an image and loading
    weights. A delay of 0 still yields to the loop once.

    With `serve` (a `responder.Timing`), each ready replica answers requests: a simulated
    OpenAI-compatible server (`services.agent.responder`) on a loopback port, its
    endpoint. A drain lets the requests it is answering finish, up to the drain's grace,
    then closes it; with `server_drains` off it closes it at once, cutting what it is
    answering, as a server that exits on SIGTERM does (then only the agent's wait for
    the gateways, `services.agent.gateways`, keeps requests whole). Without `serve`,
    replicas have no endpoint.
    """

    needs_model_runtime = False

    def __init__(
        self,
        start_delay_s: float = 0.5,
        load_delay_s: float = 2.0,
        stop_delay_s: float = 0.5,
        *,
        fail_models: Collection[str] = (),
        serve: Timing | None = None,
        server_drains: bool = True,
    ) -> None:
        for name, v in (
            ("start_delay_s", start_delay_s),
            ("load_delay_s", load_delay_s),
            ("stop_delay_s", stop_delay_s),
        ):
            if v < 0:
                raise ValueError(f"{name} must be 0 or more, got {v}")
        self.start_delay_s = start_delay_s
        self.load_delay_s = load_delay_s
        self.stop_delay_s = stop_delay_s
        self.fail_models = frozenset(fail_models)
        self.serve = serve
        self.server_drains = server_drains
        self._states: dict[str, str] = {}
        self._models: dict[str, str] = {}
        self._servers: dict[str, Responder] = {}
        self._ports: dict[str, int] = {}
        """Ports the log's endpoints name for replicas adopted after a restart."""

    @property
    def address(self) -> str:
        """Where the simulated servers answer (loopback), said in the node's inventory;
        "" when they serve nothing."""
        return "127.0.0.1" if self.serve is not None else ""

    async def start(
        self,
        replica: str,
        *,
        model: str,
        profile: str,
        shards: tuple[ev.ShardSpec, ...],
        report: Report,
        runtime: ev.ModelRuntime | None = None,
    ) -> None:
        self._states[replica] = "starting"
        await report("starting")
        await asyncio.sleep(self.start_delay_s)
        self._states[replica] = "loading"
        await report("loading")
        await asyncio.sleep(self.load_delay_s)
        if model in self.fail_models:
            self._states.pop(replica, None)
            await report("failed", "simulated: weights failed to load")
            return
        self._models[replica] = model
        await self._serve(replica)
        self._states[replica] = "ready"
        await report("ready")

    async def stop(self, replica: str, *, grace_s: float, report: Report) -> None:
        self._states[replica] = "draining"
        await report("draining")
        start = time.monotonic()
        await asyncio.sleep(max(0.0, min(grace_s, self.stop_delay_s)))
        server = self._servers.pop(replica, None)
        if server is not None:
            # The requests it is answering run to the drain's grace, not to the
            # simulated stop: a drain that cut them would be a fault of its own.
            left = grace_s - (time.monotonic() - start) if self.server_drains else 0.0
            if not await server.quiet(left):
                log.info("%s: cut %d requests at the end of its grace", replica, server.active)
            await server.close()
        self._states.pop(replica, None)
        await report("stopped")

    async def _serve(self, replica: str) -> None:
        if self.serve is None or replica in self._servers:
            return
        server = Responder(replica, self._models.get(replica, replica), self.serve)
        await server.start(self._ports.pop(replica, 0))
        self._servers[replica] = server

    def endpoint(self, replica: str) -> str | None:
        server = self._servers.get(replica)
        return None if server is None else server.endpoint

    async def close(self) -> None:
        """Close the simulated servers (the process is going away)."""
        for server in self._servers.values():
            await server.close()
        self._servers.clear()

    def running(self) -> dict[str, str]:
        return dict(self._states)

    async def adopt(self, known: Mapping[str, ev.ReplicaState]) -> None:
        # A simulated replica lives as long as the log says it does.
        for r, s in known.items():
            if s.state == "ready":
                self._states[r] = "ready"
                self._models[r] = s.model
                # The log says where it answered: answer there again, so the endpoint
                # it holds stays true (a fresh port only when that one is taken).
                if s.endpoint is not None:
                    port = s.endpoint.rpartition(":")[2]
                    if port.isdigit():
                        self._ports[r] = int(port)

    async def resume(self, replica: str, *, report: Report) -> None:
        self._states[replica] = "ready"
        await self._serve(replica)

    def served(self) -> dict[str, datetime]:
        return {}

    def loads(self) -> dict[str, ev.EngineLoad]:
        return {}
