"""The preemption service's reactions, as the events it publishes.

Called by `services.preemption.service` for each `placement.failed` and on each tick;
tests call it directly. `react` answers one trigger: the policy's decision (from
`services.core.policy.plan`) and the events it is published as, or, when the log
already holds a decision for the trigger, only what that decision left unpublished.
`releases` says which holds ended, as `hold.released` events. No I/O, no clock: the
shell fetches the earlier decision, if any, passes `now`, and publishes what it gets.

Every id derives from the trigger's (or the hold's), so the same reaction is the same
events, and JetStream's duplicate window drops a repeat.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import msgspec

from schemas import events as ev
from schemas import ids
from schemas.events import DRAIN_GRACE_S
from services.core import policy
from services.core.policy.decision import LISTED
from services.core.view import View

SOURCE = "preemption"

# SHOWN bounds the candidates and exclusions a published decision lists: the decision's
# own list (`policy.decision.LISTED`). On a full cluster the policy weighs every replica:
# 1,600 one-GPU replicas made a 181 KB event, and past about 2,300 it would exceed the
# largest event the codec accepts, be dead-lettered by every follower, and leave the view
# without the decision, so the next trigger would stop a second set of victims.
SHOWN = LISTED

Outgoing = tuple[ev.Event, str | None]
"""An event to publish, and the node whose command subject it goes on (drains only)."""

Kind = Literal["decided", "completed", "superseded", "ignored"]


@dataclass(frozen=True, slots=True)
class Reaction:
    """What to publish for one trigger, and why.

    kind: decided (a new decision), completed (the trigger's own decision was already
      stored; `events` is what it had not published yet), superseded (a later trigger's
      decision answers it; nothing to publish), ignored (not a no_fit; nothing to decide).
    """

    kind: Kind
    events: tuple[Outgoing, ...] = ()
    decision: policy.Decision | None = None
    earlier: ev.PreemptionDecidedEvent | None = None


def react(
    view: View,
    trigger: ev.PlacementFailedEvent,
    now: datetime,
    config: policy.Config,
    *,
    answered: ev.PreemptionDecidedEvent | None = None,
    drain_grace_s: float = DRAIN_GRACE_S,
    engine: policy.Engine[Any, Any] | None = None,
) -> Reaction:
    """The reaction to `trigger` on `view` at `now`; `engine` works the policy's answers
    out (the caller's own, see `policy.engine_of`; when None, a new one of the kind
    `config.engine` names).

    `answered` is a decision the log already holds for the trigger's model, stored after
    the trigger: its own (published before a crash) or a later trigger's.
    """
    if not answers(trigger):
        return Reaction("ignored")
    if answered is not None and answered.data.trigger != trigger.id:
        # A later trigger for the same model was decided on a newer view: that decision
        # answers this one too. Deciding again would stop more victims.
        return Reaction("superseded", earlier=answered)
    if answered is not None:
        return Reaction("completed", missing(view, answered, now, drain_grace_s), earlier=answered)
    decision = policy.plan(
        view,
        trigger.data.model,
        now,
        config,
        avoid=trigger.data.avoid,
        engine=engine,
    )
    return Reaction(
        "decided", decision_events(trigger, decision, now, drain_grace_s), decision=decision
    )


def answers(trigger: ev.PlacementFailedEvent) -> bool:
    """Whether the policy answers this trigger: only a model that did not fit. For
    quota_limit and other reasons the owner is past a limit, which stopping other
    replicas cannot lift: nothing to decide, nothing to record."""
    return trigger.data.reason == "no_fit"


def decision_events(
    trigger: ev.PlacementFailedEvent,
    decision: policy.Decision,
    now: datetime,
    drain_grace_s: float = DRAIN_GRACE_S,
) -> tuple[Outgoing, ...]:
    """The events a decision is published as, in order: the decision, the drains, the
    holds. Ids derive from the trigger's, so the same decision is the same events."""
    tid = trigger.id
    correlation = trigger.correlation or tid
    ms = ids.kept_ms(tid)  # every id of the reaction derives from the trigger's
    decided_id = ids.derived(tid, "decided", ms)
    data = bounded(decision.to_event_data(tid, SHOWN))
    reason = decided_reason(trigger, decision)
    if reason != data.reason:
        data = msgspec.structs.replace(data, reason=reason)
    decided = ev.make(
        data,
        id=decided_id,
        time=now,
        source=SOURCE,
        causation=tid,
        correlation=correlation,
    )
    mk = _Maker(tid, decided_id, correlation, now, ms)
    return (
        (decided, None),
        *(
            mk.drain(v.replica, v.model, node, decision.model, drain_grace_s, i == 0)
            for v in decision.victims
            for i, node in enumerate(v.nodes or (v.node,))
        ),
        *(mk.hold(h) for h in decision.holds),
    )


# REASON_MAX bounds the published reason: the trigger's per-profile reasons can be long,
# and the contract's text is 4 KiB at most.
REASON_MAX = 1000


def decided_reason(trigger: ev.PlacementFailedEvent, decision: policy.Decision) -> str:
    """The decision's reason as published. A `fits` is no success: the placement it
    answers failed although the room is there (the scheduler held the model back, as a
    node backs off after failed starts), so it says that nothing was stopped and what
    the placement failed on, which no preemption can fix."""
    reason = decision.reason
    if decision.outcome == "fits":
        why = "; ".join(dict.fromkeys(trigger.data.why.values())) or trigger.data.reason
        reason = f"no preemption, nothing stopped ({reason}); still not placed: {why}"
    return reason if len(reason) <= REASON_MAX else reason[: REASON_MAX - 1] + "~"


def missing(
    view: View,
    decided: ev.PreemptionDecidedEvent,
    now: datetime,
    drain_grace_s: float = DRAIN_GRACE_S,
) -> tuple[Outgoing, ...]:
    """The events of an earlier decision the view does not show yet.

    Published in order (decision, drains, holds) on one connection, a crash leaves a
    prefix of them stored: a drain is missing when its replica's node was never asked to
    stop it (a gang's drains are one per shard's node, and a crash can fall between
    them: `ReplicaRecord.drained_on`); a hold when the view holds none from this
    decision and it could still matter (it has not ended by `View.hold_end`'s rule).
    """
    tid = decided.data.trigger
    d = decided.data
    mk = _Maker(tid, decided.id, decided.correlation or tid, now)
    out: list[Outgoing] = []
    for v in d.victims:
        r = view.state.replicas.get(v.replica)
        if r is None or not r.holds_capacity or not r.shards:
            continue
        if r.drained_by is not None and not r.drained_on:
            continue  # asked, on a node the view was not told (folded without subjects)
        for i, node in enumerate(r.nodes):
            if node not in r.drained_on:
                out.append(mk.drain(v.replica, v.model, node, d.for_model, drain_grace_s, i == 0))
    for h in d.holds:
        held = view.state.holds.get(h.model)
        if held is not None and held.created_by == mk.hold_id(h.model):
            continue
        if view.hold_end(h.for_model, h.until, now) is not None:
            continue
        out.append(mk.hold(h))
    return tuple(out)


def releases(
    view: View, now: datetime, *, pending: Container[str] = ()
) -> list[ev.HoldReleasedEvent]:
    """A `hold.released` for every hold in the view that has ended by `View.hold_end`,
    its id derived from the hold's; those whose id is in `pending` (sent, not yet folded)
    are left out."""
    out: list[ev.HoldReleasedEvent] = []
    for h in view.state.holds.values():
        rid = ids.derived(h.created_by, "released")
        if rid in pending:
            continue
        reason = view.hold_end(h.for_model, h.until, now)
        if reason is None:
            continue
        e = ev.make(
            ev.HoldReleased(model=h.model, reason=reason),
            id=rid,
            time=now,
            source=SOURCE,
            causation=h.created_by,
        )
        assert isinstance(e, ev.HoldReleasedEvent)
        out.append(e)
    return out


def bounded(data: ev.PreemptionDecided) -> ev.PreemptionDecided:
    """The decision with its candidate and exclusion lists cut to the first SHOWN of each,
    and the victims past them (`policy.listed`).

    `considered` keeps the whole count. The reference's victims and trials are among the
    first candidates, so the cut loses only replicas it never reached; node-aware's
    victims can be anywhere in the order, and are kept after the first SHOWN. A
    decision's events make their data with only those listed (`Decision.to_event_data`'s
    `shown`), rather than convert every candidate to cut most of them here.
    """
    if len(data.candidates) <= SHOWN and len(data.excluded) <= SHOWN:
        return data
    victims = {v.replica for v in data.victims}
    return msgspec.structs.replace(
        data,
        candidates=tuple(policy.listed(data.candidates, victims, SHOWN)),
        excluded=data.excluded[:SHOWN],
    )


class _Maker:
    """Makes the drains and holds of one decision, stamped with its ids and time. `ms`:
    the trigger's `ids.kept_ms`, when the caller has it already."""

    __slots__ = ("correlation", "decided_id", "ms", "now", "tid")

    def __init__(
        self, tid: str, decided_id: str, correlation: str, now: datetime, ms: int | None = None
    ) -> None:
        self.tid = tid
        self.decided_id = decided_id
        self.correlation = correlation
        self.now = now
        self.ms = ids.kept_ms(tid) if ms is None else ms

    def drain(
        self,
        replica: str,
        model: str,
        node: str,
        for_model: str,
        grace_s: float,
        first: bool = True,
    ) -> Outgoing:
        e = ev.make(
            ev.ReplicaDrain(
                replica=replica,
                model=model,
                reason="preempted",
                for_model=for_model,
                grace_s=grace_s,
            ),
            # A gang's shards past the first each have their own drain, named by node.
            id=ids.derived(self.tid, f"drain:{replica}" + ("" if first else f":{node}"), self.ms),
            time=self.now,
            source=SOURCE,
            causation=self.decided_id,
            correlation=self.correlation,
        )
        return e, node

    def hold_id(self, model: str) -> str:
        return ids.derived(self.tid, f"hold:{model}", self.ms)

    def hold(self, h: ev.HoldSpec) -> Outgoing:
        e = ev.make(
            ev.HoldCreated(model=h.model, for_model=h.for_model, until=h.until),
            id=self.hold_id(h.model),
            time=self.now,
            source=SOURCE,
            causation=self.decided_id,
            correlation=self.correlation,
        )
        return e, None
