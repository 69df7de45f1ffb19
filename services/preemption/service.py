"""The preemption service: reacts to `placement.failed` with a decision, drains and holds.

Run by `llmgw up` and by `python -m services.preemption`, one or more at a time: a lease
in a JetStream KV bucket picks the one that acts, the others stand by warm (their views
followed, nothing pulled). The leader pulls `<root>.placement.failed.>` through one
durable consumer with explicit acks, and for each trigger with reason `no_fit`:

1. waits until its view has folded the log at least up to the trigger (and up to its
   own last publish), so it never decides on a stale view;
2. asks the pure policy, `services.core.preemption.plan`;
3. publishes `preemption.decided`, then a `replica.drain` per victim on the victim's
   node, then a `hold.created` per victim model, every id derived from the trigger's id;
4. acks.

A crash anywhere before the ack gets the trigger redelivered. Within JetStream's
duplicate window the same ids make every repeat a duplicate the stream drops; past it,
a redelivered trigger whose decision the view already holds is not decided again: the
outputs of that decision the view does not show yet are published, and nothing else.

A trigger that may have been seen before (redelivered, or in the backlog found on
taking the lead) is checked against the log first: if a decision for its model was
stored after it, that decision answers it (its own: completed; a later trigger's: the
trigger is acked with nothing published).

A published decision lists the first `SHOWN` candidates and exclusions, with the whole
count in `considered`: on a full cluster the policy weighs every replica, and the full
lists would pass the largest event the codec accepts.

On a tick the leader also publishes `hold.released` for every hold that ended (expired,
or its model was given what it asked for), its id derived from the hold's.

It must not decide anything itself (that is the policy's), must not fold differently
from `services.core.fold`, and must not publish while it does not hold the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import codec, ids, subjects
from schemas import events as ev
from services.bus import Permanent, Publisher, Retry
from services.bus.consume import Delivery, consume_durable, decode_checked
from services.clock import utc_now
from services.core import preemption
from services.core.view import DecisionRecord, View
from services.follower import ViewFollower
from services.lease import Lease
from services.preemption import fault as faults

log = logging.getLogger("llmgw.preemption")

SOURCE = "preemption"
DURABLE = "preemption"


# NOT_LEADER_RETRY_S is how long a message fetched by a leader that has since lost its
# lease waits before it is delivered again. Short: the new leader should have it at once;
# it still counts as a delivery, so max_deliver bounds how often leadership may flap.
NOT_LEADER_RETRY_S = 0.2

# FOLLOW_TIMEOUT_S bounds the wait for the view to reach a trigger. Past it the trigger
# is retried rather than decided on a view that may not hold what led to it.
FOLLOW_TIMEOUT_S = 10.0

# RETRY_PAUSE_S is the wait before setting the consumer up again after the broker failed.
RETRY_PAUSE_S = 0.5

# MAX_DELIVER bounds deliveries of one trigger. A trigger that fails this often is
# dead-lettered with the last error: a decision that cannot be taken in five tries over
# a minute is better looked at by a person than retried for ever.
MAX_DELIVER = 5


# SHOWN bounds the candidates and exclusions a published decision lists. On a full
# cluster the policy weighs every replica: 1,600 one-GPU replicas made a 181 KB event,
# and past about 2,300 it would exceed the largest event the codec accepts, be
# dead-lettered by every follower, and leave the view without the decision, so the next
# trigger would stop a second set of victims.
SHOWN = 50


@dataclass(frozen=True, slots=True)
class Options:
    """The service's own timings, beside the policy's `preemption.Config`.

    lease_ttl_s: a standby takes over at most this long after the leader dies.
    tick_s: how often the leader looks for holds that ended.
    ack_wait_s: how long a trigger may stay unacked before it is redelivered; also how
      long after a crash the next leader gets it.
    drain_grace_s: the grace each `replica.drain` gives its replica.
    """

    lease_ttl_s: float = 5.0
    tick_s: float = 1.0
    ack_wait_s: float = 30.0
    drain_grace_s: float = 30.0
    max_deliver: int = MAX_DELIVER
    durable: str = DURABLE


@dataclass(slots=True)
class Stats:
    """What this process did, for status lines and tests."""

    decided: int = 0
    superseded: int = 0
    """Triggers from a backlog already answered by a later decision for their model."""
    republished: int = 0
    """Redelivered triggers whose earlier decision was completed rather than retaken."""
    ignored: int = 0
    """Triggers with a reason other than no_fit."""
    holds_released: int = 0
    ticks: int = 0
    """Passes over the holds while leading."""
    outcomes: dict[str, int] = field(default_factory=dict)


Output = tuple[str, ev.Event]
"""An event to publish and its subject."""


class PreemptionService:
    """One preemption service process; see the module docstring."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        *,
        root: str = subjects.DEFAULT_ROOT,
        config: preemption.Config | None = None,
        clock: Callable[[], datetime] = utc_now,
        holder: str | None = None,
        fault: faults.Fault | str | None = None,
        options: Options | None = None,
        follower: ViewFollower | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.root = root
        self.config = config if config is not None else preemption.Config()
        self.clock = clock
        self.options = options if options is not None else Options()
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"
        # fault None: whatever $LLMGW_FAULT arms (nothing, unless a crash test set it).
        if fault is None:
            self.fault = faults.Fault.from_env()
        else:
            self.fault = fault if isinstance(fault, faults.Fault) else faults.Fault(fault)
        self.publisher = Publisher(js, root)
        self.follower = (
            follower
            if follower is not None
            else ViewFollower(js, root=root, consumer=f"{DURABLE}-view")
        )
        self._leading = asyncio.Event()
        self._deposed = asyncio.Event()
        self.lease = Lease(
            js,
            name=f"{root}.preemption",
            holder=self.holder,
            ttl_s=self.options.lease_ttl_s,
            on_change=self._on_lease,
        )
        # _written is the stream sequence of this process's last publish. A trigger is
        # decided on a view at least this far along: without it a second trigger for the
        # same model, already in the stream before our first decision, would be decided
        # on a view that does not hold that decision, and stop a second set of victims.
        self._written = 0
        # _backlog is the stream's last sequence when this process last took the lead:
        # triggers up to it may have been answered by a leader before us.
        self._backlog = 0
        # _released holds the ids of hold.released events sent and not yet folded, so a
        # tick does not send one again while the view catches up.
        self._released: set[str] = set()
        self.stats = Stats()

    # ------------------------------------------------------------------ running

    @property
    def is_leader(self) -> bool:
        return self.lease.is_leader

    @property
    def view(self) -> View:
        return self.follower.view

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log, take part in the lease, and while leading handle triggers and
        release holds, until `stop` is set. A clean stop releases the lease so a standby
        takes over at once; a cancelled run (a crash, as far as the others can tell) does
        not, and the standby takes over when the lease's TTL runs out."""
        tasks = [
            asyncio.create_task(self.follower.run(stop), name="preemption.follow"),
            asyncio.create_task(self._hold_lease(stop), name="preemption.lease"),
            asyncio.create_task(self._lead(stop), name="preemption.lead"),
            asyncio.create_task(self._tick(stop), name="preemption.holds"),
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _hold_lease(self, stop: asyncio.Event) -> None:
        """Take part in the lease until `stop`, then give it up; cancelled, keep quiet."""
        # The lease's own loop never sees `stop`: its clean exit would only forget the
        # lease, while ours releases it on the server so a standby need not wait the TTL.
        task = asyncio.create_task(self.lease.run(asyncio.Event(), release=False))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()
                return
            await self.lease.release()
        finally:
            stopped.cancel()
            task.cancel()
            await asyncio.gather(task, stopped, return_exceptions=True)

    def _on_lease(self, leading: bool) -> None:
        if leading:
            self._deposed.clear()
            self._leading.set()
        else:
            self._leading.clear()
            self._deposed.set()

    async def _lead(self, stop: asyncio.Event) -> None:
        """Pull triggers while leading; stand by (pulling nothing) while not."""
        while not stop.is_set():
            if not await _first(stop, self._leading):
                return
            log.info("preemption %s: leading; consuming placement.failed", self.holder)
            inner = asyncio.Event()
            watcher = asyncio.create_task(_set_when_any(inner, stop, self._deposed))
            try:
                self._backlog = await self._last_seq()
                await consume_durable(
                    self.js,
                    durable=self.options.durable,
                    filter_subject=f"{self.root}.placement.failed.>",
                    handler=self.handle,
                    stop=inner,
                    batch=16,
                    ack_wait_s=self.options.ack_wait_s,
                    max_deliver=self.options.max_deliver,
                    root=self.root,
                    fetch_timeout_s=0.25,
                )
            except nats.errors.ConnectionClosedError:
                return
            except (nats.errors.Error, TimeoutError) as e:
                # The broker is away or restarting: the consumer is set up again once it
                # answers. The lease decides meanwhile whether we still may.
                log.warning("preemption %s: consumer: %s: %s", self.holder, type(e).__name__, e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), RETRY_PAUSE_S)
                continue
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            if not stop.is_set():
                log.info("preemption %s: lease lost; standing by", self.holder)

    async def _tick(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.options.tick_s)
            if stop.is_set():
                return
            if self.is_leader:
                self.stats.ticks += 1
                try:
                    await self.release_holds()
                except Exception as e:
                    log.warning("preemption: releasing holds failed: %s: %s", type(e).__name__, e)

    # ------------------------------------------------------------------ triggers

    async def handle(self, d: Delivery) -> None:
        """Handle one `placement.failed`; returning acks it."""
        event = decode_checked(d, self.root)
        if not isinstance(event, ev.PlacementFailedEvent):
            raise Permanent(f"a {subjects.type_tag(event)} on the placement.failed subject")
        # quota_limit and other reasons: the owner is past a limit, which stopping other
        # replicas cannot lift. Nothing to decide, nothing to record.
        if event.data.reason != "no_fit":
            self.stats.ignored += 1
            return
        if not self.is_leader:
            raise Retry(NOT_LEADER_RETRY_S, "not the leader any more")
        # Look in the log for an answer already given when the trigger may have been seen
        # before: redelivered, or from the backlog this process found when it took the
        # lead (a dead leader's unacked work, or a log older than the consumer).
        look = d.delivered > 1 or d.seq <= self._backlog
        target = max(d.seq, self._written)
        if look:
            # An earlier attempt may have published its decision after the trigger; the
            # view must hold it before we look.
            target = max(target, await self._last_seq())
        await self._follow(target)
        view = self.follower.view
        now = self.clock()
        earlier = await self._answered(view, event, d.seq, look)
        if earlier is not None and earlier.data.trigger != event.id:
            # A later trigger for the same model was decided on a newer view: that
            # decision answers this one too. Deciding again would stop more victims.
            self.stats.superseded += 1
            log.info(
                "preemption for %s: trigger %s already answered by %s",
                event.data.model,
                event.id,
                earlier.id,
            )
            return
        if earlier is not None:
            outputs = self._missing(view, earlier, now)
            self.stats.republished += 1
            log.info(
                "preemption for %s: trigger %s came back; its decision %s stands, "
                "%d output(s) it had not published yet",
                earlier.data.for_model,
                event.id,
                earlier.id,
                len(outputs),
            )
        else:
            decision = preemption.plan(
                view, event.data.model, now, self.config, avoid=event.data.avoid
            )
            outputs = self.outputs(event, decision, now)
            self.stats.decided += 1
            self.stats.outcomes[decision.outcome] = self.stats.outcomes.get(decision.outcome, 0) + 1
            log.info("preemption for %s: %s: %s", decision.model, decision.outcome, decision.reason)
        if not self.is_leader:
            raise Retry(NOT_LEADER_RETRY_S, "lost the lease while deciding")
        await self._publish(outputs, decision=True)
        self.fault.hit(faults.CRASH_BEFORE_ACK)

    def outputs(
        self, trigger: ev.PlacementFailedEvent, decision: preemption.Decision, now: datetime
    ) -> list[Output]:
        """The events a decision is published as, in order: the decision, the drains, the
        holds. Ids derive from the trigger's, so the same decision is the same events."""
        tid = trigger.id
        correlation = trigger.correlation or tid
        decided_id = ids.derived(tid, "decided")
        out: list[Output] = []
        decided = ev.make(
            bounded(decision.to_event_data(tid)),
            id=decided_id,
            time=now,
            source=SOURCE,
            causation=tid,
            correlation=correlation,
        )
        out.append(
            (subjects.decision_subject("preemption.decided", decision.model, self.root), decided)
        )
        for v in decision.victims:
            out.append(
                self._drain(
                    tid, decided_id, correlation, v.replica, v.model, v.node, decision.model, now
                )
            )
        for h in decision.holds:
            out.append(self._hold(tid, decided_id, correlation, h, now))
        return out

    def _drain(
        self,
        tid: str,
        decided_id: str,
        correlation: str,
        replica: str,
        model: str,
        node: str,
        for_model: str,
        now: datetime,
    ) -> Output:
        e = ev.make(
            ev.ReplicaDrain(
                replica=replica,
                model=model,
                reason="preempted",
                for_model=for_model,
                grace_s=self.options.drain_grace_s,
            ),
            id=ids.derived(tid, f"drain:{replica}"),
            time=now,
            source=SOURCE,
            causation=decided_id,
            correlation=correlation,
        )
        return subjects.command_subject(node, "drain", self.root), e

    def _hold(
        self, tid: str, decided_id: str, correlation: str, h: ev.HoldSpec, now: datetime
    ) -> Output:
        e = ev.make(
            ev.HoldCreated(model=h.model, for_model=h.for_model, until=h.until),
            id=ids.derived(tid, f"hold:{h.model}"),
            time=now,
            source=SOURCE,
            causation=decided_id,
            correlation=correlation,
        )
        return subjects.decision_subject("hold.created", h.model, self.root), e

    async def _answered(
        self, view: View, trigger: ev.PlacementFailedEvent, trigger_seq: int, look: bool
    ) -> ev.PreemptionDecidedEvent | None:
        """The decision that already answers this trigger, if the log holds one: its own
        (published before a crash), or, when `look`, any later decision for its model.

        Its own is found by the view's record of recent decisions, which carries the
        stream sequence; with `look` also by the last decision on the model's subject,
        which answers the trigger if it was stored after it.
        """
        decided_id = ids.derived(trigger.id, "decided")
        rec = _find_decision(view.state.decisions, decided_id)
        try:
            if rec is not None:
                raw = await self.js.get_msg(subjects.STREAM, seq=rec.seq)
            elif look:
                subject = subjects.decision_subject(
                    "preemption.decided", trigger.data.model, self.root
                )
                raw = await self.js.get_last_msg(subjects.STREAM, subject)
                if raw.seq is None or raw.seq <= trigger_seq:
                    return None
            else:
                return None
        except nats.js.errors.NotFoundError:
            return None
        if raw.data is None:
            return None
        e = codec.decode(raw.data)
        return e if isinstance(e, ev.PreemptionDecidedEvent) else None

    def _missing(
        self, view: View, decided: ev.PreemptionDecidedEvent, now: datetime
    ) -> list[Output]:
        """The outputs of an earlier decision the view does not show yet.

        Published in order (decision, drains, holds) on one connection, a crash leaves a
        prefix of them stored: a drain is missing when its replica was never asked to stop;
        a hold when the view holds none from this decision and it could still matter (not
        expired, its model not yet given what it asked for).
        """
        tid = decided.data.trigger
        correlation = decided.correlation or tid
        d = decided.data
        out: list[Output] = []
        for v in d.victims:
            r = view.state.replicas.get(v.replica)
            if r is None or r.drained_by is not None or not r.holds_capacity or not r.shards:
                continue
            out.append(
                self._drain(
                    tid,
                    decided.id,
                    correlation,
                    v.replica,
                    v.model,
                    r.shards[0].node,
                    d.for_model,
                    now,
                )
            )
        for h in d.holds:
            held = view.state.holds.get(h.model)
            hold_id = ids.derived(tid, f"hold:{h.model}")
            if held is not None and held.created_by == hold_id:
                continue
            if now >= h.until or _satisfied(view, h.for_model):
                continue
            out.append(self._hold(tid, decided.id, correlation, h, now))
        return out

    # ------------------------------------------------------------------ holds

    async def release_holds(self) -> list[ev.Event]:
        """Publish `hold.released` for every hold in the view that ended; returns them."""
        view = self.follower.view
        now = self.clock()
        live = {h.created_by for h in view.state.holds.values()}
        self._released &= {ids.derived(c, "released") for c in live}
        out: list[Output] = []
        for h in list(view.state.holds.values()):
            rid = ids.derived(h.created_by, "released")
            if rid in self._released:
                continue
            if now >= h.until:
                reason = "expired"
            elif _satisfied(view, h.for_model):
                reason = "satisfied"
            else:
                continue
            e = ev.make(
                ev.HoldReleased(model=h.model, reason=reason),
                id=rid,
                time=now,
                source=SOURCE,
                causation=h.created_by,
            )
            out.append((subjects.decision_subject("hold.released", h.model, self.root), e))
        if not out or not self.is_leader:
            return []
        await self._publish(out)
        self._released.update(e.id for _, e in out)
        self.stats.holds_released += len(out)
        for _, e in out:
            assert isinstance(e, ev.HoldReleasedEvent)
            log.info("hold on %s released: %s", e.data.model, e.data.reason)
        return [e for _, e in out]

    # ------------------------------------------------------------------ plumbing

    async def _publish(self, outputs: Sequence[Output], *, decision: bool = False) -> None:
        """Publish in order, pipelined, and wait for every ack.

        Pipelined on one connection, the stream stores them in the order given, so a crash
        part way leaves a prefix stored (what `_missing` relies on).
        """
        if not outputs:
            return
        items = [(subj, codec.encode(e), e.id) for subj, e in outputs]
        if decision and faults.CRASH_AFTER_DECIDED in self.fault.points and len(items) > 1:
            # Only when armed: the decision alone first, so a crash leaves a decision
            # whose victims were never asked to stop.
            acks = await self.publisher.publish_many(items[:1])
            self._written = max(self._written, acks[0].seq)
            self.fault.hit(faults.CRASH_AFTER_DECIDED)
            items = items[1:]
        acks = await self.publisher.publish_many(items)
        self._written = max(self._written, *(a.seq for a in acks))

    async def _follow(self, seq: int) -> None:
        try:
            await self.follower.wait_for(seq, FOLLOW_TIMEOUT_S)
        except TimeoutError as e:
            raise Retry(1.0, f"view did not reach seq {seq} in {FOLLOW_TIMEOUT_S:g}s") from e

    async def _last_seq(self) -> int:
        info = await self.js.stream_info(subjects.STREAM)
        return int(info.state.last_seq)


def bounded(data: ev.PreemptionDecided) -> ev.PreemptionDecided:
    """The decision with its candidate and exclusion lists cut to the first SHOWN of each.

    `considered` keeps the whole count, and every victim and trial is among the first
    candidates, so the cut loses only replicas the policy never reached.
    """
    if len(data.candidates) <= SHOWN and len(data.excluded) <= SHOWN:
        return data
    return msgspec.structs.replace(
        data, candidates=data.candidates[:SHOWN], excluded=data.excluded[:SHOWN]
    )


def _find_decision(records: list[DecisionRecord], decision_id: str) -> DecisionRecord | None:
    for r in reversed(records):
        if r.id == decision_id:
            return r
    return None


def _satisfied(view: View, for_model: str) -> bool:
    """Whether the model a hold was given to has what it asked for (`View.active_hold`'s
    early end)."""
    to = view.catalog.resolve(for_model)
    return to is not None and view.live_count(to.name) >= view.desired_for(to.name)


async def _first(stop: asyncio.Event, other: asyncio.Event) -> bool:
    """Wait for `other` or `stop`; whether it was `other`."""
    if other.is_set():
        return True
    a = asyncio.create_task(stop.wait())
    b = asyncio.create_task(other.wait())
    try:
        await asyncio.wait({a, b}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        a.cancel()
        b.cancel()
    return other.is_set() and not stop.is_set()


async def _set_when_any(target: asyncio.Event, *events: asyncio.Event) -> None:
    tasks = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        target.set()
    finally:
        for t in tasks:
            t.cancel()
