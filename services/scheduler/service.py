"""The scheduler service: keeps desired replicas placed, reports what cannot be.

Run by `llmgw up` in-process and by `python -m services.scheduler`, one or more at a time:
a lease in a JetStream KV bucket picks the one that acts; the others follow the log warm
and stand by. The leader runs a pass of `services.scheduler.plan` on every relevant event
(the follower's on_change) and on a tick, and publishes what the pass decided:
`placement.decided` plus a `replica.start` on each shard's node, `placement.failed`,
`replica.drain` (scale_down, model_removed, placement_timeout) and `node.lost` for nodes
whose heartbeats (core NATS `<root>.heartbeat.<node>`) stopped.

Rules of the shell:
- It decides only on a view that holds everything it published itself: after a publish,
  no pass runs until the follower has folded it, or it would place the same replica twice.
- On becoming leader it first folds the stream up to its last message as of then, so it
  never places again what the old leader already placed.
- It publishes only while its lease is valid, checked before each batch; a deposed or
  partitioned leader's belief ends before a standby can take over.

It must not decide anything itself (that is `plan`'s), must not fold differently from
`services.core.fold`, and must not publish while it does not hold the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from schemas import codec, names, subjects
from schemas import events as ev
from services.bus import Publisher, PublishError
from services.clock import utc_now
from services.core.view import Rejection, View
from services.follower import ViewFollower
from services.lease import Lease
from services.scheduler import plan as planner
from services.scheduler.plan import Failure, SchedulerConfig

log = logging.getLogger("llmgw.scheduler")

SOURCE = "scheduler"


# QUIET_TYPES change nothing a pass looks at: a pass is not run for them. The tick still
# runs one, so a missed wake-up costs a tick, never a decision.
QUIET_TYPES: frozenset[type] = frozenset(
    {
        ev.ReplicaUsedEvent,
        ev.ViewDigestEvent,
        ev.ReplicaStartEvent,
        ev.PlacementFailedEvent,
    }
)

# FOLLOW_TIMEOUT_S bounds the wait for the follower to fold the stream at takeover or to
# fold our own last publish. Past it the pass is skipped and tried again, rather than
# taken on a view that may not hold what was already decided.
FOLLOW_TIMEOUT_S = 10.0

# BATCH bounds the events published between two looks at the lease. A pass that places
# a thousand replicas must not run on after a lapse; at ~10k events/s a batch takes
# a few tens of milliseconds, well inside the lease's safety margin.
BATCH = 256

# MIN_LEASE_LEFT_S is the least lease time a batch starts with: a batch begun with less
# could still be publishing when the belief ends.
MIN_LEASE_LEFT_S = 0.05


@dataclass(slots=True)
class Stats:
    """What this process did, for status lines, tests and the benchmark."""

    passes: int = 0
    placed: int = 0
    failed: int = 0
    drained: int = 0
    lost: int = 0
    published: int = 0
    duplicates: int = 0
    """Publishes JetStream dropped as duplicates (another scheduler said it first)."""
    aborted: int = 0
    """Passes cut short because the lease lapsed or a publish failed."""


class Scheduler:
    """One scheduler process; see the module docstring."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        *,
        root: str = subjects.DEFAULT_ROOT,
        config: SchedulerConfig | None = None,
        clock: Callable[[], datetime] = utc_now,
        holder: str | None = None,
        follower: ViewFollower | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.root = root
        self.config = config if config is not None else SchedulerConfig()
        self.clock = clock
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.source = f"{SOURCE}/{self.holder}"
        self.publisher = Publisher(js, root)
        self.follower = (
            follower
            if follower is not None
            else ViewFollower(js, root=root, consumer="scheduler", on_change=self._on_event)
        )
        if follower is not None and follower.on_change is None:
            follower.on_change = self._on_event
        self.lease = Lease(
            js,
            name=f"{root}.scheduler",
            holder=self.holder,
            ttl_s=self.config.lease_ttl_s,
            on_change=self._on_lease,
        )
        self.stats = Stats()
        self._wake = asyncio.Event()
        # _synced: the view holds the whole stream as of this term's start. Reset on
        # every change of leadership; no pass runs without it.
        self._synced = False
        # _written is the stream sequence of this process's last publish; no pass runs
        # on a view short of it.
        self._written = 0
        self._failures: dict[str, Failure] = {}
        # _heard: per node, monotonic time of its last heartbeat. _since: per node, the
        # inventory report we first saw it with and when, so a node is given a full
        # timeout from when we (or its new report) first knew of it.
        self._heard: dict[str, float] = {}
        self._since: dict[str, tuple[datetime, float]] = {}

    # ------------------------------------------------------------------ reading

    @property
    def is_leader(self) -> bool:
        return self.lease.is_leader

    @property
    def view(self) -> View:
        return self.follower.view

    # ------------------------------------------------------------------ running

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log, listen for heartbeats, take part in the lease and reconcile
        while leading, until `stop` is set. A clean stop releases the lease so a standby
        takes over at once; a cancelled run (a crash, as the others see it) does not, and
        the standby takes over when the lease's TTL runs out."""
        sub = await self.nc.subscribe(f"{self.root}.heartbeat.*", cb=self._on_heartbeat)
        tasks = [
            asyncio.create_task(self.follower.run(stop), name="scheduler.follow"),
            asyncio.create_task(self.lease.run(stop, release=False), name="scheduler.lease"),
            asyncio.create_task(self._loop(stop), name="scheduler.reconcile"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if not t.cancelled() and (e := t.exception()) is not None:
                    raise e
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        await self.lease.release()

    def _on_lease(self, leading: bool) -> None:
        self._synced = False
        if leading:
            log.info("scheduler %s: leading", self.holder)
            self._wake.set()
        else:
            log.info("scheduler %s: standing by", self.holder)

    def _on_event(self, seq: int, event: ev.Event, rejection: Rejection | None) -> None:
        if type(event) not in QUIET_TYPES:
            self._wake.set()

    async def _on_heartbeat(self, msg: Msg) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        try:
            node = names.unescape(token)
        except names.TokenError:
            return
        self._heard[node] = time.monotonic()

    async def _loop(self, stop: asyncio.Event) -> None:
        tick = self.config.tick_s
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), tick)
            self._wake.clear()
            if stop.is_set() or not self.lease.is_leader:
                continue
            try:
                await self.reconcile()
            except (PublishError, TimeoutError, nats.errors.Error) as e:
                self.stats.aborted += 1
                log.warning("scheduler: pass failed: %s: %s", type(e).__name__, e)

    # ------------------------------------------------------------------ one pass

    async def reconcile(self) -> planner.Plan | None:
        """One pass, if this process leads and its view is current; what it decided."""
        if not self.lease.is_leader:
            return None
        if not self._synced:
            info = await self.js.stream_info(subjects.STREAM)
            await self.follower.wait_for(info.state.last_seq, FOLLOW_TIMEOUT_S)
            # The lease may have changed hands while we waited; then this sync is not
            # this term's.
            if not self.lease.is_leader:
                return None
            self._synced = True
            log.info("scheduler %s: view at %d; reconciling", self.holder, self.follower.seq)
        if self.follower.seq < self._written:
            await self.follower.wait_for(self._written, FOLLOW_TIMEOUT_S)
        view = self.follower.view
        out = planner.plan(
            view,
            self.clock(),
            self.config,
            failures=self._failures,
            silent=self._silence(view),
            source=self.source,
        )
        self.stats.passes += 1
        for m in out.satisfied:
            self._failures.pop(m, None)
        if out.outputs:
            await self._publish(out)
        return out

    def _silence(self, view: View) -> dict[str, float]:
        """Per node not yet lost, seconds since it was last heard of."""
        now = time.monotonic()
        out: dict[str, float] = {}
        for name, rec in view.state.nodes.items():
            if rec.lost:
                continue
            since = self._since.get(name)
            if since is None or since[0] != rec.updated_at:
                since = (rec.updated_at, now)
                self._since[name] = since
            out[name] = now - max(self._heard.get(name, 0.0), since[1])
        return out

    async def _publish(self, out: planner.Plan) -> None:
        items = out.outputs
        for i in range(0, len(items), BATCH):
            if self.lease.remaining_s() < MIN_LEASE_LEFT_S:
                self.stats.aborted += 1
                log.warning(
                    "scheduler %s: lease lapsed mid-pass; %d of %d events not published",
                    self.holder,
                    len(items) - i,
                    len(items),
                )
                return
            batch = items[i : i + BATCH]
            raw = [
                (
                    subjects.subject_for(o.event, self.root, o.node),
                    codec.encode(o.event),
                    o.event.id,
                )
                for o in batch
            ]
            acks = await self.publisher.publish_many(raw)
            for o, ack in zip(batch, acks, strict=True):
                self._written = max(self._written, ack.seq)
                self.stats.published += 1
                if ack.duplicate:
                    self.stats.duplicates += 1
                if o.failure is not None:
                    self._failures[o.failure[0]] = o.failure[1]
        self.stats.placed += out.placed
        self.stats.failed += out.failed
        self.stats.drained += out.drained
        self.stats.lost += out.lost
        if out.placed or out.failed or out.lost:
            log.info(
                "scheduler: placed %d, failed %d, drained %d, lost %d (view %d)",
                out.placed,
                out.failed,
                out.drained,
                out.lost,
                self.view.seq,
            )
