"""`llmgw up`: the whole control plane in one process, on an embedded broker by default;
the gateway beside it in processes of its own (`services.gateway.processes`).

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
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from nats.js.api import StreamInfo
from nats.js.client import JetStreamContext

from services import files, names
from services.agent import Agent, SimulatedRuntime, spec
from services.agent import consumers as agent_consumers
from services.agent.responder import Errors, Timing
from services.bus import EmbeddedBroker, connect, ensure_streams, snapshots, tracing
from services.bus import broker as bus_broker
from services.bus import node_streams as bus_node_streams
from services.bus import stream as bus_stream
from services.bus.connection import BusClient
from services.bus.errors import BrokerError
from services.bus.urls import public_url, users
from services.core import scheduling
from services.core.policy import Config as PolicyConfig
from services.dashboard.server import Dashboard, DashboardError
from services.gateway.config import Config as GatewayConfig
from services.gateway.errors import GatewayError
from services.gateway.processes import Gateways, Reservation
from services.plane import heap, lease
from services.preemption.config import Config as PreemptionConfig
from services.preemption.service import PreemptionService
from services.projector.service import Projector
from services.scheduler.service import Scheduler

log = logging.getLogger("llmgw.up")

DB_FILE = "view.sqlite"
# URL_FILE holds the dashboard's address while `up` serves it.
URL_FILE = "dashboard.url"
# GATEWAY_URL_FILE holds the gateway's base URL (http://HOST:PORT/v1) while `up` serves it.
GATEWAY_URL_FILE = "gateway.url"


class UpError(Exception):
    """Why the control plane could not come up; str() is the one line to show."""


@dataclass
class UpOptions:
    """What `llmgw up` runs, with the defaults of its flags."""

    data: Path
    nats_url: str | None = None
    """Join this broker instead of starting the embedded one."""
    port: int | None = None
    """The embedded broker's port; None: `default_port` when it is free, else a free one.
    Either way, when the last `up` on `data` was killed, the port it recorded comes
    first (`broker_port`)."""
    default_port: int | None = None
    """The port `port` None tries before a free one (`llmgw up`: 4222); moving off it is
    said in one line."""
    root: str = "llmgw"
    simulate: str | None = None
    """A simulated cluster, e.g. `4x8xH100-80GB`; None: no simulated agents."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    scheduler: scheduling.Config = field(default_factory=scheduling.Config)
    """The scheduler's knobs; its drain grace is the preemption service's too."""
    start_delay_s: float = 0.5
    load_delay_s: float = 2.0
    stop_delay_s: float = 0.5
    heartbeat_s: float = 1.0
    sim_ttft_s: float = 0.05
    sim_tps: float = 100.0
    sim_prefill_tps: float = 0.0
    sim_cache_tokens: int = 0
    sim_server_drains: bool = True
    """Whether a simulated server lets its requests finish on a drain (`--sim-no-drain`)."""
    """The simulated servers' pace (each ready simulated replica answers requests)."""
    sim_errors: dict[str, Errors] = field(default_factory=dict)
    """The simulated servers' errors by model ("": every model not named), --sim-errors."""
    sim_seed: int = 0
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
    gateway: GatewayConfig | None = None
    """The gateway's settings (`--gateway-listen` its address); None: no gateway."""
    gateways: int = 1
    """Gateway processes on the gateway's one port (`--gateways`), each of its own,
    restarted when it ends (`services.gateway.processes`)."""
    wire_reader: bool = True
    """Read the log with the bus's own wire reader (`--no-wire-reader`: nats-py's)."""
    settle_heap: bool = False
    """Freeze what the process has held for a while out of the collector's reach
    (`services.plane.heap`); `llmgw up` sets it, an in-process caller such as a test does not."""
    gateway_keys: Any = None
    """The gateway's API keys (a `services.gateway.keys.Keys`); None: none asked."""
    gateway_any_port: bool = False
    """Take a free port when `gateway`'s is taken (the default address: another `up` may
    serve there); the move is said in one line naming both addresses."""
    ui_any_port: bool = False
    """The same for the dashboard's `ui`."""


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
    gateway_url: str | None = None
    """http://HOST:PORT/v1 of the gateway, when it runs."""
    gateways: Gateways | None = None
    """The gateway processes, when they run."""


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


# RECORDED_PORT_WAIT_S bounds how long `up` waits for the port the last `up` on its data
# directory recorded (`nats.url`), when that one was killed, to be free again once its
# orphan broker is stopped. The killed plane's clients (an `events tail`, a gateway or a
# dashboard started by hand, anything given its `--nats` URL) retry that address, and
# find the new broker there. Past it the broker moves, and says so in one line.
RECORDED_PORT_WAIT_S = 10.0


@dataclass(frozen=True)
class _Choice:
    """The embedded broker's port as `broker_port` chose it: `port` (None: a free one),
    the one it `wanted` (None: none in particular) and, when it moved off that one, why."""

    port: int | None
    wanted: int | None = None
    why: str = ""


def recorded_port(data: Path) -> int | None:
    """The port in the broker URL recorded in `data`, or None. Read while holding the
    directory's lock, it is the port of an `up` that was killed (a clean stop removes it)."""
    url = bus_broker.read_url(data)
    if url is None:
        return None
    try:
        return urlsplit(url.split(",")[0]).port
    except ValueError:
        return None


def _bindable(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (SO_REUSEADDR, as nats-server and
    our own listeners set it: a closed connection's TIME_WAIT does not hold the port)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def broker_port(opts: UpOptions, host: str = "127.0.0.1") -> _Choice:
    """Where the embedded broker listens: `--port` as given; else the port the last `up`
    on the data directory recorded when it was killed, once free (waiting up to
    RECORDED_PORT_WAIT_S); else `default_port` when free; else a free one."""
    if opts.port is not None:
        return _Choice(opts.port)
    why = ""
    wanted = recorded_port(opts.data)
    if wanted is not None:
        deadline = time.monotonic() + RECORDED_PORT_WAIT_S
        while not _bindable(host, wanted):
            if time.monotonic() >= deadline:
                why = (
                    f"port {wanted} of the `up` that was killed is still taken after "
                    f"{RECORDED_PORT_WAIT_S:g}s"
                )
                break
            time.sleep(0.1)
        else:
            return _Choice(wanted, wanted)
    if opts.default_port is not None and opts.default_port != wanted:
        if _bindable(host, opts.default_port):
            return _Choice(opts.default_port, wanted, why)
        if wanted is None:
            wanted, why = opts.default_port, f"port {opts.default_port} is taken"
    return _Choice(None, wanted, why)


def _fallbacks(listen: str, recorded: Path) -> list[str]:
    """Where a listener whose default address `listen` is taken tries next: the address
    a killed `up` recorded in `recorded` (same host), so its clients find it again; then
    a free port."""
    host = listen.rpartition(":")[0]
    out = []
    with contextlib.suppress(OSError, ValueError):
        u = urlsplit(recorded.read_text().strip())
        if u.hostname == host.strip("[]") and u.port:
            out.append(f"{host}:{u.port}")
    return [*out, f"{host}:0"]


def _bind(
    what: str, server: Any, any_port: bool, recorded: Path, error: type[Exception]
) -> socket.socket:
    """`server` (the dashboard, the gateway) bound at its address; where that is taken
    and `any_port` (its address was the default), at the one a killed `up` recorded in
    `recorded`, else a free port, said in one line; else `UpError`."""
    first = server.listen
    try:
        sock: socket.socket = server.bind()
        return sock
    except error as e:
        if not any_port:
            raise UpError(str(e)) from e
    for listen in _fallbacks(first, recorded):
        server.listen = listen
        try:
            sock = server.bind()
        except error as e:
            if listen.endswith(":0"):
                raise UpError(str(e)) from e
            continue
        _say_moved(what, first, server.url.rstrip("/"), recorded)
        return sock
    raise AssertionError("the last of the fallbacks is a free port")


def _say_moved(what: str, old: str, new: str, recorded: Path, why: str = "") -> None:
    """One line for a listener that could not have its address: the old and the new."""
    old = old.removeprefix("nats://").removeprefix("http://")
    log.warning(
        "%s: moved from %s to %s (%s); the commands beside it read it from %s",
        what,
        old,
        new,
        why or f"{old} is taken",
        recorded,
    )


# RESTART_GAP_S is the least time between two restarts of a broker that is alive but
# cannot store the leases: a store that stays broken is said, not restarted in a loop.
RESTART_GAP_S = 30.0
# MIN_FREE_BYTES is the free space the store's disk needs before such a restart: on a
# full disk a restart would only fail the same way; once space is back it is at once.
MIN_FREE_BYTES = 1 << 20
# STORAGE_SAY_S is how often one storage fault is said again while it lasts.
STORAGE_SAY_S = 30.0


@dataclass
class _BrokerWatch:
    """What `_watch_broker` keeps between looks: deaths, the faults said, the last restart."""

    deaths: list[float] = field(default_factory=list)
    said: dict[str, float] = field(default_factory=dict)
    restarted_at: float | None = None
    waiting_for_space: bool = False
    connected_since: float | None = None
    """Monotonic time the connection was last seen (re)made; None while it is down."""


async def _watch_broker(
    broker: EmbeddedBroker,
    stop: asyncio.Event,
    nc: Any = None,
    leases: tuple[lease.Lease, ...] = (),
) -> None:
    """Look after the embedded broker until `stop`:

    - restart it on the same port and store when it dies; raise `UpError` when it died
      BROKER_RESTARTS times within BROKER_RESTART_WINDOW_S;
    - say each storage error its log reports (a full disk, a quota, an I/O error) in one
      line with the cause and the store's path, again at most every STORAGE_SAY_S;
    - restart it when one of `leases` has failed to renew for longer than its TTL while
      `nc` is connected: a server whose store failed a write keeps that stream failing
      after the cause is gone (a disk filled, then freed), and the plane would stay
      without a leader. Not twice within RESTART_GAP_S, and not before the store's disk
      has MIN_FREE_BYTES free again.
    """
    w = _BrokerWatch()
    loop = asyncio.get_running_loop()
    broker.new_log_lines()  # from here on
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), BROKER_CHECK_S)
        if stop.is_set():
            continue
        now = loop.time()
        _say_storage_faults(broker, w, now)
        status = broker.exit_status
        if status is not None:
            await _restart_dead(broker, w, now, status)
            continue
        failing = _renewals_failing(leases, nc, w)
        if failing is None or (w.restarted_at is not None and now - w.restarted_at < RESTART_GAP_S):
            w.waiting_for_space = False
            continue
        free = _free_bytes(broker.store_dir)
        if free is not None and free < MIN_FREE_BYTES:
            if not w.waiting_for_space:
                w.waiting_for_space = True
                log.error(
                    "broker: %s; the store %s has %d bytes free: restarting nats-server "
                    "once it has space",
                    failing,
                    broker.store_dir,
                    free,
                )
            continue
        w.waiting_for_space = False
        w.restarted_at = now
        log.error("broker: %s; restarting nats-server on the same store", failing)
        w.connected_since = None
        await asyncio.to_thread(broker.stop)
        try:
            await asyncio.to_thread(broker.start)
        except BrokerError as e:
            raise UpError(f"could not restart nats-server: {e}") from e
        log.info("broker: restarted on %s", broker.address)


async def _restart_dead(broker: EmbeddedBroker, w: _BrokerWatch, now: float, status: int) -> None:
    w.deaths = [t for t in w.deaths if now - t < BROKER_RESTART_WINDOW_S] + [now]
    if len(w.deaths) > BROKER_RESTARTS:
        raise UpError(
            f"nats-server died {len(w.deaths)} times in {BROKER_RESTART_WINDOW_S:g}s "
            f"(last status {status}); see {broker.log_path}"
        )
    log.error(
        "broker: nats-server exited with status %s; restarting it on the same store",
        status,
    )
    w.connected_since = None
    try:
        await asyncio.to_thread(broker.start)
    except BrokerError as e:
        raise UpError(f"could not restart nats-server: {e}") from e
    log.info("broker: restarted on %s", broker.address)


def _say_storage_faults(broker: EmbeddedBroker, w: _BrokerWatch, now: float) -> None:
    for line in broker.new_log_lines():
        fault = bus_broker.storage_fault(line)
        if fault is None:
            continue
        # One line per cause: the server says it once per failed write, of every stream.
        if now - w.said.get(fault.cause, -STORAGE_SAY_S) < STORAGE_SAY_S:
            continue
        w.said[fault.cause] = now
        what = f" writing the stream {fault.stream}" if fault.stream else ""
        at = f" ({fault.path})" if fault.path else ""
        log.error(
            "broker: storage error in the store %s%s: %s%s; see %s",
            broker.store_dir,
            what,
            fault.cause,
            at,
            broker.log_path,
        )


def _renewals_failing(leases: tuple[lease.Lease, ...], nc: Any, w: _BrokerWatch) -> str | None:
    """Why the broker should be restarted: a lease whose renewals have failed for longer
    than its TTL while the connection is up (no leader can be elected through it). Only
    the time since the connection was last (re)made counts: a broker that was away is
    the connection's business, and renewals resume once it is back."""
    now = time.monotonic()
    if nc is None or not nc.is_connected:
        w.connected_since = None
        return None
    if w.connected_since is None:
        w.connected_since = now
    for x in leases:
        if x.failing_since is None:
            continue
        lasted = now - max(x.failing_since, w.connected_since)
        if lasted > x.ttl_s:
            return f"renewals of the lease {x.name} have failed for {lasted:.0f}s while connected"
    return None


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


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
        choice = await asyncio.to_thread(broker_port, opts)
        broker = EmbeddedBroker(opts.data, port=choice.port, auth=True)
        try:
            url = await asyncio.to_thread(broker.start)
        except BrokerError as e:
            # A port chosen here (not a --port) that was taken between the look and the
            # bind is moved off like one taken before.
            if opts.port is not None or "address already in use" not in e.why:
                raise
            choice = _Choice(None, choice.wanted or choice.port, choice.why or "it was taken")
            broker.port = None
            url = await asyncio.to_thread(broker.start)
        if choice.wanted is not None and broker.port != choice.wanted:
            _say_moved(
                "broker",
                f"{broker.host}:{choice.wanted}",
                broker.address,
                opts.data / bus_broker.URL_FILE,
                choice.why,
            )
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
    nc = await connect(url, "llmgw up", wire_reader=opts.wire_reader)
    # Agents get a connection of their own, as they would on their own hosts: the
    # control plane's consumers and the agents' commands do not queue behind each other.
    agents_nc = (
        await connect(url, "llmgw up agents", wire_reader=opts.wire_reader) if nodes else None
    )
    agents: list[Agent] = []
    try:
        js = nc.jetstream()
        # node_streams: where agents have credentials of their own (a broker joined as a
        # user someone made: deploy/nats), what each agent publishes goes to the log
        # through its own node's stream, whose limits contain a flood to that node
        # (services.bus.stream). An embedded broker (this one's, or another up's joined
        # with its URL) has one user, whose agents are up's own.
        node_streams = broker is None and bool(users(url) - {bus_broker.USER})
        info = await ensure_streams(
            js, opts.root, opts.duplicate_window_s, opts.replicas, node_streams
        )
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
        if agents_nc is not None:
            agents += _simulated(opts, nodes, agents_nc)
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
                nc=nc,
            )
            ui_sock = _bind(
                "dashboard", dashboard, opts.ui_any_port, opts.data / URL_FILE, DashboardError
            )
        gateway: Reservation | None = None
        if opts.gateway is not None:
            gateway = Reservation(opts.gateway.listen)
            gw_sock = _bind(
                "gateway",
                gateway,
                opts.gateway_any_port,
                opts.data / GATEWAY_URL_FILE,
                GatewayError,
            )
        running = Running(url, broker, scheduler, preempt, projector, agents, db_path)
        tasks = _plane_tasks(opts, nc, js, info, broker, running, stop)
        if dashboard is not None:
            tasks[asyncio.create_task(dashboard.run(stop, ui_sock), name="dashboard")] = "dashboard"
            shown = dashboard.url + (f"?token={opts.ui_token}" if opts.ui_token else "")
            running.dashboard_url = shown
            # Atomic: a reader that finds the file finds it whole (and the URL may
            # carry the dashboard's token: the owner's alone).
            files.write_private(opts.data / URL_FILE, shown + "\n")
            log.info("dashboard: %s", shown)
        if gateway is not None and opts.gateway is not None:
            # Processes of their own, never this one (services.gateway.processes); no replica's
            # endpoint may name the plane's own ports (services.gateway.plane).
            fleet = Gateways(
                opts.gateways,
                opts.gateway,
                url,
                opts.root,
                gateway.address(),
                plane=(url, *([dashboard.url] if dashboard is not None else [])),
            )
            try:
                await fleet.start(nc)
            except GatewayError as e:
                await fleet.stop()
                gw_sock.close()
                stop.set()
                await asyncio.wait(tasks, timeout=15)
                raise UpError(str(e)) from None
            running.gateways = fleet
            if dashboard is not None and fleet.traffic is not None:
                # The dashboard shows requests a second, in flight and held per model
                # from the gateways' announcements (services.dashboard.traffic).
                dashboard.gateway = fleet.traffic.counts
                dashboard.held = fleet.traffic.held
            tasks[asyncio.create_task(_gateways(fleet, gw_sock, stop), name="gateways")] = (
                "gateways"
            )
            running.gateway_url = f"{gateway.url}/v1"
            _record(opts.data / GATEWAY_URL_FILE, running.gateway_url)
            log.info(
                "gateway: %s (%s of their own, routing: %s)",
                running.gateway_url,
                names.plural(opts.gateways, "process", "processes"),
                opts.gateway.routing,
            )
        log.info(
            "up: scheduler, preemption service%s running on %s (root %r)%s",
            f", projector ({db_path})" if projector is not None else "",
            public_url(url),
            opts.root,
            f"; {len(agents)} simulated nodes: {_names(agents)}" if agents else "",
        )
        if agents:
            said = _say_unsimulated(scheduler, agents, stop)
            sim = asyncio.create_task(said, name="unsimulated")
            tasks[sim] = "unsimulated"
        if on_ready is not None:
            on_ready(running)
        return await _supervise(tasks, stop)
    finally:
        for f in (URL_FILE, GATEWAY_URL_FILE):
            with contextlib.suppress(OSError):
                (opts.data / f).unlink()
        for a in agents:
            if isinstance(a.runtime, SimulatedRuntime):
                await a.runtime.close()
        for conn in (agents_nc, nc):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()


def _record(path: Path, url: str) -> None:
    """`url` in `path` for the commands beside `up` (atomic, the owner's alone). A disk
    that cannot take it (full) is said in one line, not a stop of the plane: the
    address is in `up`'s own lines, and the storage fault is the broker's to report."""
    try:
        files.write_private(path, url + "\n")
    except OSError as e:
        log.warning("up: could not record %s in %s: %s", url, path, e.strerror or e)


async def _gateways(fleet: Gateways, sock: socket.socket, stop: asyncio.Event) -> None:
    """The gateway processes watched until `stop`, their port held meanwhile."""
    try:
        await fleet.run(stop)
    finally:
        sock.close()


def _simulated(opts: UpOptions, nodes: list[spec.NodeSpec], nc: BusClient) -> list[Agent]:
    """The agents of the simulated `nodes`, on their connection `nc`."""
    js = nc.jetstream()
    return [
        Agent(
            nc,
            js,
            node=n.name,
            gpus=spec.gpu_inventory(n.name, n.gpus),
            cpu_cores=n.cpu_cores,
            memory_gb=n.memory_gb,
            runtime=SimulatedRuntime(
                opts.start_delay_s,
                opts.load_delay_s,
                opts.stop_delay_s,
                serve=Timing(
                    opts.sim_ttft_s,
                    opts.sim_tps,
                    errors=opts.sim_errors,
                    seed=opts.sim_seed,
                    prefill_tps=opts.sim_prefill_tps,
                    cache_tokens=opts.sim_cache_tokens,
                ),
                server_drains=opts.sim_server_drains,
            ),
            root=opts.root,
            heartbeat_s=opts.heartbeat_s,
            traffic=opts.traffic,
        )
        for n in nodes
    ]


def _plane_tasks(
    opts: UpOptions,
    nc: BusClient,
    js: JetStreamContext,
    info: StreamInfo,
    broker: EmbeddedBroker | None,
    running: Running,
    stop: asyncio.Event,
) -> dict[asyncio.Task[Any], str]:
    """The plane's services and its simulated agents started, each task with its name
    for the log: what `_supervise` watches (the dashboard and the gateway join later)."""
    scheduler, preempt, projector = running.scheduler, running.preemption, running.projector
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
    if opts.settle_heap:
        tasks[asyncio.create_task(heap.keep(stop), name="heap")] = "heap"
    if bus_stream.fed_by_nodes(info, opts.root):
        watch_nodes = bus_node_streams.watch(js, opts.root, stop)
        tasks[asyncio.create_task(watch_nodes, name="node streams")] = "node streams"
    if broker is not None:
        watch = _watch_broker(broker, stop, nc, (scheduler.lease, preempt.lease))
        tasks[asyncio.create_task(watch, name="broker")] = "broker"
    for a in running.agents:
        tasks[asyncio.create_task(a.serve(stop), name=f"agent {a.node}")] = f"agent {a.node}"
    return tasks


# CAUGHT_UP_S bounds the wait for the scheduler's view to reach the log's end before
# `up` compares the nodes it has with those it simulates.
CAUGHT_UP_S = 30.0


async def _say_unsimulated(scheduler: Scheduler, agents: list[Agent], stop: asyncio.Event) -> None:
    """One line, once the scheduler's view has caught up with the log, naming the nodes
    the data directory's log has and this run does not simulate (a tour run on the data
    of a bigger cluster): they will be reported lost, and stay so until removed."""
    with contextlib.suppress(TimeoutError):
        await scheduler.follower.caught_up(CAUGHT_UP_S)
    simulated = {a.node for a in agents}
    others = sorted(n for n in scheduler.view.state.nodes if n not in simulated)
    if others:
        shown = ", ".join(others) if len(others) <= 6 else f"{', '.join(others[:6])} …"
        log.warning(
            "up: the log of %s has %s this run does not simulate (%s): they will be "
            "reported lost; `llmgw delete node NAME` removes one",
            "this data directory",
            names.plural(len(others), "node"),
            shown,
        )
    await stop.wait()


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
