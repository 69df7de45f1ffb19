"""`llmgw up`'s gateways: N processes of their own on one port, restarted when they die.

Called by `services.up`. The gateway never runs in the process of the scheduler, the
preemption service and the projector: a gateway that crashes, is killed or takes its
memory with a flood of bodies takes only its own requests with it, and the plane goes on
deciding. `up` holds the port (bound, not listening: `Reservation`), and each process
(`python -m services.gateway.supervised`, its settings on its standard input, never in
its command line) listens on it with SO_REUSEPORT, so that clients have one address and
the kernel spreads their connections among the processes (measured against one
inherited listening socket on a loaded 2-core host, 3 processes, a connection a request:
max/min connections a process 1.07-1.14 against 1.27-1.48; neither lost a connection to
a kill -9 at 3,000 connections a second; docs/gateway.md, "A fleet of gateways").

A process that ends while `up` runs is started again after `RESTART_FIRST_S`, doubled
at each restart that follows within `STEADY_S` of the last, up to `RESTART_MAX_S`, each
said in one line. One that ends before it has ever served (a setting or a key file it
refuses) stops `up` with its exit code: its own line above says why, and restarting it
would say it again forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services import listen
from services.bus.fleet import Fleet, Traffic
from services.gateway.config import Config
from services.gateway.errors import GatewayError
from services.gateway.listen import DEFAULT_LISTEN
from services.gateway.supervised import Settings, encode

log = logging.getLogger("llmgw.up")

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
# STEADY_S: a process that served this long before it ended is restarted after
# RESTART_FIRST_S again, not after its predecessors' backoff.
STEADY_S = 60.0
# READY_S bounds the wait for a process's first announcement (its view caught up with
# the log, its socket listening): the gateway's own catch-up bound and a margin.
READY_S = 45.0
# STOP_S bounds a process's clean stop (SIGTERM: goodbye, its streams' end); SIGKILL then.
STOP_S = 10.0
# HERE is where this `llmgw`'s code is: the processes run it, wherever `up` was started.
HERE = str(Path(__file__).resolve().parent.parent)


class Reservation:
    """The gateways' port, held by `up` while it runs: bound with SO_REUSEPORT and not
    listening, so that nobody else takes it while a process restarts, and each process
    may listen on it too. Has what `services.up._bind` asks of a server."""

    def __init__(self, listen_at: str) -> None:
        self.listen = listen_at
        self.url = ""

    def bind(self) -> socket.socket:
        # A plain bind first: a port someone holds in any way (another `up`'s gateways,
        # whose SO_REUSEPORT would let this one share it) is taken.
        probe, _ = listen.bind(self.listen, DEFAULT_LISTEN, 1, GatewayError, listening=False)
        port = probe.getsockname()[1]
        probe.close()
        host = self.listen.rpartition(":")[0]
        # Without SO_REUSEADDR: another `up`'s plain bind (its probe above, which sets
        # it) then fails on this port while no process of ours listens yet; with it,
        # Linux let both have the port until the first process listened, and the
        # kernel spread one `up`'s clients over the other's gateways. Sockets with
        # SO_REUSEPORT of this user (our processes, our closed connections' TIME_WAIT)
        # still share it.
        sock, self.url = listen.bind(
            f"{host}:{port}",
            DEFAULT_LISTEN,
            1,
            GatewayError,
            reuse_port=True,
            reuse_addr=False,
            listening=False,
        )
        return sock

    def address(self) -> str:
        """HOST:PORT as bound (the port resolved), for the processes."""
        return self.url.removeprefix("http://")


@dataclass
class Gateways:
    """The gateway processes of one `up`."""

    count: int
    config: Config
    nats: str
    root: str
    listen: str
    """HOST:PORT, the port resolved (`Reservation.address`)."""
    plane: tuple[str, ...] = ()
    python: str = sys.executable
    procs: dict[int, asyncio.subprocess.Process] = field(default_factory=dict)
    restarts: int = 0
    """Restarts so far, all processes together."""
    fleet: Fleet | None = None
    """The gateways as `up` hears them (started by `start`)."""
    traffic: Traffic | None = None
    """Their traffic per model, for the dashboard beside them."""

    async def start(self, nc: Any) -> None:
        """Start every process; return once each has announced itself on `nc` (it
        serves). `GatewayError` when one ends first or does not within `READY_S`."""
        self.fleet = Fleet(nc, self.root)
        self.traffic = Traffic(self.fleet)
        await self.fleet.start()
        for i in range(1, self.count + 1):
            self.procs[i] = await self._spawn(i)
        await self._ready(self.fleet, list(self.procs))

    async def _ready(self, fleet: Fleet, which: list[int]) -> None:
        deadline = time.monotonic() + READY_S
        while True:
            pids = {(a.host, a.pid) for a in fleet.live().values()}
            host = socket.gethostname()
            waiting = [i for i in which if (host, self.procs[i].pid) not in pids]
            if not waiting:
                return
            for i in waiting:
                rc = self.procs[i].returncode
                if rc is not None:
                    raise GatewayError(
                        f"gateway {i} ended before it served ({_ended(rc)}): its line above "
                        "says why"
                    )
            if time.monotonic() > deadline:
                raise GatewayError(
                    f"gateway {waiting[0]} did not serve within {READY_S:g}s of its start"
                )
            await asyncio.sleep(0.05)

    async def run(self, stop: asyncio.Event) -> None:
        """Watch the processes until `stop`; restart one that ends; then stop them all."""
        try:
            await asyncio.gather(*(self._watch(i, stop) for i in list(self.procs)))
        finally:
            await self.stop()

    async def _watch(self, i: int, stop: asyncio.Event) -> None:
        backoff = RESTART_FIRST_S
        began = time.monotonic()
        while not stop.is_set():
            proc = self.procs[i]
            ended = asyncio.ensure_future(proc.wait())
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([ended, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not ended.done():
                ended.cancel()
                return
            if stop.is_set():
                return
            if time.monotonic() - began >= STEADY_S:
                backoff = RESTART_FIRST_S
            self.restarts += 1
            log.warning(
                "gateway %d (pid %d) %s; starting it again in %.1fs (restart %d); the "
                "plane goes on deciding",
                i,
                proc.pid,
                _ended(proc.returncode),
                backoff,
                self.restarts,
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await stop.wait()
            if stop.is_set():
                return
            backoff = min(backoff * 2, RESTART_MAX_S)
            began = time.monotonic()
            try:
                self.procs[i] = await self._spawn(i)
            except OSError as e:
                log.error("gateway %d: could not be started again: %s", i, e)

    async def stop(self) -> None:
        """SIGTERM each process (its clean stop, goodbye included), SIGKILL one that has
        not ended within `STOP_S`."""
        if self.fleet is not None:
            await self.fleet.stop()
        live = [p for p in self.procs.values() if p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in live:
            try:
                async with asyncio.timeout(STOP_S):
                    await p.wait()
            except TimeoutError:
                log.warning("up: gateway pid %d did not stop within %gs; killing it", p.pid, STOP_S)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
            if p.stdin is not None:
                with contextlib.suppress(Exception):
                    p.stdin.close()

    async def _spawn(self, i: int) -> asyncio.subprocess.Process:
        settings = Settings(
            nats=self.nats,
            root=self.root,
            config=self.config,
            listen=self.listen,
            plane=self.plane,
            index=i,
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            self.python,
            "-m",
            "services.gateway.supervised",
            stdin=asyncio.subprocess.PIPE,
            env=env,
            # Its own session: a Ctrl-C at the terminal reaches `up`, which stops the
            # processes itself, and is not taken for a crash to restart.
            start_new_session=True,
        )
        assert proc.stdin is not None
        # One line, and the pipe kept open: its end tells the process that `up` is gone.
        proc.stdin.write(encode(settings) + b"\n")
        await proc.stdin.drain()
        return proc


def _ended(rc: int | None) -> str:
    if rc is None:
        return "is running"
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"
