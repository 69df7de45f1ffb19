"""The autoscaler: how many replicas an on-demand model (min 0) should have, from the
gateway's demand and its replicas' use.

Called by the scheduler service before each pass (`services.scheduler.service`) and by
the simulator (`services.sim.engine`), which publish what it decides as `scale.desired`
and fold it before placing. A plain function of a view and the time `now`: no I/O, no
clock, nothing kept between calls. It never changes the view.

The rules, for each declared model with min 0 and a max above 0, in this order (the
first that applies decides; docs/contract.md, "On-demand models"):

1. demand: its last `model.demanded` says requests wait and no `scale.desired` has
   answered it. Desired 0 -> enough replicas for the waiting and in-flight requests at
   `target_inflight` each, at least 1, at most `max`. Desired above 0 by the autoscaler
   -> that many when it is more than now; never fewer for demand. An operator's count
   (a `scale.desired` without a reason) is left as it is.
2. idle: desired above 0, and no request for `idle_after_s` -> 0. "No request" counts
   from the latest of its replicas' last use (`replica.used`, the gateway's and the
   agents') and first ready, its last demand, and its last `scale.desired`: a model just
   woken, or still loading, is not idle before it had a chance to serve. This rule
   applies to an operator's count too: the model is the autoscaler's again after it.

Every decision's id is derived from the event that triggered it (the demand, or the
last `scale.desired` and the time of the last activity), so a scheduler that crashed
between deciding and publishing, or two that decide on the same view, publish the same
id, and JetStream's duplicate window stores it once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime

from schemas import events as ev
from schemas import ids
from services.core.view import DemandRecord, View, after

SOURCE = "autoscaler"

RULES = ("demand", "idle")


@dataclass(frozen=True, slots=True)
class Decision:
    """One model's new desired count, why, and the event to publish it with."""

    model: str
    replicas: int
    rule: str
    """`demand` or `idle` (RULES)."""
    reason: str
    trigger: str
    """Id of the event it answers: the demand, or the last scale.desired (idle)."""
    event: ev.ScaleDesiredEvent


@dataclass(slots=True)
class Result:
    decisions: list[Decision] = field(default_factory=list)
    next_due: datetime | None = None
    """When the idle rule may next decide something with nothing else happening: the
    earliest moment a model awake now goes idle. None: no model is awake."""


def clock(t: datetime) -> str:
    """HH:MM:SS in UTC: how a reason names a time."""
    return t.astimezone(UTC).strftime("%H:%M:%S")


def span(seconds: float) -> str:
    """`45s`, `15m`, `1h30m`, `2d`: how a reason names a length of time."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        m, r = divmod(s, 60)
        return f"{m}m{r}s" if r else f"{m}m"
    if s < 86400:
        h, m = divmod(s // 60, 60)
        return f"{h}h{m}m" if m else f"{h}h"
    d, h = divmod(s // 3600, 24)
    return f"{d}d{h}h" if h else f"{d}d"


def needed(waiting: int, inflight: int, target: int, most: int) -> int:
    """Replicas for `waiting` + `inflight` requests at `target` each: at least 1, at
    most `most`."""
    return min(most, max(1, math.ceil((waiting + inflight) / target)))


def demand_reason(d: DemandRecord) -> str:
    words = f"demand: {d.waiting} waiting since {clock(d.since)}"
    return words + (f", {d.inflight} in flight" if d.inflight else "")


def last_activity(view: View, name: str) -> datetime | None:
    """The latest sign that model `name` (declared) was wanted: its replicas' last use
    and first ready, its last demand, its last scale.desired. None: none of them."""
    s = view.state
    m = view.catalog.resolve(name)
    names = view.catalog.names_of(m) if m is not None else (name,)
    times: list[datetime] = []
    for n in names:
        for r in view.current_of(n):
            if r.last_used_at is not None:
                times.append(r.last_used_at)
            if r.ready_at is not None:
                times.append(r.ready_at)
    dem = s.demand.get(name)
    if dem is not None:
        times.append(dem.at)
    sc = s.scaled.get(name)
    if sc is not None:
        times.append(sc.at)
    return max(times) if times else None


def decide(view: View, now: datetime, *, source: str = SOURCE) -> Result:
    """What the autoscaler decides on `view` at `now` (see the module's docstring)."""
    out = Result()
    s = view.state
    for d in s.models.values():
        if d.min != 0:
            continue
        m = view.catalog.resolve(d.name)
        if m is None or m.name != d.name:
            continue
        most = d.effective_max
        if most <= 0:
            continue
        name = d.name
        desired = view.desired_of(m)
        scaled = s.scaled.get(name)
        by_hand = scaled is not None and scaled.by_hand and desired > 0
        dem = s.demand.get(name)
        if dem is not None and dem.waiting > 0 and dem.answered_by is None and not by_hand:
            want = needed(dem.waiting, dem.inflight, d.effective_target_inflight, most)
            if want > desired:
                reason = demand_reason(dem)
                eid = ids.derived(dem.id, f"autoscale\x00{name}\x00{want}")
                out.decisions.append(
                    _decision(name, want, "demand", reason, dem.id, eid, now, source)
                )
                continue
        if desired <= 0:
            continue
        last = last_activity(view, name)
        if last is None:
            continue
        due = after(last, d.idle_after_s)
        if now < due:
            if out.next_due is None or due < out.next_due:
                out.next_due = due
            continue
        parent = scaled.id if scaled is not None else name
        eid = ids.derived(parent, f"idle\x00{name}\x00{last.isoformat()}")
        out.decisions.append(
            _decision(name, 0, "idle", f"idle {span(d.idle_after_s)}", parent, eid, now, source)
        )
    return out


def _decision(
    model: str,
    replicas: int,
    rule: str,
    reason: str,
    trigger: str,
    eid: str,
    now: datetime,
    source: str,
) -> Decision:
    e = ev.ScaleDesiredEvent(
        id=eid,
        time=now,
        source=source,
        causation=trigger,
        correlation=trigger if rule == "demand" else None,
        data=ev.ScaleDesired(model=model, replicas=replicas, reason=reason),
    )
    return Decision(
        model=model, replicas=replicas, rule=rule, reason=reason, trigger=trigger, event=e
    )
