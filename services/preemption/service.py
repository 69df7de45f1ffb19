"""The preemption service: reacts to `placement.failed` with a decision, drains and holds.

Run by `llmgw up` and by `python -m services.preemption`, one or more at a time: a lease
in a JetStream KV bucket picks the one that acts, the others stand by warm (their views
followed, nothing pulled). The leader pulls `<root>.placement.failed.>` through one
durable consumer with explicit acks, and for each trigger with reason `no_fit`:

1. waits until its view has folded the log at least up to the trigger (and up to its
   own last publish), so it never decides on a stale view;
2. asks the core, `services.core.reaction.react`, which takes the policy's decision
   and returns the events to publish: `preemption.decided`, then a `replica.drain` per
   victim on the victim's node, then a `hold.created` per victim model, every id derived
   from the trigger's id;
3. publishes them, in order;
4. acks.

A crash anywhere before the ack gets the trigger redelivered. Within JetStream's
duplicate window the same ids make every repeat a duplicate the stream drops; past it,
a redelivered trigger whose decision the view already holds is not decided again: the
outputs of that decision the view does not show yet are published, and nothing else.

A trigger that may have been seen before (redelivered, or in the backlog found on
taking the lead) is checked against the log first: if a decision for its model was
stored after it, that decision answers it (its own: completed; a later trigger's: the
trigger is acked with nothing published).

On taking the lead it records its settings (the policy's and the drain grace) as a
`policy.configured`, unless the last one in the log holds the same
(`services.preemption.settings`); replay and `llmgw preemption plan` decide with them.
A failed attempt is tried again on the next tick.

On a tick the leader also publishes `hold.released` for every hold that ended
(`services.core.reaction.releases`, by `View.hold_end`'s rule), its id derived from
the hold's.

The lease, the follower, the own-writes watermark and the publishing are
`services.plane.leader.Leader`'s, shared with the scheduler.

It must not decide anything itself (that is the policy's), must not fold differently
from `services.core.fold`, and must not publish while it does not hold the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import codec, ids, subjects
from schemas import events as ev
from schemas.errors import EventDecodeError
from services.bus import Permanent, Retry
from services.bus.consume import Delivery, consume_durable, decode_checked
from services.clock import utc_now
from services.core import policy, reaction
from services.core.view import DecisionRecord, View
from services.plane.follower import ViewFollower
from services.plane.leader import Leader, LeaseLapsed, Outgoing
from services.preemption import fault as faults
from services.preemption import settings
from services.preemption.config import Config

log = logging.getLogger("llmgw.preemption")


# NOT_LEADER_RETRY_S is how long a message fetched by a leader that has since lost its
# lease waits before it is delivered again. Short: the new leader should have it at once;
# it still counts as a delivery, so max_deliver bounds how often leadership may flap.
NOT_LEADER_RETRY_S = 0.2

# FOLLOW_TIMEOUT_S bounds the wait for the view to reach a trigger. Past it the trigger
# is retried rather than decided on a view that may not hold what led to it.
FOLLOW_TIMEOUT_S = 10.0

# RETRY_PAUSE_S is the wait before setting the consumer up again after the broker failed.
RETRY_PAUSE_S = 0.5


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


class PreemptionService:
    """One preemption service process; see the module docstring."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        *,
        root: str = subjects.DEFAULT_ROOT,
        config: Config | None = None,
        clock: Callable[[], datetime] = utc_now,
        holder: str | None = None,
        fault: faults.Fault | str | None = None,
        follower: ViewFollower | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.root = root
        self.config = config if config is not None else Config()
        self.policy = self.config.policy
        self.clock = clock
        # fault None: nothing armed (only a crash test arms one).
        self.fault = fault if isinstance(fault, faults.Fault) else faults.Fault(fault)
        self.leader = Leader(
            js,
            role="preemption",
            root=root,
            holder=holder,
            ttl_s=self.config.lease_ttl_s,
            follower=follower,
            consumer=f"{self.config.durable}-view",
        )
        self.holder = self.leader.holder
        self.follower = self.leader.follower
        self.lease = self.leader.lease
        # _backlog is the stream's last sequence when this process last took the lead:
        # triggers up to it may have been answered by a leader before us.
        self._backlog = 0
        # _released holds the ids of hold.released events sent and not yet folded, so a
        # tick does not send one again while the view catches up.
        self._released: set[str] = set()
        # _recorded: this term's settings are in the log (recorded, or found there).
        self._recorded = False
        self.consuming = False
        # engine: how the policy works its answers out, this service's own, of the kind
        # its config names (`--policy-engine`: fast by default, kept current with the
        # follower's view; plain; checked, the spec beside it on every call).
        self.engine = policy.engine_of(self.policy.engine)
        """True while leading with its backlog noted and its trigger consumer running: a
        trigger stored from then on is new to this term, not a backlog to look up."""
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
        release holds, until `stop` is set (see `Leader.run` for how it stops)."""
        await self.leader.run(stop, self._lead, self._tick)

    async def _lead(self, stop: asyncio.Event) -> None:
        """Pull triggers while leading; stand by (pulling nothing) while not."""
        while not stop.is_set():
            if not await _first(stop, self.leader.leading):
                return
            log.info("preemption %s: leading; consuming placement.failed", self.holder)
            self._recorded = False
            await self.record_settings()
            inner = asyncio.Event()
            watcher = asyncio.create_task(_set_when_any(inner, stop, self.leader.deposed))
            try:
                self._backlog = await self.leader.last_seq()
                self.consuming = True
                await consume_durable(
                    self.js,
                    durable=self.config.durable,
                    filter_subject=f"{self.root}.placement.failed.>",
                    handler=self.handle,
                    stop=inner,
                    batch=16,
                    ack_wait_s=self.config.ack_wait_s,
                    max_deliver=self.config.max_deliver,
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
                self.consuming = False
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            if not stop.is_set():
                log.info("preemption %s: lease lost; standing by", self.holder)

    async def _tick(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.tick_s)
            if stop.is_set():
                return
            # The engine follows the view between triggers, leader or standby: a
            # trigger then pays for what changed since the last tick, not for what
            # changed since the last decision (or, the first time, for every replica).
            self.engine.follow(self.follower.view)
            if self.is_leader:
                self.stats.ticks += 1
                if not self._recorded:
                    await self.record_settings()
                try:
                    await self.release_holds()
                except Exception as e:
                    log.warning("preemption: releasing holds failed: %s: %s", type(e).__name__, e)

    # ------------------------------------------------------------------ triggers

    async def handle(self, d: Delivery) -> None:
        """Handle one `placement.failed`: decode, wait for the view, ask the core,
        publish; returning acks it."""
        event = decode_checked(d, self.root)
        if not isinstance(event, ev.PlacementFailedEvent):
            raise Permanent(f"a {subjects.type_tag(event)} on the placement.failed subject")
        if not reaction.answers(event):
            self.stats.ignored += 1
            return
        if not self.is_leader:
            raise Retry(NOT_LEADER_RETRY_S, "not the leader any more")
        # Look in the log for an answer already given when the trigger may have been seen
        # before: redelivered, or from the backlog this process found when it took the
        # lead (a dead leader's unacked work, or a log older than the consumer).
        look = d.delivered > 1 or d.seq <= self._backlog
        target = d.seq
        if look:
            # An earlier attempt may have published its decision after the trigger; the
            # view must hold it before we look.
            target = max(target, await self.leader.last_seq())
        try:
            await self.leader.caught_up(target, FOLLOW_TIMEOUT_S)
        except TimeoutError as e:
            raise Retry(1.0, f"view did not reach seq {target} in {FOLLOW_TIMEOUT_S:g}s") from e
        view = self.follower.view
        answered = await self._answered(view, event, d.seq, look)
        try:
            r = reaction.react(
                view,
                event,
                self.clock(),
                self.policy,
                answered=answered,
                drain_grace_s=self.config.drain_grace_s,
                engine=self.engine,
            )
        except policy.PolicyMismatch as e:
            # --policy-engine checked: a difference stops the service, in one line.
            log.critical("%s", e)
            raise SystemExit(f"llmgw preemption: {e}") from None
        self._count(event, r)
        if not self.is_leader:
            raise Retry(NOT_LEADER_RETRY_S, "lost the lease while deciding")
        await self._publish(r.events, decision=True)
        self.fault.hit(faults.CRASH_BEFORE_ACK)

    def _count(self, trigger: ev.PlacementFailedEvent, r: reaction.Reaction) -> None:
        if r.kind == "superseded" and r.earlier is not None:
            self.stats.superseded += 1
            log.info(
                "preemption for %s: trigger %s already answered by %s",
                trigger.data.model,
                trigger.id,
                r.earlier.id,
            )
        elif r.kind == "completed" and r.earlier is not None:
            self.stats.republished += 1
            log.info(
                "preemption for %s: trigger %s came back; its decision %s stands, "
                "%d output(s) it had not published yet",
                r.earlier.data.for_model,
                trigger.id,
                r.earlier.id,
                len(r.events),
            )
        elif r.decision is not None:
            d = r.decision
            self.stats.decided += 1
            self.stats.outcomes[d.outcome] = self.stats.outcomes.get(d.outcome, 0) + 1
            said = reaction.decided_reason(trigger, d)
            if d.outcome == "fits":
                log.info("preemption for %s: %s", d.model, said)
            else:
                log.info("preemption for %s: %s: %s", d.model, d.outcome, said)

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

    # ------------------------------------------------------------------ settings

    async def record_settings(self) -> ev.Event | None:
        """Publish this service's settings unless the log's last record holds them;
        returns what was published. Failures are logged, and tried again on a tick."""
        try:
            last = await self._last_settings()
            out = settings.record(self.config, last, self.clock(), self.holder)
            if out is None:
                self._recorded = True
                return None
            if not self.is_leader:
                return None
            await self.leader.publish([(out, None)])
        except (nats.errors.Error, TimeoutError, LeaseLapsed) as e:
            log.warning(
                "preemption %s: recording its settings: %s: %s", self.holder, type(e).__name__, e
            )
            return None
        self._recorded = True
        log.info(
            "preemption %s: recorded its settings: %s",
            self.holder,
            _shown(settings.settings_of(self.config)),
        )
        return out

    async def _last_settings(self) -> ev.PolicyConfiguredEvent | None:
        """The last `policy.configured` in the log, as the server says now."""
        try:
            raw = await self.js.get_last_msg(subjects.STREAM, subjects.policy_subject(self.root))
        except nats.js.errors.NotFoundError:
            return None
        if raw.data is None:
            return None
        try:
            e = codec.decode(raw.data)
        except EventDecodeError:
            # A record that does not decode is no record: ours replaces it.
            return None
        return e if isinstance(e, ev.PolicyConfiguredEvent) else None

    # ------------------------------------------------------------------ holds

    async def release_holds(self) -> list[ev.Event]:
        """Publish `hold.released` for every hold in the view that ended; returns them."""
        view = self.follower.view
        live = {h.created_by for h in view.state.holds.values()}
        self._released &= {ids.derived(c, "released") for c in live}
        out = reaction.releases(view, self.clock(), pending=self._released)
        if not out or not self.is_leader:
            return []
        await self._publish([(e, None) for e in out])
        self._released.update(e.id for e in out)
        self.stats.holds_released += len(out)
        for e in out:
            log.info("hold on %s released: %s", e.data.model, e.data.reason)
        return list(out)

    # ------------------------------------------------------------------ plumbing

    async def _publish(self, outputs: Sequence[Outgoing], *, decision: bool = False) -> None:
        """Publish in order through the leader; a lapsed lease is a retry."""
        items = list(outputs)
        try:
            points = self.fault.points
            if decision and faults.CRASH_AFTER_DECIDED in points and len(items) > 1:
                # Only when armed: the decision alone first, so a crash leaves a decision
                # whose victims were never asked to stop.
                await self.leader.publish(items[:1])
                self.fault.hit(faults.CRASH_AFTER_DECIDED)
                items = items[1:]
            elif decision and faults.CRASH_AFTER_FIRST_DRAIN in points and len(items) > 2:
                # Only when armed: the decision and its first drain, so a crash leaves a
                # gang asked to stop on one of its nodes only.
                await self.leader.publish(items[:2])
                self.fault.hit(faults.CRASH_AFTER_FIRST_DRAIN)
                items = items[2:]
            await self.leader.publish(items)
        except LeaseLapsed as e:
            raise Retry(NOT_LEADER_RETRY_S, str(e)) from e


def _shown(s: ev.PolicyConfigured) -> str:
    return (
        f"hold {s.hold_s:g}s, grace {s.eviction_grace_s:g}s, min-lifetime "
        f"{s.min_lifetime_s:g}s, max-victims {s.max_victims}, drain-grace {s.drain_grace_s:g}s, "
        f"policy {s.policy}, engine {s.engine or '-'}"
    )


def _find_decision(records: list[DecisionRecord], decision_id: str) -> DecisionRecord | None:
    for r in reversed(records):
        if r.id == decision_id:
            return r
    return None


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
