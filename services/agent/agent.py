"""The agent of one GPU node: announces the node, carries out its commands, reports replicas.

Run by `llmgw agent` (one node per process) and by `llmgw up --simulate` (many simulated
nodes in one process), each as `await Agent(...).run(stop)`. It publishes the node's
`node.inventory` at start, and again with its replicas' states after every reconnect to
the broker (a node reported lost meanwhile is back by it); heartbeats on core NATS
(`<root>.heartbeat.<node>`, never the stream); consumes `<root>.cmd.<node>.>` through a durable consumer, so commands sent
while it is down wait for it; and turns what its `Runtime` reports into `replica.state`
events on `<root>.node.<node>.replica.<replica>`. It decides nothing about the cluster:
it does what the commands say, on its own node only, and says what happened.

One agent per node: at start it asks on `<root>.heartbeat.<node>.agent` whether the node
has a live agent already, and is refused (`NodeTaken`) if one answers, unless it takes
over (`takeover`), when the other stops. It answers that question itself while it runs.

Once only, across crashes: every state event's id is derived from the command that
caused it and the state (`ids.derived(cmd.id, "state:ready")`), so a redelivered command
inside JetStream's duplicate window publishes nothing new. Past the window the agent
still knows: at start it rebuilds its replicas from its own events in the log, so a
redelivered `replica.start` for a replica it already runs, or a `replica.drain` for one
already stopped, is acked with no effect; and replicas a crash left mid-way (starting,
loading, draining) are driven on to ready or stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import events as ev
from schemas import ids, names, subjects
from schemas.events import DRAIN_GRACE_S
from services.agent import consumers, gateways
from services.agent.consumers import ACK_WAIT_S as ACK_WAIT_S
from services.agent.consumers import durable_name as durable_name
from services.agent.consumers import reader_name as reader_name
from services.agent.errors import NodeTaken, NoStream
from services.agent.runtime import Report, Runtime
from services.bus import BusError, Permanent, Publisher, PublishError, Unanswered, replies
from services.bus import consume as bus_consume
from services.bus.fleet import Fleet
from services.bus.publish import OTHER, new_seal
from services.clock import new_id, utc_now
from services.core import ingest

log = logging.getLogger("llmgw.agent")

_ORDER = ev.STATE_ORDER
_HOLDING = ev.HOLDING_STATES

# MID_FLIGHT are the states a crash can leave a replica in with work still to do: the
# agent drives them on at start rather than leaving them to the scheduler's timeouts.
_STARTING = frozenset({"pending", "starting", "loading"})

# USED_INTERVAL_S is how often at most one replica's use is reported. `replica.used` is
# a fact the preemption policy reads (idle longest first), not a request log: a minute's
# resolution ranks idle replicas just as well and keeps the log small.
USED_INTERVAL_S = 30.0

# HELLO_WAIT_S bounds the wait for the control plane's answer about the agent's
# consumers (it makes two consumers: milliseconds); CONSUMERS_WAIT_S is the pause before
# asking again while nobody can make them.
HELLO_WAIT_S = 5.0
CONSUMERS_WAIT_S = 1.0
# MAKE_AGAIN_S is how long after a refused attempt to make them itself the agent only asks.
MAKE_AGAIN_S = 60.0
# REBUILD_AGAIN_S: the first pause before reading its history again when the broker did
# not answer in time (a cluster's server stopping under it, or one too busy), doubled
# up to REBUILD_AGAIN_MAX_S: an agent waits for its broker, it does not end.
REBUILD_AGAIN_S = 0.5
REBUILD_AGAIN_MAX_S = 10.0

# CONTROL_INBOX is where the replies to the control role's requests go (nats-py's default
# inbox prefix, which only the control and viewer roles may subscribe to). A request to
# the agent whose reply does not go there was not sent by an operator: the server's own
# deliveries carry `$JS.ACK.` or no reply, and every agent has an inbox of its own.
CONTROL_INBOX = "_INBOX."

# REPUBLISH_WAIT_S is the pause before a background state report is published again
# after the broker refused or did not answer. The ids make a second copy harmless.
REPUBLISH_WAIT_S = 0.5

# WHO_TIMEOUT_S bounds the wait for an answer to "has this node a live agent?". With no
# agent there the broker says at once that nobody listens; the wait is only for a broker
# that does not say (a user without the permission to ask).
WHO_TIMEOUT_S = 0.5

# LOST_PAST_GRACE is why a replica the log failed with its node (lost past the grace,
# while the agent was cut off) is stopped when the agent is back.
LOST_PAST_GRACE = "failed with its node, lost past the grace while the agent was cut off"

# TAKEOVER_WAIT_S bounds how long an agent taking over waits for the other to stop
# answering before it goes on regardless.
TAKEOVER_WAIT_S = 10.0

_json = msgspec.json.Encoder()


class _Who(msgspec.Struct):
    """An agent's answer to who it is, and its question (`takeover`: stop, I replace you)."""

    agent: str = "?"
    pid: int = 0
    host: str = "?"
    since: str = "?"
    takeover: bool = False


_who = msgspec.json.Decoder(_Who)


def _who_of(data: bytes) -> _Who:
    """What an agent says of itself; one that says nothing readable is nobody known."""
    try:
        return _who.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Who()


def ctl_subject(node: str, root: str = subjects.DEFAULT_ROOT) -> str:
    """Where an operator asks the agent of `node` to act now (core NATS, request/reply):
    `<root>.ctl.<node>.gpu.reset-health`. What the agent does is said in the log."""
    return f"{root}.ctl.{names.escape(node)}.gpu.reset-health"


# HealthWatch blocks, calling back (GPU index, why) for each GPU gone bad, until its
# event is set (`gpus.Nvml.watch`). It runs in a thread of its own.
HealthWatch = Callable[[threading.Event, Callable[[int, str], None]], None]

# FOUND_UNHEALTHY is why a GPU discovery found unhealthy is kept so: NVML counted
# uncorrected ECC errors on it before the agent started (`gpus.Nvml.gpus`).
FOUND_UNHEALTHY = "uncorrected ECC errors found at start"

# UNHEALTHY_REMIND_S is how often the agent says again, in its log, which GPUs it keeps
# unhealthy and how to bring them back: a GPU is never out quietly.
UNHEALTHY_REMIND_S = 600.0


def inbox_prefix(node: str) -> str:
    """The agent's inbox prefix: its replies arrive under it, and nobody else's do."""
    return subjects.agent_inbox(node)


@dataclass(eq=False)
class _Replica:
    """What the agent knows of one of its replicas: the last state it said, and the
    command whose effect that state is (the start, then the drain). Ids of the next
    states derive from `command`, so anyone driving the replica on publishes the same
    events the agent before the crash would have."""

    replica: str
    model: str
    profile: str
    shards: tuple[ev.ShardSpec, ...]
    state: str
    command: str
    correlation: str | None
    since: datetime
    grace_s: float = DRAIN_GRACE_S
    drain_seq: int = 0
    """The stream seq of its drain (0: not known): a gateway whose view is behind it may
    still route requests here."""
    endpoint: str | None = None
    """The endpoint its latest `replica.state` in the log named."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    task: asyncio.Task[None] | None = None


class Agent:
    """The agent of node `node`, with `gpus`, `cpu_cores` and `memory_gb` to offer, whose
    replicas run on `runtime`. `traffic` (model -> requests per minute) makes the agent
    report synthetic use of its ready replicas of those models.

    `on_stored` is called with every state event once the stream has it and before the
    command that caused it is acked: a fault-injection point for crash tests (exit the
    process there), not a place for logic.
    """

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        *,
        node: str,
        gpus: Sequence[ev.GpuInfo],
        cpu_cores: float,
        memory_gb: float,
        runtime: Runtime,
        root: str = subjects.DEFAULT_ROOT,
        heartbeat_s: float = 1.0,
        labels: Mapping[str, str] | None = None,
        traffic: Mapping[str, float] | None = None,
        used_interval_s: float = USED_INTERVAL_S,
        rng: random.Random | None = None,
        ack_wait_s: float = ACK_WAIT_S,
        on_stored: Callable[[ev.ReplicaStateEvent], None] | None = None,
        health: HealthWatch | None = None,
        health_file: Path | None = None,
        takeover: bool = False,
        gateway_wait: bool = True,
        address: str | None = None,
    ) -> None:
        names.escape(node)  # a node name no subject can carry fails here, not mid-run
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be more than 0, got {heartbeat_s}")
        self.nc = nc
        self.js = js
        self.node = node
        self.inventory = ev.NodeInventory(
            node=node,
            gpus=tuple(gpus),
            cpu_cores=cpu_cores,
            memory_gb=memory_gb,
            labels=dict(labels or {}),
            # Where its servers answer: every endpoint it reports must be there (the
            # fold rejects others). None: the runtime's own (`--advertise` for servers).
            address=address if address is not None else str(getattr(runtime, "address", "")),
        )
        self.runtime = runtime
        self.root = root
        self.heartbeat_s = heartbeat_s
        self.traffic = {m: float(r) for m, r in (traffic or {}).items() if r > 0}
        self.used_interval_s = used_interval_s
        self.ack_wait_s = ack_wait_s
        self._on_stored = on_stored
        # gateway_wait: a drain waits, up to its grace, for the gateways to have nothing
        # in flight on the replica before its server is stopped (services.agent.gateways).
        # Off, the server is stopped at once and only its own metrics are waited for.
        self.gateway_wait = gateway_wait
        # _gateways_seen: whether the last drain found a gateway answering, so that a
        # plane without one is said once, not at every drain.
        self._gateways_seen: bool | None = None
        # _fleet: the gateways' announcements, while it runs (a drain does not wait for a
        # gateway gone from them: services.agent.gateways).
        self._fleet: Fleet | None = None
        self._health = health
        self._health_file = health_file
        # _unhealthy: GPU index -> why; kept in `health_file` so a restart remembers it.
        # A GPU found unhealthy at discovery (uncorrected ECC errors already counted) is
        # one of them: the inventory is rebuilt from this, so it is never published
        # healthy, and `llmgw gpu reset-health` clears it like any other.
        self._unhealthy: dict[int, str] = _load_health(health_file)
        found_bad = {
            g.index: FOUND_UNHEALTHY
            for g in self.inventory.gpus
            if not g.healthy and g.index not in self._unhealthy
        }
        if found_bad:
            self._unhealthy.update(found_bad)
            _save_health(health_file, self._unhealthy)
            for index in sorted(found_bad):
                log.warning(
                    "%s: GPU %d unhealthy: %s; the scheduler avoids it until "
                    "`llmgw gpu reset-health %s %d`",
                    node,
                    index,
                    FOUND_UNHEALTHY,
                    node,
                    index,
                )
        self._apply_health()
        self.source = f"agent/{node}"
        self.durable = durable_name(node)
        self.reader = reader_name(node)
        self._rng = rng or random.Random()
        self._publisher = Publisher(js, root, stored_at=self._stored_at)
        self._reading = asyncio.Lock()
        # _make_after: when to try again making its own consumers if no plane answers.
        self._make_after = -math.inf
        self._replicas: dict[str, _Replica] = {}
        self._halt = asyncio.Event()
        # _last_used: replica -> (when it last served, monotonic time it was reported).
        self._last_used: dict[str, tuple[datetime | None, float]] = {}
        # _reported_real: replica -> the runtime's served time last reported.
        self._reported_real: dict[str, datetime] = {}
        # _reported_at: replica -> the time of use last reported; _reported_load: the
        # engine load it carried.
        self._reported_at: dict[str, datetime] = {}
        self._reported_load: dict[str, ev.EngineLoad] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # instance: this process's own name among the node's agents, in heartbeats and in
        # its answer to who it is; a restart on the same host and pid is another boot.
        self.takeover = takeover
        self.instance = _Who(agent=new_id(), pid=os.getpid(), host=socket.gethostname(), since="")
        self.taken_over_by: str | None = None
        self._taken = asyncio.Event()
        # The requests it leaves unanswered (services.bus.replies): operators' requests
        # no operator sent, and who-am-I questions whose reply is not this node's inbox.
        self._ctl_guard = replies.ReplyGuard(f"{node}: ctl request refused")
        self._who_guard = replies.ReplyGuard(f"{node}: who-am-I answers")

    # ------------------------------------------------------------------ life

    def replicas(self) -> dict[str, str]:
        """Replica -> the last state this agent knows it published (or found in the log)."""
        return {r.replica: r.state for r in self._replicas.values()}

    async def run(self, stop: asyncio.Event) -> None:
        """Announce the node, then carry out commands until `stop` is set.

        Raises `NoStream` when the broker has no event stream, and whatever stopped one of
        its loops (the consumer, the heartbeat) for good. On the way out it stops
        consuming and cancels replica transitions in flight, which the next run drives on
        from the log; it drains nothing and leaves the connection open for its owner.
        """
        self._halt = asyncio.Event()
        self._taken = asyncio.Event()
        await self._claim()
        self.instance = msgspec.structs.replace(self.instance, since=utc_now().isoformat())
        if not await self._consumers(stop):
            return
        if not await self._rebuilt(stop):
            return
        await self.runtime.adopt(
            {
                r.replica: ev.ReplicaState(
                    replica=r.replica,
                    model=r.model,
                    profile=r.profile,
                    state=r.state,  # type: ignore[arg-type]
                    shards=r.shards,
                    endpoint=r.endpoint,
                )
                for r in self._replicas.values()
                if r.state in _HOLDING
            }
        )
        await self._publish(
            ev.make(
                self.inventory,
                id=new_id(),
                time=utc_now(),
                source=self.source,
            )
        )
        log.info(
            "%s: up: %d GPUs (%s), %g cores, %g GB; %d replicas from the log",
            self.node,
            len(self.inventory.gpus),
            ", ".join(sorted({g.model for g in self.inventory.gpus})) or "none",
            self.inventory.cpu_cores,
            self.inventory.memory_gb,
            sum(1 for r in self._replicas.values() if r.state in _HOLDING),
        )
        for rec in self._replicas.values():
            self._redrive(rec)
        if self.gateway_wait:
            fleet = Fleet(self.nc, self.root, rollcall=False)
            try:
                await fleet.start()
                self._fleet = fleet
            except nats.errors.Error as e:
                log.warning("%s: the gateways' announcements not heard: %s", self.node, e)
        loops = [
            asyncio.create_task(self._consume(), name=f"{self.durable} commands"),
            asyncio.create_task(self._heartbeats(), name=f"{self.durable} heartbeat"),
        ]
        if self.traffic or self.runtime.needs_model_runtime:
            loops.append(asyncio.create_task(self._report_use(), name=f"{self.durable} use"))
        loops.append(asyncio.create_task(self._serve_ctl(), name=f"{self.durable} ctl"))
        loops.append(asyncio.create_task(self._serve_who(), name=f"{self.durable} who"))
        watch_stop = threading.Event()
        watcher = None
        if self._health is not None:
            loop = asyncio.get_running_loop()
            health = self._health

            def on_unhealthy(index: int, why: str) -> None:
                loop.call_soon_threadsafe(self._gpu_went_bad, index, why)

            watcher = asyncio.create_task(asyncio.to_thread(health, watch_stop, on_unhealthy))
        waiter = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([*loops, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._halt.set()
            watch_stop.set()
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher
            waiter.cancel()
            tasks = [r.task for r in self._replicas.values() if r.task is not None]
            tasks += list(self._tasks)
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*loops, *tasks, return_exceptions=True)
            if self._fleet is not None:
                await self._fleet.stop()
                self._fleet = None
        for r in results[: len(loops)]:
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                raise r
        log.info("%s: stopped", self.node)

    async def serve(self, stop: asyncio.Event) -> None:
        """`run`, for an agent among a plane's services (`llmgw up --simulate`): taken
        over by another agent of its node, it has stopped as asked, which is no failure
        of the plane; it waits for `stop` like the services that still run."""
        await self.run(stop)
        if self.taken_over_by is not None:
            await stop.wait()

    async def _claim(self) -> None:
        """Make sure no other agent of this node is alive: one that answers on the node's
        agent subject refuses this one (`NodeTaken`), or, taking over, is asked to stop
        and waited for (at most TAKEOVER_WAIT_S)."""
        subject = subjects.agent_subject(self.node, self.root)
        ask = _json.encode(msgspec.structs.replace(self.instance, takeover=self.takeover))
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        told = False
        while True:
            try:
                msg = await replies.ask(self.nc, self.node, subject, ask, WHO_TIMEOUT_S)
            except nats.errors.NoRespondersError:
                return
            except nats.errors.TimeoutError:
                return  # nobody says (an agent from before this question): as before
            other = _who_of(msg.data)
            if other.agent == self.instance.agent:
                return
            said = f"pid {other.pid} on {other.host}, up since {other.since}"
            if not self.takeover:
                raise NodeTaken(self.node, said)
            if not told:
                log.warning("%s: taking over from its agent %s", self.node, said)
                told = True
            if time.monotonic() > deadline:
                log.warning(
                    "%s: the agent %s still answers after %gs; going on",
                    self.node,
                    said,
                    TAKEOVER_WAIT_S,
                )
                return
            await asyncio.sleep(0.1)

    async def _serve_who(self) -> None:
        """Answer who this agent is on the node's agent subject; stop when another asks
        to take over (the agent's run then ends)."""

        async def on_request(msg: Any) -> None:
            # Asked by another agent of this node: its reply under this node's inbox,
            # the only one it has (services.bus.replies); else nobody's to answer.
            if not self._who_guard.allows(self.node, msg.subject, msg.reply):
                return
            asker = _who_of(msg.data)
            if asker.agent == self.instance.agent:
                return
            await msg.respond(_json.encode(self.instance))
            if asker.takeover and not self._taken.is_set():
                self.taken_over_by = f"pid {asker.pid} on {asker.host}"
                log.warning(
                    "%s: taken over by the agent %s: stopping", self.node, self.taken_over_by
                )
                self._taken.set()
                self._halt.set()  # every loop ends, and with them the run

        sub = await self.nc.subscribe(subjects.agent_subject(self.node, self.root), cb=on_request)
        try:
            await self._halt.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _reconnect_count(self) -> int:
        stats = getattr(self.nc, "stats", None)
        return stats.get("reconnects", 0) if isinstance(stats, dict) else 0

    async def _announce_again(self) -> None:
        """After a reconnect: the node's whole inventory, and each replica holding GPUs in
        the state it is in, once more. What the broker missed meanwhile is said; a node
        reported lost is back. Each state keeps its id (from its command and state), so
        a copy the log already holds within the duplicate window is dropped. Replicas
        the cluster failed meanwhile are stopped first (`_stop_failed_with_the_node`)."""
        try:
            await self._publish_inventory()
        except (PublishError, BusError, nats.errors.Error, TimeoutError) as err:
            # Its heartbeat still brings a lost node back (`node.found`); the inventory
            # is said again at the next reconnect or change.
            log.warning("%s: inventory not said again after the reconnect: %s", self.node, err)
        stopping: set[str] = set()
        try:
            stopping = await self._stop_failed_with_the_node()
        except (BusError, nats.errors.Error, TimeoutError) as err:
            log.warning("%s: its log not read after the reconnect: %s", self.node, err)
        for rec in list(self._replicas.values()):
            if rec.state not in _HOLDING or rec.replica in stopping:
                continue
            async with rec.lock:
                e = self._state_event(rec, rec.state, utc_now())  # type: ignore[arg-type]
                try:
                    await self._publish(e)
                except PublishError as err:
                    log.warning(
                        "%s: %s %s not said again: %s", self.node, rec.replica, rec.state, err
                    )

    async def _consumers(self, stop: asyncio.Event) -> bool:
        """Wait until the agent's two consumers exist (False: `stop` was set first).

        The agent creates neither the stream nor, where its permissions are the shipped
        ones, a consumer: the control plane makes them (`consumers.serve`) when asked on
        the hello subject. Where nobody answers, the agent makes them itself, which a
        broker without permissions allows; where neither works it says so once, and asks
        again every CONSUMERS_WAIT_S. Raises `NoStream` when the broker has no stream."""
        said = False
        while not stop.is_set():
            why = await self._ask_for_consumers()
            if why is None:
                if said:
                    log.info("%s: its consumers are there now", self.node)
                return True
            if not said:
                log.warning(
                    "%s: waiting for its consumers %s and %s: %s",
                    self.node,
                    self.durable,
                    self.reader,
                    why,
                )
                said = True
            await _pause(stop, CONSUMERS_WAIT_S)
        return False

    async def _ask_for_consumers(self) -> str | None:
        """None once both consumers exist, else why they do not."""
        try:
            msg = await replies.ask(
                self.nc,
                self.node,
                consumers.hello_subject(self.node, self.root),
                _json.encode({"ack_wait_s": self.ack_wait_s}),
                HELLO_WAIT_S,
            )
            answer = msgspec.json.decode(msg.data)
            if isinstance(answer, dict) and answer.get("ok") is True:
                self._sealed(answer.get("stream"))
                return None
            why = f"the control plane said: {answer.get('error') if isinstance(answer, dict) else answer}"
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, msgspec.DecodeError):
            why = "no control plane answered"
        except nats.errors.Error as e:
            why = f"asking the control plane failed: {e}"
        # Nobody made them: made here, on a broker that lets this user. A user that may
        # not (the shipped permissions) is refused, and then only asks for a while.
        if time.monotonic() < self._make_after:
            return why
        try:
            self._sealed(await consumers.provide(self.js, self.node, self.root, self.ack_wait_s))
        except NotFoundError as e:
            url = self.nc.connected_url.geturl() if self.nc.connected_url else None
            raise NoStream(subjects.STREAM, url) from e
        except (nats.errors.Error, TimeoutError) as e:
            self._make_after = time.monotonic() + MAKE_AGAIN_S
            return f"{why}, and this user may not make them ({e or type(e).__name__})"
        return None

    def _sealed(self, node_stream: object) -> None:
        """Seal this agent's message ids where its reports go through its node's stream
        (`Publisher.seal`): there no duplicate ack tells it that another node took an id."""
        if isinstance(node_stream, str) and node_stream and self._publisher.seal is None:
            self._publisher.seal = new_seal()
            log.info("%s: its reports go to the log through stream %s", self.node, node_stream)

    async def _stored_at(self, stream: str, seq: int) -> str | None:
        """The subject of the message at `seq`, for a duplicate ack (`Publisher`): read
        through the agent's reader, which sees its own node's subjects only; a message
        it does not see there is on another's (`OTHER`)."""
        if stream != subjects.STREAM:
            return None
        async with self._reading:
            reader = bus_consume.read_pulled(self.js, self.reader, seq, batch_max=1)
            async with contextlib.aclosing(reader) as batches:
                async for batch in batches:
                    return batch[0].subject if batch[0].seq == seq else OTHER
        return OTHER

    async def _read(self, only: str) -> AsyncIterator[list[bus_consume.Delivery]]:
        """The agent's own history from the first sequence, the subjects `only` matches,
        through its reader (one read at a time: `_reading`)."""
        async with self._reading:
            async for batch in bus_consume.read_pulled(self.js, self.reader, 1, only=only):
                yield batch

    # ------------------------------------------------------------------ the log

    async def _rebuilt(self, stop: asyncio.Event) -> bool:
        """`_rebuild`, read again while the broker does not answer in time (False:
        `stop` was set first); said once, and once more when it is read. A refusal
        (`BusError` otherwise) is not waited out: it is raised."""
        pause, said = REBUILD_AGAIN_S, False
        while not stop.is_set():
            try:
                await self._rebuild()
            except Unanswered as e:
                if not said:
                    log.warning(
                        "%s: its history in the log not read yet (%s); reading it again",
                        self.node,
                        e,
                    )
                    said = True
                await _pause(stop, pause)
                pause = min(pause * 2, REBUILD_AGAIN_MAX_S)
                continue
            if said:
                log.info("%s: its history in the log read", self.node)
            return True
        return False

    async def _rebuild(self) -> None:
        """The node's replicas as its own events in the log say they are. Each message is
        decoded and checked by `ingest.decode_checked`, as the projector does: what the
        projector dead-letters (a report on another node's subject) is not believed.

        The fold itself is not run here: the agent may read only its node's subjects, and
        the fold of that part of the log alone would judge a report without the
        placement that made its replica (it would allocate the replica's GPUs at its first
        report, against the node's inventory of then, and could reject what the whole
        log's fold applied). What the agent keeps of the fold is its one rule for these
        events, a state never goes backwards (`_remember`, by `ev.STATE_ORDER` as the fold)."""
        reps = await self._own_replicas()
        draining = {r.command for r in reps.values() if r.state == "draining"}
        if draining:
            drains = subjects.command_subject(self.node, "drain", self.root)
            async for batch in self._read(drains):
                for d in batch:
                    e = ingest.decode_checked(d.data, d.subject, self.root)
                    if isinstance(e, ev.ReplicaDrainEvent) and e.id in draining:
                        for rec in reps.values():
                            if rec.command == e.id:
                                rec.grace_s = e.data.grace_s
                                rec.drain_seq = d.seq
        self._replicas = reps

    async def _own_replicas(self) -> dict[str, _Replica]:
        """The node's replicas as its own subjects in the log say they are (`_rebuild`)."""
        reps: dict[str, _Replica] = {}
        node_subjects = f"{self.root}.node.{names.escape(self.node)}.>"
        async for batch in self._read(node_subjects):
            for d in batch:
                e = ingest.decode_checked(d.data, d.subject, self.root)
                if isinstance(e, str):
                    continue  # the fold's consumers dead-letter it; not ours to report
                match e:
                    case ev.ReplicaStateEvent(data=s):
                        _remember(reps, e, s)
                    case ev.NodeLostEvent(data=lost) if lost.grace_s == 0:
                        # The fold counts a lost node's replicas as failed and gives their
                        # GPUs to others: starting them again would double-book the GPUs.
                        # (A loss with a grace leaves them as they are, until a second
                        # `node.lost` without one.)
                        for rec in reps.values():
                            if rec.state in _HOLDING:
                                rec.state, rec.since = "failed", e.time
        return reps

    async def _stop_failed_with_the_node(self) -> set[str]:
        """After a reconnect: a replica the log says was failed with the node (lost past
        its grace while this agent was cut off) is stopped here too, said failed, so its
        server frees GPUs the cluster has given to others. Returns their ids."""
        logged = await self._own_replicas()
        out: set[str] = set()
        for rid, rec in list(self._replicas.items()):
            got = logged.get(rid)
            if rec.state not in _HOLDING or got is None or got.state != "failed":
                continue
            log.warning(
                "%s: %s was failed with the node while the agent was cut off: stopping it",
                self.node,
                rid,
            )
            if rec.task is not None:
                rec.task.cancel()
            self._spawn(rec, self._run_stop(rec, 0.0, failed=LOST_PAST_GRACE))
            out.add(rid)
        return out

    def _redrive(self, rec: _Replica) -> None:
        """Carry on with a replica a crash left mid-way."""
        if rec.state in _STARTING:
            log.info(
                "%s: %s was %s before the restart: bringing it up",
                self.node,
                rec.replica,
                rec.state,
            )
            self._spawn(rec, self._run_start(rec))
        elif rec.state == "ready":
            self._spawn(rec, self._run_resume(rec))
        elif rec.state == "draining":
            spent = (utc_now() - rec.since).total_seconds()
            log.info("%s: %s was draining before the restart: stopping it", self.node, rec.replica)
            self._spawn(rec, self._run_stop(rec, max(0.0, rec.grace_s - spent)))

    # ------------------------------------------------------------------ commands

    async def _consume(self) -> None:
        await bus_consume.consume_durable(
            self.js,
            durable=self.durable,
            filter_subject=subjects.commands_for_node(self.node, self.root),
            handler=self._on_command,
            stop=self._halt,
            root=self.root,
            ack_wait_s=self.ack_wait_s,
            bind=True,
        )

    async def _on_command(self, d: bus_consume.Delivery) -> None:
        # Returning acks the command; raising naks it (redelivered later) or, for
        # Permanent, dead-letters it. So every return path below has its effect stored.
        e = bus_consume.decode_checked(d, self.root)
        match e:
            case ev.ReplicaStartEvent():
                await self._on_start(e, redelivered=d.delivered > 1)
            case ev.ReplicaDrainEvent():
                await self._on_drain(e, redelivered=d.delivered > 1, seq=d.seq)
            case _:
                raise Permanent(f"{subjects.type_tag(e)} is not a command an agent carries out")

    async def _on_start(self, cmd: ev.ReplicaStartEvent, *, redelivered: bool) -> None:
        c = cmd.data
        again = " (redelivered)" if redelivered else ""
        log.info(
            "%s: replica.start %s: %s/%s on GPUs %s%s",
            self.node,
            c.replica,
            c.model,
            c.profile,
            _gpus_here(c.shards, self.node),
            again,
        )
        known = self._replicas.get(c.replica)
        if known is not None:
            # A start is carried out once per replica id. Starting a replica again that
            # runs, or one that was stopped, would hold its GPUs twice or bring back what
            # the scheduler let go.
            log.info("%s: %s is already %s: nothing to do", self.node, c.replica, known.state)
            return
        rec = _Replica(
            replica=c.replica,
            model=c.model,
            profile=c.profile,
            shards=c.shards,
            state="pending",
            command=cmd.id,
            correlation=cmd.correlation or cmd.id,
            since=cmd.time,
        )
        why = self._cannot_host(rec)
        if why is not None:
            await self._say(rec, "failed", why)
        else:
            await self._say(rec, "starting")
        # Invariant: a replica is remembered only once its first state is stored; a failed
        # publish raises, the command comes back, and this start is tried whole again.
        self._replicas[c.replica] = rec
        if rec.state == "starting":
            self._spawn(rec, self._run_start(rec))

    async def _on_drain(
        self, cmd: ev.ReplicaDrainEvent, *, redelivered: bool, seq: int = 0
    ) -> None:
        c = cmd.data
        again = " (redelivered)" if redelivered else ""
        log.info(
            "%s: replica.drain %s: %s, grace %gs%s",
            self.node,
            c.replica,
            c.reason,
            c.grace_s,
            again,
        )
        rec = self._replicas.get(c.replica)
        if rec is None:
            await self._drain_before_start(cmd)
            return
        if _ORDER[rec.state] >= _ORDER["draining"]:
            log.info("%s: %s is already %s: nothing to do", self.node, c.replica, rec.state)
            return
        if rec.task is not None:
            # The drain wins over a start in flight: the replica is not brought up only to
            # be stopped, and its ready is never said after its draining.
            rec.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rec.task
            rec.task = None
        async with rec.lock:
            rec.command, rec.correlation = cmd.id, cmd.correlation or cmd.id
            rec.grace_s = c.grace_s
            rec.drain_seq = seq
            await self._say(rec, "draining", c.reason)
        self._spawn(rec, self._run_stop(rec, c.grace_s))

    async def _drain_before_start(self, cmd: ev.ReplicaDrainEvent) -> None:
        """A drain for a replica this agent never started.

        Its start can still be on its way: a start this agent took and died before acking
        comes back only after the ack wait, behind commands sent later, its drain among
        them. Dropping the drain would let that start bring up a replica the cluster
        already let go; so if the log holds the start, the replica is reported stopped
        before it ever ran, and the start, when it comes, finds it known.
        """
        c = cmd.data
        start = await self._find_start(c.replica)
        if start is None:
            log.warning(
                "%s: %s was never sent to this node: nothing to drain", self.node, c.replica
            )
            return
        rec = _Replica(
            replica=c.replica,
            model=start.data.model,
            profile=start.data.profile,
            shards=start.data.shards,
            state="pending",
            command=cmd.id,
            correlation=cmd.correlation or cmd.id,
            since=cmd.time,
        )
        await self._say(rec, "stopped", f"{c.reason}: drained before it started")
        self._replicas[c.replica] = rec

    async def _find_start(self, replica: str) -> ev.ReplicaStartEvent | None:
        """The last `replica.start` for `replica` sent to this node, from the log."""
        found = None
        starts = subjects.command_subject(self.node, "start", self.root)
        async for batch in self._read(starts):
            for d in batch:
                e = ingest.decode_checked(d.data, d.subject, self.root)
                if isinstance(e, ev.ReplicaStartEvent) and e.data.replica == replica:
                    found = e
        return found

    def _cannot_host(self, rec: _Replica) -> str | None:
        """Why this node cannot run the replica's shard, or None."""
        have = {g.index for g in self.inventory.gpus}
        mine = [g for s in rec.shards if s.node == self.node for g in s.gpus]
        missing = sorted(set(mine) - have)
        if missing:
            return f"node {self.node} has no GPU {', '.join(map(str, missing))}"
        for other in self._replicas.values():
            if other.state not in _HOLDING:
                continue
            taken = set(mine) & {g for s in other.shards if s.node == self.node for g in s.gpus}
            if taken:
                return f"GPU {', '.join(map(str, sorted(taken)))} held by replica {other.replica}"
        return None

    # ------------------------------------------------------------------ transitions

    def _spawn(self, rec: _Replica, coro: Coroutine[Any, Any, None]) -> None:
        rec.task = asyncio.create_task(coro, name=f"{self.node} {rec.replica}")

    async def _run_start(self, rec: _Replica) -> None:
        report = self._reporter(rec)
        try:
            runtime = None
            if self.runtime.needs_model_runtime:
                runtime = await self._model_runtime(rec.model)
            await self.runtime.start(
                rec.replica,
                model=rec.model,
                profile=rec.profile,
                shards=rec.shards,
                report=report,
                runtime=runtime,
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("%s: %s: runtime failed to start it: %s", self.node, rec.replica, e)
            await report("failed", f"runtime: {type(e).__name__}: {e}")

    async def _run_resume(self, rec: _Replica) -> None:
        report = self._reporter(rec)
        try:
            await self.runtime.resume(rec.replica, report=report)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("%s: %s: runtime failed to resume it: %s", self.node, rec.replica, e)
            await report("failed", f"runtime: {type(e).__name__}: {e}")

    async def _model_runtime(self, model: str) -> ev.ModelRuntime | None:
        """The runtime of the last `model.declared` of `model` in the log, or None."""
        found: ev.ModelRuntime | None = None
        async for batch in self._read(subjects.model_subject(model, self.root)):
            for d in batch:
                e = ingest.decode_checked(d.data, d.subject, self.root)
                if isinstance(e, ev.ModelDeclaredEvent) and e.data.name == model:
                    found = e.data.runtime
        return found

    async def _run_stop(self, rec: _Replica, grace_s: float, failed: str | None = None) -> None:
        report = self._reporter(rec)
        if failed is not None:
            # A replica failed under it (its GPU went bad): stopped is said as failed.
            inner = report

            async def report(state: ev.ReplicaStateName, reason: str | None = None) -> None:
                if state == "stopped":
                    await inner("failed", failed)
                elif state == "failed":
                    await inner("failed", f"{failed}; {reason}")

        try:
            if failed is None and self.gateway_wait and grace_s > 0:
                grace_s -= await self._wait_for_gateways(rec, grace_s)
            await self.runtime.stop(rec.replica, grace_s=max(grace_s, 0.0), report=report)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("%s: %s: runtime failed to stop it: %s", self.node, rec.replica, e)
            await report("failed", f"runtime: {type(e).__name__}: {e}")

    async def _wait_for_gateways(self, rec: _Replica, grace_s: float) -> float:
        """Wait, up to `grace_s`, until no gateway has the draining `rec` in flight or
        routable; the seconds it took. What it found is said once per change."""
        try:
            q = await gateways.until_quiet(
                self.nc,
                self.node,
                rec.replica,
                within_s=grace_s,
                drain_seq=rec.drain_seq,
                root=self.root,
                fleet=self._fleet,
            )
        except nats.errors.Error as e:
            # No broker to ask through: the server's own drain is all there is.
            log.warning("%s: %s: gateways not asked: %s", self.node, rec.replica, e)
            return 0.0
        seen = q.gateways > 0
        if seen != self._gateways_seen:
            self._gateways_seen = seen
            if not seen:
                log.info(
                    "%s: no gateway answers for its in-flight requests: drains stop "
                    "servers without waiting for one",
                    self.node,
                )
        if q.clear:
            if seen:
                log.info(
                    "%s: %s: nothing in flight through %d gateway(s) after %.2fs",
                    self.node,
                    rec.replica,
                    q.gateways,
                    q.waited_s,
                )
        else:
            log.warning(
                "%s: %s: grace over with %d request(s) in flight through gateways "
                "(%d still routing to it): stopping it",
                self.node,
                rec.replica,
                q.inflight,
                q.routing,
            )
        return q.waited_s

    def _reporter(self, rec: _Replica) -> Report:
        async def report(state: ev.ReplicaStateName, reason: str | None = None) -> None:
            async with rec.lock:
                # A state already said, or one behind it, is news to nobody: a runtime
                # re-driven after a restart reports starting again on its way to ready.
                if _ORDER[state] <= _ORDER[rec.state]:
                    return
                while True:
                    try:
                        await self._say(rec, state, reason)
                        return
                    except PublishError as e:
                        if self._halt.is_set():
                            raise
                        log.warning(
                            "%s: %s %s not stored yet: %s", self.node, rec.replica, state, e
                        )
                        await asyncio.sleep(REPUBLISH_WAIT_S)

        return report

    async def _say(
        self, rec: _Replica, state: ev.ReplicaStateName, reason: str | None = None
    ) -> None:
        """Publish the replica's new state, and remember it once stored."""
        now = utc_now()
        e = self._state_event(rec, state, now, reason)
        await self._publish(e)
        rec.state, rec.since = state, now
        if self._on_stored is not None:
            self._on_stored(e)
        log.info("%s: %s %s%s", self.node, rec.replica, state, f" ({reason})" if reason else "")

    def _state_event(
        self,
        rec: _Replica,
        state: ev.ReplicaStateName,
        now: datetime,
        reason: str | None = None,
    ) -> ev.ReplicaStateEvent:
        """The event saying `rec` is in `state`: its id derived from its command and the
        state, so the same state said again (after a reconnect) is the same message."""
        return ev.ReplicaStateEvent(
            id=ids.derived(rec.command, f"state:{state}"),
            time=now,
            source=self.source,
            causation=rec.command,
            correlation=rec.correlation,
            data=ev.ReplicaState(
                replica=rec.replica,
                model=rec.model,
                profile=rec.profile,
                state=state,
                shards=rec.shards,
                reason=reason,
                # Endpoints are facts: a ready replica says where its server answers, so
                # the gateway routes from the log instead of asking around.
                endpoint=self.runtime.endpoint(rec.replica) if state == "ready" else None,
                # One shard of several speaks for its own: the replica is stopped once
                # every shard's agent has said so, and this shard's GPUs are free at its.
                node=self.node if _spans(rec.shards) else None,
            ),
        )

    async def _publish(self, e: ev.Event) -> None:
        try:
            await self._publisher.publish(e, node=self.node)
        except PublishError as err:
            # No stream takes the node's reports: the log has come to take them through
            # node streams since this agent asked for its consumers, or its node's stream
            # is gone. Asking again makes it; then the report is sent again, once.
            if not isinstance(err.__cause__, nats.js.errors.NoStreamResponseError):
                raise
            if await self._ask_for_consumers() is not None:
                raise
            await self._publisher.publish(e, node=self.node)

    # ------------------------------------------------------------------ chatter and use

    async def _heartbeats(self) -> None:
        subject = subjects.heartbeat_subject(self.node, self.root)
        reconnects = self._reconnect_count()
        while not self._halt.is_set():
            now_reconnects = self._reconnect_count()
            if now_reconnects != reconnects:
                reconnects = now_reconnects
                log.info(
                    "%s: reconnected: saying the inventory and replicas' states again",
                    self.node,
                )
                self._background(self._announce_again())
            body = _json.encode(
                {
                    "node": self.node,
                    "time": utc_now().isoformat(),
                    "replicas": sum(1 for r in self._replicas.values() if r.state in _HOLDING),
                    "agent": self.instance.agent,
                    "every": self.heartbeat_s,
                }
            )
            try:
                await self.nc.publish(subject, body)
            except nats.errors.Error as e:
                # A missed heartbeat is what heartbeats are for: the next one may arrive.
                log.warning("%s: heartbeat not sent: %s", self.node, e)
            await _pause(self._halt, self.heartbeat_s)

    async def _report_use(self) -> None:
        """Synthetic traffic: requests arrive at each busy model's rate (Poisson), and each
        ready replica's latest one is reported at most once per `used_interval_s`."""
        tick = min(self.heartbeat_s, self.used_interval_s)
        last_tick = time.monotonic()
        while not self._halt.is_set():
            await _pause(self._halt, tick)
            now_m = time.monotonic()
            dt, last_tick = now_m - last_tick, now_m
            real = self.runtime.served()
            loads = self.runtime.loads()
            for rec in list(self._replicas.values()):
                rpm = self.traffic.get(rec.model)
                really = real.get(rec.replica)
                load = loads.get(rec.replica)
                if (rpm is None and really is None and load is None) or rec.state != "ready":
                    continue
                served, reported_m = self._last_used.get(rec.replica, (None, -math.inf))
                if rpm is not None and self._rng.random() < 1.0 - math.exp(-rpm / 60.0 * dt):
                    served = utc_now()
                if (
                    really is not None
                    and really != self._reported_real.get(rec.replica)
                    and (served is None or really > served)
                ):
                    served = really
                self._last_used[rec.replica] = (served, reported_m)
                # An engine's load that changed is said with the last use said (the
                # fold keeps the latest of those times): a replica never seen serving
                # has said nothing of its use, and its load is its idle one.
                moved = load is not None and not _same_load(
                    load, self._reported_load.get(rec.replica)
                )
                at = served
                if at is None and moved:
                    at = self._reported_at.get(rec.replica)
                if at is None or now_m - reported_m < self.used_interval_s:
                    continue
                e = ev.make(
                    ev.ReplicaUsed(replica=rec.replica, at=at, engine=load),
                    id=new_id(),
                    time=utc_now(),
                    source=self.source,
                )
                try:
                    await self._publish(e)
                except PublishError as err:
                    log.warning("%s: use of %s not stored: %s", self.node, rec.replica, err)
                    continue
                self._last_used[rec.replica] = (None, now_m)
                self._reported_at[rec.replica] = at
                if load is not None:
                    self._reported_load[rec.replica] = load
                if really is not None:
                    self._reported_real[rec.replica] = really

    # ------------------------------------------------------------------ GPU health

    def _apply_health(self) -> None:
        gpus = tuple(
            msgspec.structs.replace(g, healthy=g.index not in self._unhealthy)
            for g in self.inventory.gpus
        )
        self.inventory = msgspec.structs.replace(self.inventory, gpus=gpus)

    def _gpu_went_bad(self, index: int, why: str) -> None:
        """GPU `index` is unhealthy: say so in the inventory, and fail its replica."""
        if index in self._unhealthy or index not in {g.index for g in self.inventory.gpus}:
            return
        self._unhealthy[index] = why
        _save_health(self._health_file, self._unhealthy)
        self._apply_health()
        log.warning(
            "%s: GPU %d unhealthy: %s; the scheduler avoids it until "
            "`llmgw gpu reset-health %s %d`",
            self.node,
            index,
            why,
            self.node,
            index,
        )
        self._background(self._publish_inventory())
        for rec in self._replicas.values():
            if rec.state not in _HOLDING or rec.state == "draining":
                continue
            if index not in {g for s in rec.shards if s.node == self.node for g in s.gpus}:
                continue
            if rec.task is not None:
                rec.task.cancel()
            self._spawn(rec, self._run_stop(rec, 0.0, failed=f"GPU {index} unhealthy: {why}"))

    def reset_health(self, index: int, by: str = "an operator") -> str | None:
        """Bring GPU `index` back; returns why it was unhealthy (None: it was not)."""
        why = self._unhealthy.pop(index, None)
        if why is not None:
            _save_health(self._health_file, self._unhealthy)
            self._apply_health()
            log.warning(
                "%s: GPU %d healthy again (was: %s), by request of %s", self.node, index, why, by
            )
        return why

    async def _publish_inventory(self) -> None:
        while True:
            try:
                await self._publish(
                    ev.make(self.inventory, id=new_id(), time=utc_now(), source=self.source)
                )
                return
            except PublishError as e:
                if self._halt.is_set():
                    return
                log.warning("%s: inventory not stored yet: %s", self.node, e)
                await asyncio.sleep(REPUBLISH_WAIT_S)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._finished)

    def _finished(self, t: asyncio.Task[None]) -> None:
        """A background task's end. One that failed is said in one line, never left for
        asyncio to report as an exception nobody retrieved."""
        self._tasks.discard(t)
        if not t.cancelled() and (err := t.exception()) is not None:
            what = getattr(t.get_coro(), "__qualname__", t.get_name())
            log.error("%s: %s failed: %s: %s", self.node, what, type(err).__name__, err)

    async def _serve_ctl(self) -> None:
        """Answer `llmgw gpu reset-health` and remind, now and then, of unhealthy GPUs."""

        mine = ctl_subject(self.node, self.root)

        async def on_request(msg: Any) -> None:
            refused = _refused(msg, mine)
            if refused is not None:
                # Not answered: a reply could go anywhere the sender named. Said once,
                # then at most once per 30 s with how many more (the flood is the
                # sender's, its lines would be this host's).
                self._ctl_guard.refuse(msg.subject, refused)
                return
            try:
                req = msgspec.json.decode(msg.data)
                index = int(req["gpu"])
                by = _one_line(str(req.get("by") or "an operator"))
            except (msgspec.DecodeError, KeyError, TypeError, ValueError, AttributeError):
                await msg.respond(_json.encode({"error": 'expected {"gpu": INDEX}'}))
                return
            if index not in {g.index for g in self.inventory.gpus}:
                await msg.respond(_json.encode({"error": f"node {self.node} has no GPU {index}"}))
                return
            was = self.reset_health(index, by=f"{by} (a control-role client)")
            if was is not None:
                await self._publish_inventory()
            await msg.respond(_json.encode({"gpu": index, "was": was}))

        sub = await self.nc.subscribe(mine, cb=on_request)
        try:
            while not self._halt.is_set():
                for index, why in sorted(self._unhealthy.items()):
                    log.warning(
                        "%s: GPU %d kept unhealthy (%s): `llmgw gpu reset-health %s %d` "
                        "once it is fixed",
                        self.node,
                        index,
                        why,
                        self.node,
                        index,
                    )
                await _pause(self._halt, UNHEALTHY_REMIND_S)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


def _refused(msg: Any, mine: str) -> str | None:
    """Why a ctl request is not an operator's request to this node, or None.

    It must arrive on this node's own ctl subject, and its reply must go to the control
    role's inbox: only the control role may publish on ctl subjects (deploy/nats/
    permissions.conf), and what the server itself sends there (a consumer's delivery, a
    reply to another user's request that named this subject) carries `$JS.ACK.` or no
    reply at all."""
    if msg.subject != mine:
        return f"it came on {_one_line(msg.subject)}, not {mine}"
    reply = msg.reply or ""
    if not reply.startswith(CONTROL_INBOX):
        shown = _one_line(reply.split(".", 1)[0]) if reply else "none"
        return f"its reply does not go to a control-role inbox (reply: {shown})"
    return None


def _one_line(text: str, limit: int = 128) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _remember(reps: dict[str, _Replica], e: ev.ReplicaStateEvent, s: ev.ReplicaState) -> None:
    rec = reps.get(s.replica)
    command = e.causation or e.id
    if rec is None:
        reps[s.replica] = _Replica(
            replica=s.replica,
            model=s.model,
            profile=s.profile,
            shards=s.shards,
            state=s.state,
            command=command,
            correlation=e.correlation,
            since=e.time,
            endpoint=s.endpoint,
        )
        return
    if s.endpoint is not None:
        rec.endpoint = s.endpoint
    # The log may hold a report the fold rejects (a state going backwards); the agent
    # follows the same rule, so what it resumes is what the cluster believes.
    if _ORDER[s.state] <= _ORDER[rec.state]:
        return
    rec.state, rec.command, rec.correlation, rec.since = s.state, command, e.correlation, e.time
    if s.shards:
        rec.shards = s.shards


def _spans(shards: tuple[ev.ShardSpec, ...]) -> bool:
    """Whether the replica has shards on several nodes."""
    return any(s.node != shards[0].node for s in shards[1:])


def _gpus_here(shards: tuple[ev.ShardSpec, ...], node: str) -> str:
    mine = [g for s in shards if s.node == node for g in s.gpus]
    return ",".join(map(str, mine)) or "none"


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds` unless `stop` is set first."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def _same_load(a: ev.EngineLoad, b: ev.EngineLoad | None) -> bool:
    """Whether two reads of an engine's metrics say the same, whenever they were read."""
    return b is not None and msgspec.structs.replace(a, at=b.at) == b


def _load_health(path: Path | None) -> dict[int, str]:
    if path is None:
        return {}
    try:
        raw = msgspec.json.decode(path.read_bytes(), type=dict[str, str])
    except (FileNotFoundError, msgspec.DecodeError):
        return {}
    return {int(k): v for k, v in raw.items() if k.isdigit()}


def _save_health(path: Path | None, unhealthy: dict[int, str]) -> None:
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(_json.encode({str(k): v for k, v in unhealthy.items()}))
    tmp.replace(path)
