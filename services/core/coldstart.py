"""How long a model takes to be ready, and whether it can be placed at all: what the
gateway's waiting room tells a request held for a model that has no replica to serve it.

Pure: reads the folded view and takes `now`; no I/O, no clock. Called by
`services.gateway` when a request must wait (to bound its wait and to say when to come
back) and when a decision about the model is folded (to refuse the held requests of a
model the plane has said it cannot place).

The prediction is the log's own: each replica's seconds from its placement to its first
ready (`View.load_times`), the median of the model's latest `HISTORY`, times `MARGIN`. A
model that was never ready here has no history, and gets `DEFAULT_READY_S`: a 70B
model's cold start takes 3.5 to 5 minutes, and a bound shorter than the start turns every
held request into a refusal the moment before it would have been served.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from datetime import datetime

from services.core import catalog
from services.core.view import DecisionRecord, View

# DEFAULT_READY_S bounds a wait for a model with no start in the log: ten minutes, past
# the cold start of the largest models (vLLM #19824, #44881), and what a client told to
# retry later is told.
DEFAULT_READY_S = 600.0
# MARGIN multiplies the model's typical start into the bound of a wait: a start a little
# slower than the median is still waited for, one far slower is refused rather than held
# for ever.
MARGIN = 1.5
# HISTORY is how many of the model's latest starts the median is taken over: enough that
# one slow start does not move it, few enough that a model moved to faster hosts is
# predicted by its new starts within a day.
HISTORY = 20

# FAILED are the outcomes of a `preemption.decided` that leave the model unplaced: the
# policy looked and found nothing it may do. Any other outcome (fits, preempted,
# awaiting) is on the way to a replica, and a held request waits for it.
FAILED = frozenset({"no_fit", "no_candidates", "quota_limit", "held"})

# _DECISIONS are the decision types whose latest record says where a model's placement
# stands: placed (a replica is on its way), failed (the policy will answer), or the
# policy's answer.
_DECISIONS = frozenset({"placement.decided", "placement.failed", "preemption.decided"})


@dataclass(frozen=True)
class Outlook:
    """When a model is expected to be ready, seen from `now`."""

    typical_s: float | None
    """The median of its latest starts (placement to first ready); None: none in the log."""
    remaining_s: float
    """Seconds until a replica is expected ready: the typical start less what the
    youngest starting replica has already spent (never under 1), or the default."""
    bound_s: float
    """How long a request may wait for it: the typical start times MARGIN (at least
    `floor_s`), or DEFAULT_READY_S with no history."""

    @property
    def retry_after(self) -> int:
        """`remaining_s` as a Retry-After: whole seconds, at least 1."""
        return max(1, math.ceil(self.remaining_s))


@dataclass(frozen=True)
class Unplaceable:
    """A model the plane has said it cannot place now, and why, for an operator."""

    code: str
    """The x-llmgw-reason: held, quota_limit, no_fit, no_candidates."""
    reason: str
    """The same in words, from the decision that said it."""
    retry_after_s: float | None = None
    """Seconds until the hold keeping it off ends; None when no end is known."""


def typical_start_s(view: View, m: catalog.Model) -> float | None:
    """The median seconds from placement to first ready of the latest HISTORY starts of
    `m` (under its name or an alias); None when it never was ready here."""
    loads = view.load_times()
    got: list[float] = []
    for name in view.catalog.names_of(m):
        got.extend(loads.get(name, ()))
    if not got:
        return None
    # Each name's list is in the order its starts were folded; with aliases the latest
    # of each is taken, which is all a rename leaves.
    return float(statistics.median(got[-HISTORY:]))


def outlook(view: View, m: catalog.Model, now: datetime, *, floor_s: float = 0.0) -> Outlook:
    """When `m` is expected to be ready (see `Outlook`)."""
    typical = typical_start_s(view, m)
    if typical is None:
        return Outlook(typical_s=None, remaining_s=DEFAULT_READY_S, bound_s=DEFAULT_READY_S)
    remaining = typical
    for name in view.catalog.names_of(m):
        for r in view.current_of(name):
            if r.live and r.state != "ready":
                spent = (now - r.created_at).total_seconds()
                remaining = min(remaining, max(typical - spent, 1.0))
    return Outlook(typical_s=typical, remaining_s=remaining, bound_s=max(typical * MARGIN, floor_s))


def unplaceable(view: View, m: catalog.Model, now: datetime, since: datetime) -> Unplaceable | None:
    """Why `m` cannot be placed now, or None while it can or may yet be.

    A model kept off by a hold (it gave up room for another model) cannot be placed until
    the hold ends, and the hold says when. Otherwise the model's latest placement
    decision speaks: a `preemption.decided` that found nothing to do (FAILED) says it
    cannot, if the plane was already trying (its desired count above its live one) or the
    decision came at or after `since` (when the requests now waiting began to wait). A
    failure from before the waiting, of a model asked for no replica, is old news: the
    demand is what asks again.
    """
    hold = view.active_hold(m.name, now)
    if hold is not None:
        return Unplaceable(
            code="held",
            reason=f"{m.name} gave up its room for {hold.for_model} and is held off it "
            f"until {hold.until:%H:%M:%S} UTC",
            retry_after_s=max((hold.until - now).total_seconds(), 0.0),
        )
    names = set(view.catalog.names_of(m))
    last: DecisionRecord | None = None
    for d in reversed(view.state.decisions):
        if d.type in _DECISIONS and d.model in names:
            last = d
            break
    if last is None or last.type != "preemption.decided" or last.outcome not in FAILED:
        return None
    if last.time < since and view.desired_of(m) <= view.live_of(m):
        return None
    return Unplaceable(code=last.outcome, reason=_words(view, m, last))


@dataclass(frozen=True)
class Stranded:
    """A model whose replicas sit on lost nodes within their grace: the plane counts them
    live (their agents may still serve them), so it places no other, and the gateway
    sends them nothing. It serves again when a node is back, or once the grace has ended
    (the replicas fail and a new one is placed), and not before."""

    nodes: tuple[str, ...]
    """The lost nodes its live replicas have a shard on, by name."""
    reason: str
    """Why the first of them was lost (`node.lost`'s reason)."""
    until: datetime | None
    """When the first of their graces ends; None when none has one running."""
    remaining_s: float
    """Seconds until a new replica is expected ready: the grace's rest, then a start
    (`outlook` with no replica starting)."""

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self.remaining_s))

    def words(self, model: str, now: datetime) -> str:
        which = ", ".join(self.nodes)
        node = "node" if len(self.nodes) == 1 else "nodes"
        said = f"{model} is not routed: its replicas are on {node} {which}, lost ({self.reason})"
        if self.until is None:
            return said
        left = max((self.until - now).total_seconds(), 0.0)
        return (
            f"{said}; they fail at {self.until:%H:%M:%S} UTC (in {left:.0f}s) unless "
            f"{which} {'is' if len(self.nodes) == 1 else 'are'} back, and a new one should "
            f"be ready about {self.retry_after}s from now"
        )


def stranded(view: View, m: catalog.Model, now: datetime) -> Stranded | None:
    """The lost nodes `m` waits on (see `Stranded`), or None: when it has a replica to
    route to, or a live one on no lost node (starting or loading: it will serve)."""
    nodes = view.state.nodes
    lost: dict[str, str] = {}
    until: datetime | None = None
    for name in view.catalog.names_of(m):
        for r in view.current_of(name):
            if not r.live:
                continue
            mine = [s.node for s in r.shards if (n := nodes.get(s.node)) is not None and n.lost]
            if not mine:
                return None
            for node in mine:
                rec = nodes[node]
                lost.setdefault(node, rec.lost_reason or "lost")
                if rec.failing_at is not None and (until is None or rec.failing_at < until):
                    until = rec.failing_at
    if not lost:
        return None
    grace = max((until - now).total_seconds(), 0.0) if until is not None else 0.0
    typical = typical_start_s(view, m)
    start = DEFAULT_READY_S if typical is None else typical
    first = sorted(lost)[0]
    return Stranded(
        nodes=tuple(sorted(lost)), reason=lost[first], until=until, remaining_s=grace + start
    )


def _words(view: View, m: catalog.Model, d: DecisionRecord) -> str:
    """What a failed placement decision means for `m`, with the scheduler's reasons."""
    why = ""
    for f in reversed(view.state.decisions):
        if f.type == "placement.failed" and f.id == d.causation:
            why = f" ({f.summary})"
            break
    match d.outcome:
        case "quota_limit":
            return f"{m.name} cannot be placed: its owner {m.owner} is at a quota limit{why}"
        case "held":
            return f"{m.name} cannot be placed: it is held off the room it gave up{why}"
        case "no_candidates":
            return (
                f"{m.name} cannot be placed: no node has room for it and no replica may "
                f"be stopped for it{why}"
            )
        case _:
            return (
                f"{m.name} cannot be placed: no node has room for it, even stopping "
                f"replicas of lower classes{why}"
            )
