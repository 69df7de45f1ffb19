"""The scheduler service: keeps desired replicas placed, reports what cannot be.

Run by `llmgw up` in-process and by `python -m services.scheduler`, one or more at a time:
a lease in a JetStream KV bucket picks the one that acts; the others follow the log warm
and stand by. The leader runs a pass of `services.core.scheduling.plan` on every relevant event
(the follower's on_change) and on a tick, and publishes what the pass decided:
`placement.decided` plus a `replica.start` on each shard's node, `placement.failed`,
`replica.drain` (scale_down, model_removed, placement_timeout), the autoscaler's
`scale.desired` for on-demand models (`services.core.autoscale`), `node.lost` for nodes
whose heartbeats (core NATS `<root>.heartbeat.<node>`) stopped (with the grace its
replicas get, then a second once that grace has passed), and `node.found` for a lost
node heard from again.

Rules of the shell:
- It decides only on a view that holds everything it published itself: after a publish,
  no pass runs until the follower has folded it, or it would place the same replica twice.
- On becoming leader it first folds the stream up to its last message as of then, so it
  never places again what the old leader already placed.
- It publishes only while its lease is valid, checked before each batch; a deposed or
  partitioned leader's belief ends before a standby can take over.
- While its connection is down, and for one heartbeat period after it takes the lead or
  its connection comes back, it reports no node lost: the heartbeats it missed meanwhile
  say nothing of the nodes, and the first ones after the reconnect are on their way.

The lease, the follower, the own-writes watermark and the publishing are
`services.plane.leader.Leader`'s, shared with the preemption service.

It must not decide anything itself (that is `plan`'s), must not fold differently from
`services.core.fold`, and must not publish while it does not hold the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from schemas import events as ev
from schemas import names, subjects
from services.bus import Published, PublishError
from services.clock import utc_now
from services.core import autoscale
from services.core import scheduling as planner
from services.core.scheduling import Config, Failure
from services.core.view import Rejection, View
from services.plane.follower import ViewFollower
from services.plane.leader import Leader, LeaseLapsed

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

# HEARTBEAT_S is the heartbeat period assumed of an agent until one says its own
# (`every` in its heartbeat): the agent's default.
HEARTBEAT_S = 1.0


class _Beat(msgspec.Struct):
    """What the scheduler reads of a heartbeat: the node it is from (which must be the
    subject's) and how often its agent sends them."""

    node: str
    every: float = HEARTBEAT_S


_beat = msgspec.json.Decoder(_Beat)


# FOLLOW_TIMEOUT_S bounds the wait for the follower to fold the stream at takeover or to
# fold our own last publish. Past it the pass is skipped and tried again, rather than
# taken on a view that may not hold what was already decided.
FOLLOW_TIMEOUT_S = 10.0


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
    scaled: int = 0
    """Autoscaler decisions published (`scale.desired` with a reason)."""


class Scheduler:
    """One scheduler process; see the module docstring."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        *,
        root: str = subjects.DEFAULT_ROOT,
        config: Config | None = None,
        clock: Callable[[], datetime] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
        holder: str | None = None,
        follower: ViewFollower | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.root = root
        self.config = config if config is not None else Config()
        # clock: the wall clock a pass decides at and stamps its events with; monotonic:
        # the one heartbeats are timed by, which a step of the wall clock does not move.
        # A test passes both, and moves them.
        self.clock = clock
        self.monotonic = monotonic
        if follower is not None and follower.on_change is None:
            follower.on_change = self._on_event
        self.leader = Leader(
            js,
            role="scheduler",
            root=root,
            holder=holder,
            ttl_s=self.config.lease_ttl_s,
            follower=follower,
            on_event=self._on_event,
            on_lease=self._on_lease,
        )
        self.holder = self.leader.holder
        self.source = f"{SOURCE}/{self.holder}"
        self.follower = self.leader.follower
        self.lease = self.leader.lease
        self.stats = Stats()
        self._wake = asyncio.Event()
        # _synced: the view holds the whole stream as of this term's start. Reset on
        # every change of leadership; no pass runs without it.
        self._synced = False
        self._failures: dict[str, Failure] = {}
        # _memo: what the passes keep from one to the next (`scheduling.Memo`), this
        # service's own; every entry is checked against what it was worked out from.
        self._memo = planner.Memo()
        # _heard: per node, monotonic time of its last heartbeat. _since: per node, the
        # inventory report we first saw it with and when, so a node is given a full
        # timeout from when we (or its new report) first knew of it.
        self._heard: dict[str, float] = {}
        self._since: dict[str, tuple[datetime, float]] = {}
        # _lost_seen: per lost node, the loss we first saw it with and when, so only a
        # heartbeat after it brings the node back. _every: the longest heartbeat period
        # an agent said. _quiet_until: no node is reported lost before this (monotonic),
        # one heartbeat period after taking the lead or a reconnect (_reconnects).
        self._lost_seen: dict[str, tuple[datetime, float]] = {}
        self._every = HEARTBEAT_S
        self._quiet_until = 0.0
        self._reconnects = self._reconnect_count()

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
        while leading, until `stop` is set (see `Leader.run` for how it stops)."""
        sub = await self.nc.subscribe(f"{self.root}.heartbeat.*", cb=self._on_heartbeat)
        try:
            await self.leader.run(stop, self._loop)
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def _on_lease(self, leading: bool) -> None:
        self._synced = False
        if leading:
            self._quiet()
            log.info("scheduler %s: leading", self.holder)
            self._wake.set()
        else:
            log.info("scheduler %s: standing by", self.holder)

    def _on_event(self, seq: int, event: ev.Event, rejection: Rejection | None) -> None:
        if type(event) not in QUIET_TYPES:
            self._wake.set()

    async def _on_heartbeat(self, msg: Msg) -> None:
        if msg.reply:
            return  # an agent starting asks whether its node has one already: no heartbeat
        token = msg.subject.rsplit(".", 1)[-1]
        try:
            node = names.unescape(token)
            beat = _beat.decode(msg.data)
        except (names.TokenError, msgspec.DecodeError, msgspec.ValidationError):
            return  # not a heartbeat: the subject alone says nothing of a node
        if beat.node != node:
            return  # a body naming another node than its subject's: not a heartbeat
        self._heard[node] = self.monotonic()
        every = beat.every
        if every > self._every and every < self.config.node_timeout_s:
            self._every = every

    def _reconnect_count(self) -> int:
        stats = getattr(self.nc, "stats", None)
        return stats.get("reconnects", 0) if isinstance(stats, dict) else 0

    def _quiet(self) -> None:
        """Report no node lost for one heartbeat period from now."""
        self._quiet_until = self.monotonic() + self._every

    async def _loop(self, stop: asyncio.Event) -> None:
        tick = self.config.tick_s
        # A stop wakes the loop as an event does: it ends then, not at its next tick.
        waker = asyncio.create_task(self._wake_on(stop), name="scheduler: stop")
        try:
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
        finally:
            waker.cancel()

    async def _wake_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake.set()

    # ------------------------------------------------------------------ one pass

    async def reconcile(self) -> planner.Plan | None:
        """One pass, if this process leads and its view is current; what it decided."""
        if not self.lease.is_leader:
            return None
        if not self._synced:
            await self.follower.caught_up(FOLLOW_TIMEOUT_S)
            # The lease may have changed hands while we waited; then this sync is not
            # this term's.
            if not self.lease.is_leader:
                return None
            self._synced = True
            log.info("scheduler %s: view at %d; reconciling", self.holder, self.follower.seq)
        await self.leader.caught_up(0, FOLLOW_TIMEOUT_S)
        view = self.follower.view
        now = self.clock()
        if not getattr(self.nc, "is_connected", True):
            # Cut off from the broker, it hears no heartbeat: no node is lost for that,
            # and a loss decided now would be published on the reconnect, stale.
            self._quiet_until = math.inf
        reconnects = self._reconnect_count()
        if reconnects != self._reconnects:
            self._reconnects = reconnects
            self._quiet()
        if self.config.autoscale:
            wanted = autoscale.decide(view, now, source=self.source)
            if wanted.decisions:
                # Published, then folded before any placement: the pass that follows the
                # fold (it wakes the loop) places what they ask for.
                await self._publish_scaling(wanted.decisions)
                return None
        out = planner.plan(
            view,
            now,
            self.config,
            failures=self._failures,
            silent=self._silence(view),
            heard=self._heard_again(view),
            source=self.source,
            memo=self._memo,
        )
        self.stats.passes += 1
        self._failures = planner.remember(self._failures, out.satisfied, now, self.config)
        if out.outputs:
            await self._publish(out)
        return out

    def _silence(self, view: View) -> dict[str, float]:
        """Per node not yet lost, seconds since it was last heard of; none while quiet
        after taking the lead or a reconnect (`_quiet`)."""
        now = self.monotonic()
        out: dict[str, float] = {}
        if now < self._quiet_until:
            return out
        for name, rec in view.state.nodes.items():
            if rec.lost:
                continue
            since = self._since.get(name)
            if since is None or since[0] != rec.updated_at:
                since = (rec.updated_at, now)
                self._since[name] = since
            out[name] = now - max(self._heard.get(name, 0.0), since[1])
        return out

    def _heard_again(self, view: View) -> list[str]:
        """The lost nodes heard from since this process first saw them lost."""
        now = self.monotonic()
        out: list[str] = []
        for name, rec in view.state.nodes.items():
            if not rec.lost:
                continue
            seen = self._lost_seen.get(name)
            if seen is None or seen[0] != rec.updated_at:
                seen = (rec.updated_at, now)
                self._lost_seen[name] = seen
            if self._heard.get(name, -1.0) > seen[1]:
                out.append(name)
        return out

    async def _publish_scaling(self, decisions: list[autoscale.Decision]) -> None:
        try:
            acks = await self.leader.publish([(d.event, None) for d in decisions])
        except LeaseLapsed as e:
            self.stats.aborted += 1
            log.warning("scheduler %s: lease lapsed before the autoscaler's scale", self.holder)
            acks = e.published
        for d, ack in zip(decisions, acks, strict=False):
            self.stats.published += 1
            self.stats.scaled += 1
            if ack.duplicate:
                self.stats.duplicates += 1
            log.info("scheduler: autoscaler: %s -> %d (%s)", d.model, d.replicas, d.reason)

    async def _publish(self, out: planner.Plan) -> None:
        items = out.outputs
        try:
            acks = await self.leader.publish([(o.event, o.node) for o in items])
        except LeaseLapsed as e:
            self.stats.aborted += 1
            log.warning(
                "scheduler %s: lease lapsed mid-pass; %d of %d events not published",
                self.holder,
                e.left,
                len(items),
            )
            self._published(items, e.published)
            return
        self._published(items, acks)
        self.stats.placed += out.placed
        self.stats.failed += out.failed
        self.stats.drained += out.drained
        self.stats.lost += out.lost
        if out.placed or out.failed or out.lost or out.found:
            log.info(
                "scheduler: placed %d, failed %d, drained %d, lost %d, found %d (view %d)",
                out.placed,
                out.failed,
                out.drained,
                out.lost,
                out.found,
                self.view.seq,
            )

    def _published(self, items: list[planner.Output], acks: list[Published]) -> None:
        for o, ack in zip(items, acks, strict=False):
            self.stats.published += 1
            if ack.duplicate:
                self.stats.duplicates += 1
            if o.failure is not None:
                self._failures[o.failure[0]] = o.failure[1]
