"""`llmgw up`: the whole control plane in one process, on an embedded broker by default.

Called by `services.cli.up` (the command) and by end-to-end tests, which run `run()` in
their own event loop. It composes what the other packages build — the embedded broker,
the projector, the scheduler, the preemption service and simulated agents — and owns
only their lifecycle: start in order, log what runs where, stop cleanly on the stop
event (Ctrl-C), and stop everything if one of them dies rather than limp on half-built.
It decides nothing itself.

With `nats_url` set it joins an existing broker instead of starting one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services import lease
from services.agent import Agent, SimulatedRuntime, spec
from services.agent import consumers as agent_consumers
from services.bus import EmbeddedBroker, connect, ensure_streams, snapshots, tracing
from services.bus import broker as bus_broker
from services.bus.errors import BrokerError
from services.bus.urls import public_url
from services.core import preemption, scheduling
from services.dashboard.server import Dashboard, DashboardError
from services.preemption.config import Config as PreemptionConfig
from services.preemption.service import PreemptionService
from services.projector.service import Projector
from services.scheduler.service import Scheduler

log = logging.getLogger("llmgw.up")

DB_FILE = "view.sqlite"
# URL_FILE holds the dashboard's address while `up` serves it.
URL_FILE = "dashboard.url"


class UpError(Exception):
    """Why the control plane could not come up; str() is the one line to show."""


@dataclass
class UpOptions:
    """What `llmgw up` runs, with the defaults of its flags."""

    data: Path
    nats_url: str | None = None
    """Join this broker instead of starting the embedded one."""
    port: int | None = None
    """The embedded broker's port; None: a free one."""
    root: str = "llmgw"
    simulate: str | None = None
    """A simulated cluster, e.g. `4x8xH100-80GB`; None: no simulated agents."""
    policy: preemption.Config = field(default_factory=preemption.Config)
    scheduler: scheduling.Config = field(default_factory=scheduling.Config)
    """The scheduler's knobs; its drain grace is the preemption service's too."""
    start_delay_s: float = 0.5
    load_delay_s: float = 2.0
    stop_delay_s: float = 0.5
    heartbeat_s: float = 1.0
    traffic: dict[str, float] = field(default_factory=dict)
    projector: bool = True
    duplicate_window_s: float = 120.0
    ui: str | None = None
    """Where the dashboard listens (HOST:PORT); None: no dashboard."""
    ui_token: str | None = None
    ui_hosts: tuple[str, ...] = ()
    """`Host` names the dashboard answers for besides loopback ones (`--allow-host`)."""
    replicas: int | None = None
    """Copies of the log, the leases and the snapshots; None: 3 when the broker is a
    cluster, 1 on a single server."""


@dataclass
class Running:
    """What is up, for tests and for the start-up summary."""

    url: str
    broker: EmbeddedBroker | None
    scheduler: Scheduler
    preemption: PreemptionService
    projector: Projector | None
    agents: list[Agent]
    db_path: Path
    dashboard_url: str | None = None


# BROKER_RESTARTS is how many times `up` restarts a broker that died within
# BROKER_RESTART_WINDOW_S. A broker that keeps dying (a full disk, a broken store) is
# better reported in one line than restarted in a loop that fills the log.
BROKER_RESTARTS = 3
BROKER_RESTART_WINDOW_S = 60.0
# BROKER_CHECK_S is how often `up` looks at its broker: a crash is seen, and the zombie
# reaped, within this.
BROKER_CHECK_S = 0.25


def _claim(data: Path) -> int:
    """Take the data directory for this `up`: refuse when a live `up` holds it; stop the
    broker a killed one left behind. Returns the lock's descriptor, held until exit."""
    fd = bus_broker.lock_data_dir(data)
    if fd is None:
        url = bus_broker.read_url(data)
        at = f" at {public_url(url)}" if url else ""
        raise UpError(
            f"another `llmgw up` already serves {data}{at}; stop it first, "
            "or use another --data directory"
        )
    orphan = bus_broker.stop_orphan(data)
    if orphan is not None:
        log.warning(
            "broker: stopped nats-server pid %d, left running by an `llmgw up` that was killed",
            orphan,
        )
    return fd


async def _watch_broker(broker: EmbeddedBroker, stop: asyncio.Event) -> None:
    """Restart the embedded broker on the same port and store when it dies; raise
    `UpError` when it died BROKER_RESTARTS times within BROKER_RESTART_WINDOW_S."""
    deaths: list[float] = []
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), BROKER_CHECK_S)
        status = broker.exit_status
        if stop.is_set() or status is None:
            continue
        now = loop.time()
        deaths = [t for t in deaths if now - t < BROKER_RESTART_WINDOW_S] + [now]
        if len(deaths) > BROKER_RESTARTS:
            raise UpError(
                f"nats-server died {len(deaths)} times in {BROKER_RESTART_WINDOW_S:g}s "
                f"(last status {status}); see {broker.log_path}"
            )
        log.error(
            "broker: nats-server exited with status %s; restarting it on the same store",
            status,
        )
        try:
            await asyncio.to_thread(broker.start)
        except BrokerError as e:
            raise UpError(f"could not restart nats-server: {e}") from e
        log.info("broker: restarted on %s", broker.address)


async def run(
    opts: UpOptions,
    stop: asyncio.Event,
    on_ready: Callable[[Running], Any] | None = None,
) -> int:
    """Run until `stop` is set; returns 0, or 1 when a service died and took the rest down."""
    opts.data.mkdir(parents=True, exist_ok=True)
    nodes = spec.parse_cluster(opts.simulate) if opts.simulate else []
    tracer_provider = tracing.setup_from_env("llmgw")
    broker: EmbeddedBroker | None = None
    lock: int | None = None
    if opts.nats_url:
        url = opts.nats_url
    else:
        lock = _claim(opts.data)
        broker = EmbeddedBroker(opts.data, port=opts.port, auth=True)
        url = await asyncio.to_thread(broker.start)
        log.info(
            "broker: nats-server on %s (credentials in %s), store %s (log %s)",
            broker.address,
            opts.data / bus_broker.URL_FILE,
            broker.store_dir,
            broker.log_path,
        )
    try:
        return await _serve(opts, url, broker, nodes, stop, on_ready)
    finally:
        if broker is not None:
            await asyncio.to_thread(broker.stop)
            log.info("broker: stopped")
        if lock is not None:
            os.close(lock)
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flushes the spans still batched


async def _serve(
    opts: UpOptions,
    url: str,
    broker: EmbeddedBroker | None,
    nodes: list[spec.NodeSpec],
    stop: asyncio.Event,
    on_ready: Callable[[Running], Any] | None,
) -> int:
    nc = await connect(url, "llmgw up")
    # Agents get a connection of their own, as they would on their own hosts: the
    # control plane's consumers and the agents' commands do not queue behind each other.
    agents_nc = await connect(url, "llmgw up agents") if nodes else None
    try:
        js = nc.jetstream()
        info = await ensure_streams(js, opts.root, opts.duplicate_window_s, opts.replicas)
        # The leases and the snapshots are kept in as many copies as the log: the number
        # the log was made with, so a single server is not asked for three again.
        copies = info.config.num_replicas or 1
        ttl = min(opts.scheduler.lease_ttl_s, PreemptionConfig().lease_ttl_s)
        await lease.ensure_bucket(js, lease.DEFAULT_BUCKET, ttl, copies)
        await snapshots.bucket(js, replicas=copies)
        me = f"{socket.gethostname()}-{os.getpid()}"
        scheduler = Scheduler(
            nc, js, root=opts.root, config=opts.scheduler, holder=f"{me}-scheduler"
        )
        preempt = PreemptionService(
            nc,
            js,
            root=opts.root,
            config=PreemptionConfig(policy=opts.policy, drain_grace_s=opts.scheduler.drain_grace_s),
            holder=f"{me}-preemption",
        )
        db_path = opts.data / DB_FILE
        projector = Projector(js, db_path, opts.root) if opts.projector else None
        agents: list[Agent] = []
        if agents_nc is not None:
            ajs = agents_nc.jetstream()
            for n in nodes:
                agents.append(
                    Agent(
                        agents_nc,
                        ajs,
                        node=n.name,
                        gpus=spec.gpu_inventory(n.name, n.gpus),
                        cpu_cores=n.cpu_cores,
                        memory_gb=n.memory_gb,
                        runtime=SimulatedRuntime(
                            opts.start_delay_s, opts.load_delay_s, opts.stop_delay_s
                        ),
                        root=opts.root,
                        heartbeat_s=opts.heartbeat_s,
                        traffic=opts.traffic,
                    )
                )
        dashboard: Dashboard | None = None
        if opts.ui is not None:
            dashboard = Dashboard(
                js,
                listen=opts.ui,
                root=opts.root,
                token=opts.ui_token,
                db_path=db_path,
                policy=opts.policy,
                allow_hosts=opts.ui_hosts,
            )
            try:
                ui_sock = dashboard.bind()
            except DashboardError as e:
                raise UpError(str(e)) from e
        running = Running(url, broker, scheduler, preempt, projector, agents, db_path)
        tasks: dict[asyncio.Task[Any], str] = {
            asyncio.create_task(scheduler.run(stop), name="scheduler"): "scheduler",
            asyncio.create_task(preempt.run(stop), name="preemption"): "preemption service",
            # Agents make no consumers of their own: they ask for them (agent.consumers).
            asyncio.create_task(
                agent_consumers.serve(nc, js, opts.root, stop), name="agent consumers"
            ): "agent consumers",
        }
        if projector is not None:
            tasks[asyncio.create_task(projector.run(stop), name="projector")] = "projector"
        if broker is not None:
            tasks[asyncio.create_task(_watch_broker(broker, stop), name="broker")] = "broker"
        for a in agents:
            tasks[asyncio.create_task(a.run(stop), name=f"agent {a.node}")] = f"agent {a.node}"
        if dashboard is not None:
            tasks[asyncio.create_task(dashboard.run(stop, ui_sock), name="dashboard")] = "dashboard"
            shown = dashboard.url + (f"?token={opts.ui_token}" if opts.ui_token else "")
            running.dashboard_url = shown
            (opts.data / URL_FILE).write_text(shown + "\n")
            log.info("dashboard: %s", shown)
        log.info(
            "up: scheduler, preemption service%s running on %s (root %r)%s",
            f", projector ({db_path})" if projector is not None else "",
            public_url(url),
            opts.root,
            f"; {len(agents)} simulated nodes: {_names(agents)}" if agents else "",
        )
        if on_ready is not None:
            on_ready(running)
        return await _supervise(tasks, stop)
    finally:
        with contextlib.suppress(OSError):
            (opts.data / URL_FILE).unlink()
        for conn in (agents_nc, nc):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()


def _names(agents: list[Agent]) -> str:
    names = [a.node for a in agents]
    return ", ".join(names) if len(names) <= 6 else f"{names[0]} … {names[-1]}"


async def _supervise(tasks: dict[asyncio.Task[Any], str], stop: asyncio.Event) -> int:
    """Wait for the stop event or the first service to end; then stop the rest."""
    stopper = asyncio.create_task(stop.wait(), name="stop")
    code = 0
    try:
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t is stopper:
                continue
            if stop.is_set() and t.exception() is None:
                # It ended because it was asked to: the stop event woke it and the
                # stopper in the same turn of the loop.
                continue
            # A service ending before stop is a failure whatever it returned: the control
            # plane without it would look up and be wrong.
            exc = t.exception()
            if exc is None:
                why = "it ended"
            elif isinstance(exc, UpError):
                why = str(exc)
            else:
                why = f"{type(exc).__name__}: {exc}"
            log.error("up: %s stopped unexpectedly (%s); stopping everything", tasks[t], why)
            code = 1
        stop.set()
        log.info("up: stopping")
        _, pending = await asyncio.wait(tasks, timeout=15)
        for t in pending:
            log.warning("up: %s did not stop within 15s; cancelling it", tasks[t])
            t.cancel()
        for t in tasks:
            if not t.cancelled() and t.done() and t.exception() is not None and code == 0:
                log.error("up: %s failed while stopping: %s", tasks[t], t.exception())
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        stopper.cancel()
    return code
