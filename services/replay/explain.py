"""Why a replica, model or node is as it is: `llmgw explain replica|model|node NAME`.

Called by `services.cli.replay` as a `rebuild.Watcher` over the whole log up to the
moment asked about, then `story(view)`. A name may be a unique prefix of one (a
shortened replica id); it is settled against the log once read (`lookup`). It follows the chain the events themselves
record (a replica's `drained_by` / `placed_by`, each event's `causation`, a
`preemption.decided`'s `trigger`) back to the decision and the rule that took it, and
falls back to matching by model and order only where an id is missing. It re-decides
nothing: every line it prints is something the log says.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from schemas import events as ev
from services.core import fold, policy
from services.core import quota as quotas
from services.core.view import NodeRecord, Rejection, ReplicaRecord, View, ViewState
from services.replay import history, render
from services.replay.errors import UnknownEntity
from services.replay.render import ago, duration, plural, stamp, table
from services.replay.source import Item

# TIER_MEANING says in words what each victim tier of the preemption policy is, in the
# order the policy takes them (reference/preempt.go, `victims`): cheaper losses first.
TIER_MEANING: dict[int, str] = {
    0: "idle on-demand replica of a lower class",
    1: "borrowed past its owner's guarantee, taken back for an owner within its own",
    2: "lower class above its minimum",
    3: "same class above its minimum, for a model below its own",
    4: "lower-class minimum (never a critical one)",
}

# INDEXED are the event types a chain of causation can pass through; they are kept by
# id while the log is read. Everything else is only kept when it touches the replica.
INDEXED = (
    ev.PlacementFailedEvent,
    ev.PlacementDecidedEvent,
    ev.PreemptionDecidedEvent,
    ev.ScaleDesiredEvent,
    ev.ModelDemandedEvent,
    ev.ReplicaDrainEvent,
    ev.HoldCreatedEvent,
    ev.HoldReleasedEvent,
    ev.NodeLostEvent,
)


# RECENT bounds what `explain model` and `explain node` list of each kind (failed
# placements, decisions, replicas placed, timeline): the latest ones say why now;
# `llmgw history` has them all.
RECENT = 5
TIMELINE_TAIL = 20
# SHOWN_OWNERS bounds the owners `explain replica` names of its use, the busiest first.
SHOWN_OWNERS = 5

KINDS = ("replica", "model", "node")


def guarantee_words(tree: quotas.QuotaTree, owner: str) -> str:
    """Whose guarantee covers an owner, in words: `within lab's guarantee`, or, when the
    promise is made higher up the tree, `within org's guarantee, inherited by lab`."""
    levels = [q for q in tree.governing(owner) if q.guarantee.any()]
    if not levels:
        return f"{owner} has no guarantee, its own or inherited"
    first, rest = levels[0], [q.name for q in levels[1:]]
    words = f"within {first.name}'s guarantee"
    if first.name != owner:
        words += f", inherited by {owner}"
    if rest:
        words += f" (and within {', '.join(rest)}'s above it)"
    return words


def _gpus_of(a: quotas.Amount | None) -> str:
    return "-" if a is None else plural(a.gpus, "GPU")


def tier_words(tier: int) -> str:
    return f"tier {tier}: {TIER_MEANING.get(tier, 'a tier this tool does not know')}"


def _idle(s: float | None) -> str:
    return "unknown" if s is None else duration(s)


@dataclass
class Use:
    """What one replica's `replica.used` reports said: the latest, and the sums of the
    requests and tokens those that count them (the gateway's) reported."""

    last: tuple[int, ev.ReplicaUsedEvent] | None = None
    reports: int = 0
    requests: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    tokens_cached: int | None = None
    """Of `tokens_in`, those the engine said it served from its prefix cache (None: no
    report said)."""
    by_owner: dict[str, list[int]] = field(default_factory=dict)
    """Per owner of the keys that sent them (`by_owner`): [requests, tokens_in, tokens_out]."""
    engine: tuple[int, ev.ReplicaUsedEvent] | None = None
    """The latest report carrying what the replica's engine said of its load."""
    moved_to: dict[str, int] = field(default_factory=dict)
    """Streams moved off it to other replicas (a gateway's continuation), per replica."""

    def add(self, seq: int, e: ev.ReplicaUsedEvent) -> None:
        if self.last is None or fold.used_at(e) >= fold.used_at(self.last[1]):
            self.last = (seq, e)
        if e.data.engine is not None:
            self.engine = (seq, e)
        if e.data.requests is not None:
            self.reports += 1
            self.requests += e.data.requests
            self.tokens_in += e.data.tokens_in or 0
            self.tokens_out += e.data.tokens_out or 0
        if e.data.tokens_cached is not None:
            self.tokens_cached = (self.tokens_cached or 0) + e.data.tokens_cached
        for to, k in e.data.moved_to.items():
            self.moved_to[to] = self.moved_to.get(to, 0) + k
        for owner, u in e.data.by_owner.items():
            n = self.by_owner.setdefault(owner, [0, 0, 0])
            n[0] += u.requests
            n[1] += u.tokens_in
            n[2] += u.tokens_out


@dataclass
class Explainer:
    """Collects what `story` needs while the log is folded."""

    name: str
    root: str = "llmgw"
    kind: str = "replica"
    timeline: history.Timeline = field(init=False)
    by_id: dict[str, tuple[int, ev.Envelope]] = field(default_factory=dict)
    preemptions: list[tuple[int, ev.PreemptionDecidedEvent]] = field(default_factory=list)
    holds: list[tuple[int, ev.HoldCreatedEvent]] = field(default_factory=list)
    releases: list[tuple[int, ev.HoldReleasedEvent]] = field(default_factory=list)
    failures: dict[str, deque[tuple[int, ev.PlacementFailedEvent]]] = field(default_factory=dict)
    node_marks: dict[tuple[str, str], tuple[int, ev.Envelope]] = field(default_factory=dict)
    """(node, event type) -> the latest cordon, uncordon or loss of it."""
    woken: dict[str, Wake] = field(default_factory=dict)
    """Per model (as events name it), the chain of its last wake-up by demand."""
    uses: dict[str, Use] = field(default_factory=dict)
    """Replica id -> what its `replica.used` reports said, for the replicas the name
    asked about may be (a prefix of their id)."""
    pins: dict[str, str] = field(default_factory=dict)
    """placement.decided id -> the preemption.decided whose domain pinned it (`View.pin`
    on the view it was folded into, at its time): the placements a pin applied to."""
    now: datetime | None = None
    """What ages are counted from; set by `story`."""

    def __post_init__(self) -> None:
        self.timeline = history.Timeline(self.kind, self.name, self.root)

    @property
    def replica(self) -> str:
        return self.timeline.name

    def before(self, item: Item, view: View) -> None:
        e = item.event
        if (
            self.kind == "model"
            and isinstance(e, ev.ModelDeclaredEvent)
            and self.name in e.data.aliases
        ):
            # An alias: the timeline is the model's own, from its declaration on.
            self.timeline.key = ("model", e.data.name)
        if isinstance(e, ev.PlacementDecidedEvent):
            m = view.catalog.resolve(e.data.model)
            pin = view.pin(m.name if m is not None else e.data.model, e.time)
            if pin is not None:
                self.pins[e.id] = pin.decision
        self.timeline.before(item, view)

    def after(self, item: Item, rejection: Rejection | None, view: View) -> None:
        self.timeline.after(item, rejection, view)
        e = item.event
        if isinstance(e, INDEXED):
            self.by_id[e.id] = (item.seq, e)
        match e:
            case ev.PreemptionDecidedEvent():
                self.preemptions.append((item.seq, e))
            case ev.HoldCreatedEvent():
                self.holds.append((item.seq, e))
            case ev.HoldReleasedEvent():
                self.releases.append((item.seq, e))
            case ev.ReplicaUsedEvent(data=d) if (
                self.kind == "replica" and d.replica.startswith(self.name) and rejection is None
            ):
                self.uses.setdefault(d.replica, Use()).add(item.seq, e)
            case ev.PlacementFailedEvent(data=d):
                self.failures.setdefault(d.model, deque(maxlen=RECENT)).append((item.seq, e))
            case (
                ev.NodeCordonedEvent(data=d)
                | ev.NodeUncordonedEvent(data=d)
                | ev.NodeLostEvent(data=d)
                | ev.NodeRemovedEvent(data=d)
                | ev.NodeInventoryEvent(data=d)
            ):
                self.node_marks[(d.node, ev.type_of(type(e)))] = (item.seq, e)
        self._follow_wake(item.seq, e)

    def _follow_wake(self, seq: int, e: ev.Envelope) -> None:
        """Keep, per model, the chain of its last wake-up by demand as the log tells it:
        the autoscaler's scale.desired with a demand as its cause, then the first
        placement.failed, preemption.decided, the drains that decision caused, the
        first placement.decided and that replica's first ready after it."""
        match e:
            case ev.ScaleDesiredEvent(data=d) if (d.reason or "").startswith("demand"):
                got = self._event(e.causation)
                demand = None
                if got is not None and isinstance(got[1], ev.ModelDemandedEvent):
                    demand = (got[0], got[1])
                self.woken[d.model] = Wake(scale=(seq, e), demand=demand)
            case ev.PlacementFailedEvent(data=d):
                w = self.woken.get(d.model)
                if w is not None and w.failed is None and w.placed is None:
                    w.failed = (seq, e)
            case ev.PreemptionDecidedEvent(data=d):
                w = self.woken.get(d.for_model)
                if w is not None and w.decision is None and w.placed is None:
                    w.decision = (seq, e)
            case ev.ReplicaDrainEvent(data=d) if d.for_model is not None:
                w = self.woken.get(d.for_model)
                if w is not None and w.decision is not None and e.causation == w.decision[1].id:
                    w.drains.append((seq, e))
            case ev.PlacementDecidedEvent(data=d):
                w = self.woken.get(d.model)
                if w is not None and w.placed is None:
                    w.placed = (seq, e)
            case ev.ReplicaStateEvent(data=d) if d.state == "ready":
                w = self.woken.get(d.model)
                if (
                    w is not None
                    and w.ready is None
                    and w.placed is not None
                    and w.placed[1].data.replica == d.replica
                ):
                    w.ready = (seq, e)

    def _victim_of(self, replica: str) -> list[tuple[int, ev.PreemptionDecidedEvent]]:
        return [
            (s, d) for s, d in self.preemptions if any(v.replica == replica for v in d.data.victims)
        ]

    # ---------------------------------------------------------------- the story

    def story(self, view: View, now: datetime | None = None) -> Story:
        """What the log says about the entity asked for, as of `view`; ages counted from
        `now` (the wall clock at the live log's head), or the view's own time when None."""
        self.now = now if now is not None else view.state.time
        if self.kind == "model":
            return self._model_story(view)
        if self.kind == "node":
            return self._node_story(view)
        self.timeline.resolve(view.state.replicas)
        r = view.state.replicas.get(self.replica)
        if r is None:
            raise UnknownEntity(
                "replica",
                self.replica,
                " as a replica the view kept (every event about it was rejected); "
                "see `llmgw history replica`",
            )
        st = Story(kind="replica", name=r.id, now=self.now, replica=r)
        decl = view.state.models.get(r.model)
        cls = decl.cls if decl is not None else "undeclared"
        where = "+".join(f"{s.node}[{','.join(map(str, s.gpus))}]" for s in r.shards) or "no GPUs"
        st.line(f"replica {r.id} of {r.model} ({cls}) is {r.state}, on {where}")
        st.line(
            f"  since {stamp(r.updated_at)} ({ago(r.updated_at, st.now)}); created "
            f"{stamp(r.created_at)}; ready {ago(r.ready_at, st.now) if r.ready_at else 'never'}; "
            f"idle {_idle(r.idle_s(st.now) if st.now else None)}"
        )
        if r.endpoint is not None and r.holds_capacity:
            st.line(f"  its server answers at {r.endpoint} (replica.state endpoint)")
        elif r.endpoint is not None:
            st.line(f"  its server answered at {r.endpoint} until it was {r.state}")
        use = self.uses.get(r.id)
        if use is not None:
            self._last_used(st, use)
        st.line("")
        if r.failed_on and r.drain_reason in (None, "shard_failed"):
            self._shard_failed(st, r)
        elif r.preempted_for is not None or r.drain_reason == "preempted":
            self._preempted(st, r, view)
        elif r.drain_reason == "scale_down" or r.retiring_at is not None:
            self._scaled_down(st, r)
        elif r.drain_reason is not None:
            self._drained(st, r)
        elif r.state == "failed":
            self._failed(st, r)
        else:
            self._placed(st, r)
        st.timeline = list(self.timeline.entries)
        return st

    def _last_used(self, st: Story, use: Use) -> None:
        """The replica's last `replica.used`, and what the gateway's reports add up to."""
        assert use.last is not None
        seq, e = use.last
        d = e.data
        at = fold.used_at(e)
        line = (
            f"  last used {stamp(at)} ({ago(at, st.now)}): seq {seq} replica.used from {e.source}"
        )
        if d.requests is not None:
            line += (
                f", {plural(d.requests, 'request')}, tokens in {d.tokens_in or 0} / "
                f"out {d.tokens_out or 0} since its report before"
            )
        st.line(line)
        if use.reports:
            cached = "" if use.tokens_cached is None else f" ({use.tokens_cached} cached)"
            st.line(
                f"  used in all: {plural(use.requests, 'request')}, tokens in {use.tokens_in}"
                f"{cached} / out {use.tokens_out} ({plural(use.reports, 'report')} with counts)"
            )
        if use.by_owner:
            top = sorted(use.by_owner.items(), key=lambda kv: (-kv[1][0], kv[0]))
            said = ", ".join(
                f"{o} {plural(n[0], 'request')} (tokens in {n[1]} / out {n[2]})"
                for o, n in top[:SHOWN_OWNERS]
            )
            more = f", and {len(top) - SHOWN_OWNERS} more" if len(top) > SHOWN_OWNERS else ""
            st.line(f"  by owner: {said}{more}")
        st.facts["last_used"] = {
            "at": at.isoformat().replace("+00:00", "Z"),
            "seq": seq,
            "source": e.source,
            "requests": d.requests,
            "tokens_in": d.tokens_in,
            "tokens_out": d.tokens_out,
        }
        st.facts["used"] = {
            "reports": use.reports,
            "requests": use.requests,
            "tokens_in": use.tokens_in,
            "tokens_out": use.tokens_out,
            "by_owner": {
                o: {"requests": n[0], "tokens_in": n[1], "tokens_out": n[2]}
                for o, n in sorted(use.by_owner.items())
            },
        }
        if use.tokens_cached is not None:
            st.facts["used"]["tokens_cached"] = use.tokens_cached
        if use.moved_to:
            dest = sorted(use.moved_to.items(), key=lambda kv: (-kv[1], kv[0]))
            where = ", ".join(f"{k} to {to}" for to, k in dest[:SHOWN_OWNERS])
            more = f", and {len(dest) - SHOWN_OWNERS} more" if len(dest) > SHOWN_OWNERS else ""
            moved = sum(use.moved_to.values())
            st.line(f"  streams moved off it: {moved} ({where}{more})")
            st.facts["used"]["moved_to"] = dict(sorted(use.moved_to.items()))
        if use.engine is not None:
            self._engine(st, *use.engine)

    def _engine(self, st: Story, seq: int, e: ev.ReplicaUsedEvent) -> None:
        """What the replica's engine said of its load in the latest report carrying it."""
        load = e.data.engine
        assert load is not None
        said = []
        if load.running is not None or load.waiting is not None:
            said.append(f"{load.running or 0} running, {load.waiting or 0} waiting")
        if load.kv_cache_usage is not None:
            said.append(f"KV cache {load.kv_cache_usage:.0%} used")
        q, h = load.prefix_cache_queries, load.prefix_cache_hits
        if q is not None and h is not None:
            rate = f" ({h / q:.0%})" if q else ""
            said.append(f"prefix cache hits {h} of {q} prompt tokens looked up{rate}")
        if load.prompt_tokens is not None or load.generation_tokens is not None:
            said.append(
                f"tokens {load.prompt_tokens or 0} prompt / {load.generation_tokens or 0} "
                "generated since it started"
            )
        st.line(
            f"  its engine said, read {stamp(load.at)} ({ago(load.at, st.now)}; seq {seq} "
            f"replica.used from {e.source}): {'; '.join(said) or 'nothing of its load'}"
        )
        st.facts["engine"] = {"seq": seq, **render.engine_json(load)}

    def _event(self, ident: str | None) -> tuple[int, ev.Envelope] | None:
        return None if ident is None else self.by_id.get(ident)

    def _ref(self, seq: int, e: ev.Envelope, now: Any) -> str:
        return f"seq {seq} {ev.type_of(type(e))} {e.id} at {stamp(e.time)} ({ago(e.time, now)})"

    def _drain(self, r: ReplicaRecord) -> tuple[int, ev.ReplicaDrainEvent] | None:
        got = self._event(r.drained_by)
        if got is not None and isinstance(got[1], ev.ReplicaDrainEvent):
            return got[0], got[1]
        return None

    def _preempted(self, st: Story, r: ReplicaRecord, view: View) -> None:
        drain = self._drain(r)
        decision: tuple[int, ev.PreemptionDecidedEvent] | None = None
        if drain is not None:
            got = self._event(drain[1].causation)
            if got is not None and isinstance(got[1], ev.PreemptionDecidedEvent):
                decision = (got[0], got[1])
        named = self._victim_of(r.id)
        if decision is None and named:
            # No causation on the drain: the latest decision naming this replica a victim.
            decision = named[-1]
        for_model = r.preempted_for or (decision[1].data.for_model if decision else "?")
        fdecl = view.state.models.get(for_model)
        fcls = f" ({fdecl.cls})" if fdecl is not None else ""
        st.line(f"why: preempted, stopped to make room for model {for_model}{fcls}")
        st.facts["why"] = "preempted"
        st.facts["for_model"] = for_model
        if decision is None:
            st.line("  the log holds no preemption.decided naming it a victim")
        else:
            seq, d = decision
            me = next((v for v in d.data.victims if v.replica == r.id), None)
            st.line(f"  decision   {self._ref(seq, d, st.now)}, outcome {d.data.outcome}")
            st.line(f"  policy     {d.data.policy}")
            st.facts["policy"] = d.data.policy
            if me is not None:
                st.line(f"  rule       {tier_words(me.tier)}")
                st.line(
                    f"             its class {me.cls}; above its model's minimum: "
                    f"{'yes' if me.above_min else 'no'}; idle {_idle(me.idle_s)}; "
                    f"frees {plural(me.gpus, 'GPU')}"
                )
                st.facts["tier"] = me.tier
                st.facts["tier_meaning"] = TIER_MEANING.get(me.tier)
            gang = d.data.spans.get(r.id)
            if gang:
                st.line(f"  gang       stopped whole: every shard drained, on {', '.join(gang)}")
                st.facts["gang"] = list(gang)
            if d.data.domain:
                st.line(f"  domain     {for_model} goes to {d.data.domain}, the domain this frees")
                st.facts["domain"] = d.data.domain
            victims = ", ".join(f"{v.replica} ({v.model}, tier {v.tier})" for v in d.data.victims)
            st.line(f"  victims    {victims}")
            self._considered(st, d.data, r.id, view)
            self._trigger(st, d)
            st.facts["decision"] = d.id
        if drain is not None:
            seq, dr = drain
            st.line(
                f"  drain      {self._ref(seq, dr, st.now)}: reason {dr.data.reason}"
                + (f" for {dr.data.for_model}" if dr.data.for_model else "")
                + f", grace {dr.data.grace_s:g}s"
            )
        self._hold(st, r, view, decision)

    def _considered(self, st: Story, d: ev.PreemptionDecided, me: str, view: View) -> None:
        victims = {v.replica for v in d.victims}
        cands = d.candidates
        st.line(f"  considered {plural(max(d.considered, len(cands)), 'candidate')}")
        if cands:
            rows = [
                [
                    c.replica,
                    c.model,
                    c.cls,
                    str(c.tier),
                    "yes" if c.above_min else "no",
                    _idle(c.idle_s),
                    str(c.gpus),
                    ("victim" if c.replica in victims else "spared")
                    + (" (this one)" if c.replica == me else ""),
                ]
                for c in cands
            ]
            st.line(
                table(
                    ["REPLICA", "MODEL", "CLASS", "TIER", "ABOVE-MIN", "IDLE", "GPUS", "OUTCOME"],
                    rows,
                    "             ",
                )
            )
        st.facts["candidates"] = [c.replica for c in cands]
        if d.considered > len(cands):
            st.line(
                f"  not listed {plural(d.considered - len(cands), 'more candidate')}"
                + _by(d.by_tier, "tier ")
            )
        if d.excluded:
            st.line("  excluded")
            for x in d.excluded:
                st.line(
                    f"             {x.replica}"
                    + (f" ({x.model})" if x.model else "")
                    + f": {self._why_excluded(x, view)}"
                )
        if d.excluded_count > len(d.excluded):
            st.line(
                f"  not listed {plural(d.excluded_count - len(d.excluded), 'more exclusion')}"
                + _by(d.excluded_by, "")
            )
        st.facts["excluded"] = {x.replica: x.why for x in d.excluded}
        for t in d.trials:
            st.line(f"  trial      [{', '.join(t.victims)}] {'fits' if t.fits else 'does not fit'}")

    def _why_excluded(self, x: ev.Excluded, view: View) -> str:
        if x.why == "guaranteed" and x.model in view.state.models:
            owner = view.state.models[x.model].owner
            return f"{guarantee_words(view.quota, owner)}, and the model is another owner's"
        return policy.WHY.get(x.why, x.why)

    def _trigger(self, st: Story, d: ev.PreemptionDecidedEvent) -> None:
        ident = d.data.trigger or d.causation
        got = self._event(ident)
        if got is not None and isinstance(got[1], ev.PlacementFailedEvent):
            seq, pf = got[0], got[1]
            why = "; ".join(f"{k}: {v}" for k, v in pf.data.why.items())
            st.line(
                f"  trigger    {self._ref(seq, pf, st.now)}: {pf.data.model} could not be placed "
                f"({pf.data.reason}; live {pf.data.live} of {pf.data.desired} desired"
                + (f"; {why}" if why else "")
                + ")"
            )
        elif ident:
            st.line(f"  trigger    {ident} (not in the log replayed)")
        st.facts["trigger"] = ident or None

    def _hold(
        self,
        st: Story,
        r: ReplicaRecord,
        view: View,
        decision: tuple[int, ev.PreemptionDecidedEvent] | None,
    ) -> None:
        after = decision[0] if decision else 0
        made = [
            (s, h)
            for s, h in self.holds
            if h.data.model == r.model
            and s >= after
            and (decision is None or h.causation in (None, decision[1].id))
        ]
        if not made:
            st.line(f"  hold       none recorded on {r.model}")
            return
        seq, h = made[0]
        now = st.now
        state, release = self.hold_state(seq, h, view, now)
        st.line(
            f"  hold       {r.model} held for {h.data.for_model} until {stamp(h.data.until)} "
            f"({ago(h.data.until, now)}), {state}; {self._ref(seq, h, now)}"
        )
        if release is not None:
            rs, rel = release
            st.line(f"  released   {self._ref(rs, rel, now)}: {rel.data.reason}")
        st.facts["hold"] = {
            "until": stamp(h.data.until),
            "for_model": h.data.for_model,
            "state": state,
            "released": None
            if release is None
            else {
                "seq": release[0],
                "time": stamp(release[1].time),
                "reason": release[1].data.reason,
            },
        }

    def hold_state(
        self, seq: int, h: ev.HoldCreatedEvent, view: View, now: datetime | None = None
    ) -> tuple[str, tuple[int, ev.HoldReleasedEvent] | None]:
        """Where the hold made at `seq` stands: released (when and why, from the log's
        `hold.released`), replaced by a later hold, still on, or over by itself, at `now`
        (None: the view's time)."""
        now = now if now is not None else view.state.time
        m = h.data.model
        nxt = next((s for s, x in self.holds if s > seq and x.data.model == m), None)
        rel = next(
            (
                (s, x)
                for s, x in self.releases
                if s > seq and x.data.model == m and (nxt is None or s < nxt)
            ),
            None,
        )
        if rel is not None:
            return f"released {ago(rel[1].time, now)} ({rel[1].data.reason})", rel
        if nxt is not None:
            return f"replaced by the hold at seq {nxt}", None
        cur = view.state.holds.get(m)
        if cur is not None and cur.created_by == h.id:
            on = now is not None and view.active_hold(m, now) is not None
            return ("still on" if on else "over"), None
        return "no longer in the view", None

    def _scaled_down(self, st: Story, r: ReplicaRecord) -> None:
        drain = self._drain(r)
        st.line("why: scaled down")
        st.facts["why"] = "scale_down"
        if drain is None:
            return
        seq, dr = drain
        st.line(f"  drain      {self._ref(seq, dr, st.now)}")
        got = self._event(dr.causation)
        cause: tuple[int, ev.ScaleDesiredEvent] | None = None
        if got is not None and isinstance(got[1], ev.ScaleDesiredEvent):
            cause = (got[0], got[1])
        else:
            # No causation: the latest scale.desired for the model before the drain.
            for s, e in sorted(self.by_id.values(), key=lambda x: x[0]):
                if s < seq and isinstance(e, ev.ScaleDesiredEvent) and e.data.model == r.model:
                    cause = (s, e)
        if cause is not None:
            s, sd = cause
            st.line(
                f"  cause      {self._ref(s, sd, st.now)}: {sd.data.model} desired "
                f"{plural(sd.data.replicas, 'replica')} (by {sd.source})"
            )
            st.facts["cause"] = sd.id

    def _drained(self, st: Story, r: ReplicaRecord) -> None:
        drain = self._drain(r)
        st.line(f"why: drained ({r.drain_reason})")
        st.facts["why"] = r.drain_reason
        if drain is not None:
            seq, dr = drain
            st.line(f"  drain      {self._ref(seq, dr, st.now)} by {dr.source}")

    def _shard_failed(self, st: Story, r: ReplicaRecord) -> None:
        """A gang one of whose shards failed: which, why, and what became of the others."""
        st.line(f"why: a shard failed: {_broke(r)}")
        st.facts["why"] = "shard_failed"
        st.facts["failed_on"] = list(r.failed_on)
        st.facts["reason"] = r.reason
        for node in r.nodes:
            if node not in r.failed_on:
                st.line(f"  shard on {node}: {_after(r, node)}")
        drain = self._drain(r)
        if drain is not None:
            seq, dr = drain
            st.line(f"  drain      {self._ref(seq, dr, st.now)} by {dr.source}")

    def _failed(self, st: Story, r: ReplicaRecord) -> None:
        st.line(f"why: failed: {r.reason or 'no reason given'}")
        st.facts["why"] = "failed"
        st.facts["reason"] = r.reason
        last = next((e for e in reversed(self.timeline.entries) if e.rejected is None), None)
        if last is not None:
            st.line(
                f"  reported   seq {last.seq} {last.type} {last.id} at {stamp(last.time)}: {last.summary}"
            )

    def _placed(self, st: Story, r: ReplicaRecord) -> None:
        got = self._event(r.placed_by)
        st.facts["why"] = "placed"
        if got is None or not isinstance(got[1], ev.PlacementDecidedEvent):
            st.line("why: reported by its node's agent; the log holds no placement decision for it")
            return
        seq, pd = got[0], got[1]
        st.line(f"why: placed by the scheduler: {pd.data.reason}")
        st.line(f"  decision   {self._ref(seq, pd, st.now)}, profile {pd.data.profile}")
        st.facts["decision"] = pd.id
        pinned = self._event(self.pins.get(pd.id))
        if pinned is not None and isinstance(pinned[1], ev.PreemptionDecidedEvent):
            s, pe = pinned[0], pinned[1]
            st.line(
                f"  pinned     to {pe.data.domain}, the domain its victims freed, by "
                f"{self._ref(s, pe, st.now)}"
            )
            st.facts["pinned"] = {"domain": pe.data.domain, "decision": pe.id, "seq": s}
        cause = self._event(pd.causation)
        if cause is not None:
            s, ce = cause
            st.line(f"  cause      {self._ref(s, ce, st.now)}")

    # ---------------------------------------------------------------- models

    def _model_story(self, view: View) -> Story:
        s = view.state
        known = set(s.models) | {a for m in s.models.values() for a in m.aliases}
        known |= {r.model for r in s.replicas.values()}
        name = self.timeline.resolve(known)
        decl = s.models.get(name)
        if decl is None:
            m = view.catalog.resolve(name)
            if m is not None:
                name, decl = m.name, s.models.get(m.name)
                self.timeline.name = name
        st = Story(kind="model", name=name, now=self.now)
        live, desired = view.live_for(name), view.desired_for(name)
        asked = s.desired.get(name)
        reps = sorted((r for r in s.replicas.values() if r.model == name), key=lambda r: r.id)
        failing = render.failing(view, name)
        # The cause of an outage comes first: why its replicas fail, before the counts.
        if failing is not None:
            st.line(render.failing_line(name, failing))
        if decl is None:
            st.line(f"model {name} is not declared (removed, or never declared); live {live}")
        else:
            st.line(
                f"model {name} ({decl.cls}, owner {decl.owner}): live {live} of {desired} "
                f"desired (asked {'-' if asked is None else asked}, min {decl.min}, "
                f"max {decl.effective_max})"
            )
        short = desired - live
        st.line(
            f"  {'below desired by ' + str(short) if short > 0 else 'at or above desired'}"
            + (
                f"; waiting for {', '.join(view.awaiting(name))} to drain"
                if view.awaiting(name)
                else ""
            )
        )
        pin = view.pin(name, self.now) if self.now is not None else None
        if pin is not None:
            assert pin.until is not None  # Invariant: a pin on has its end.
            st.line(
                f"  its placement is pinned to {pin.domain}, the domain its victims free, "
                f"until {stamp(pin.until)} or its next replica is placed ({pin.decision})"
            )
            st.facts["pinned"] = {
                "domain": pin.domain,
                "decision": pin.decision,
                "until": stamp(pin.until),
            }
        st.facts.update(
            live=live,
            desired=desired,
            asked=asked,
            min=None if decl is None else decl.min,
            max=None if decl is None else decl.effective_max,
            cls=None if decl is None else decl.cls,
            owner=None if decl is None else decl.owner,
            below_by=max(short, 0),
            failing=failing,
        )
        self._model_demand(st, name, view)
        holding = [r for r in reps if r.holds_capacity]
        if holding:
            st.line("")
            st.line("replicas holding GPUs")
            st.line(
                table(
                    ["REPLICA", "STATE", "NODES", "NOTE"],
                    [[r.id, r.state, ",".join(r.nodes) or "-", _leaving(r)] for r in holding],
                    "  ",
                )
            )
        st.facts["replicas"] = {r.id: r.state for r in holding}
        self._model_wake(st, name, view)
        self._model_failures(st, name)
        self._model_decisions(st, name, view)
        self._model_holds(st, name, view)
        if decl is not None:
            self._model_quota(st, decl.owner, view)
        st.timeline = list(self.timeline.entries)
        st.tail = TIMELINE_TAIL
        return st

    def _model_demand(self, st: Story, name: str, view: View) -> None:
        """Its last demand, as the view keeps it (`model.demanded`)."""
        dem = view.state.demand.get(name)
        if dem is not None:
            st.line(
                f"  demand: {plural(dem.waiting, 'request')} waiting since {stamp(dem.since)} "
                f"as of {stamp(dem.at)} ({ago(dem.at, st.now)})"
                # Then, not now: the gateway says in flight only with a demand, and a
                # model since scaled to zero has none in flight, whatever it said last.
                + (
                    f", when {plural(dem.inflight, 'request')} "
                    f"{'was' if dem.inflight == 1 else 'were'} in flight"
                    if dem.inflight
                    else ""
                )
                + ("" if dem.answered_by is None else f"; answered by {dem.answered_by}")
            )
        st.facts["demand"] = (
            None
            if dem is None
            else {
                "waiting": dem.waiting,
                "since": stamp(dem.since),
                "at": stamp(dem.at),
                "inflight": dem.inflight,
                "answered_by": dem.answered_by,
            }
        )

    def _model_wake(self, st: Story, name: str, view: View) -> None:
        """Its last wake-up by demand, step by step: demand -> scale -> placement.failed
        -> preemption.decided -> drain -> placed -> ready, each the log's own event."""
        m = view.catalog.resolve(name)
        names = view.catalog.names_of(m) if m is not None else (name,)
        got = [w for n in names if (w := self.woken.get(n)) is not None]
        if not got:
            st.facts["woken"] = None
            return
        w = max(got, key=lambda x: x.scale[0])
        now = st.now
        st.line("")
        st.line("woken by demand (the last time)")
        steps: list[tuple[str, tuple[int, ev.Envelope] | None, str]] = []
        if w.demand is not None:
            d = w.demand[1].data
            steps.append(
                (
                    "demand",
                    w.demand,
                    f"{plural(d.waiting, 'request')} waiting since {stamp(d.since)}",
                )
            )
        else:
            steps.append(("demand", None, f"{w.scale[1].causation} (not in the log replayed)"))
        sd = w.scale[1].data
        steps.append(
            (
                "scale",
                w.scale,
                f"{plural(sd.replicas, 'replica')} ({sd.reason}), by {w.scale[1].source}",
            )
        )
        if w.failed is not None:
            pf = w.failed[1].data
            steps.append(("no room", w.failed, f"{pf.reason}, live {pf.live} of {pf.desired}"))
        if w.decision is not None:
            pd = w.decision[1].data
            victims = ", ".join(
                f"{v.replica} ({v.model}, {tier_words(v.tier)})" for v in pd.victims
            )
            steps.append(
                ("preemption", w.decision, pd.outcome + (f": {victims}" if victims else ""))
            )
        for dr in w.drains:
            steps.append(
                (
                    "drain",
                    dr,
                    f"{dr[1].data.replica} ({dr[1].data.model}), grace {dr[1].data.grace_s:g}s",
                )
            )
        if w.placed is not None:
            pl = w.placed[1].data
            steps.append(("placed", w.placed, f"{pl.replica}: {pl.reason}"))
        if w.ready is not None:
            start = (w.demand or w.scale)[1].time
            took = (w.ready[1].time - start).total_seconds()
            steps.append(
                ("ready", w.ready, f"{w.ready[1].data.replica}, {took:.1f}s after the demand")
            )
        else:
            steps.append(("ready", None, "not yet"))
        for label, ref, words in steps:
            where = self._ref(ref[0], ref[1], now) + ": " if ref is not None else ""
            st.line(f"  {label:<10} {where}{words}")
        st.facts["woken"] = {
            label: (None if ref is None else ref[1].id)
            for label, ref, _ in steps
            if label != "drain"
        } | {"drains": [dr[1].id for dr in w.drains]}

    def _model_failures(self, st: Story, name: str) -> None:
        got = list(self.failures.get(name, ()))
        st.line("")
        if not got:
            st.line("failed placements: none in the log")
        else:
            st.line(f"failed placements (the last {len(got)})")
        out = []
        for seq, pf in got:
            d = pf.data
            st.line(
                f"  {self._ref(seq, pf, st.now)}: {d.reason}, live {d.live} of {d.desired}, "
                f"profiles {', '.join(d.profiles) or '-'}"
            )
            for prof, why in d.why.items():
                st.line(f"      {prof}: {why}")
            out.append(
                {
                    "seq": seq,
                    "id": pf.id,
                    "time": stamp(pf.time),
                    "reason": d.reason,
                    "why": dict(d.why),
                }
            )
        st.facts["failed_placements"] = out

    def _model_decisions(self, st: Story, name: str, view: View) -> None:
        mine = [(s, d) for s, d in self.preemptions if d.data.for_model == name][-RECENT:]
        st.line("")
        st.line(
            f"preemption decisions for it (the last {len(mine)})"
            if mine
            else "preemption decisions for it: none in the log"
        )
        for seq, d in mine:
            victims = ", ".join(f"{v.replica} ({v.model}, tier {v.tier})" for v in d.data.victims)
            # A fits stopped nothing and placed nothing: its reason says so, not "fits".
            said = d.data.reason if d.data.outcome == "fits" and d.data.reason else d.data.outcome
            st.line(
                f"  {self._ref(seq, d, st.now)}: {said} ({d.data.policy})"
                + (f"; victims {victims}" if victims else "")
            )
            for x in d.data.excluded:
                if x.why == "guaranteed":
                    st.line(f"      spared {x.replica}: {self._why_excluded(x, view)}")
        st.facts["decisions"] = [
            {
                "seq": seq,
                "id": d.id,
                "outcome": d.data.outcome,
                "reason": d.data.reason,
                "policy": d.data.policy,
                "victims": [v.replica for v in d.data.victims],
            }
            for seq, d in mine
        ]
        taken = [
            (s, d)
            for s, d in self.preemptions
            if d.data.for_model != name and any(v.model == name for v in d.data.victims)
        ][-RECENT:]
        if taken:
            st.line("its replicas taken for other models")
            for seq, d in taken:
                vs = ", ".join(v.replica for v in d.data.victims if v.model == name)
                st.line(f"  {self._ref(seq, d, st.now)}: {vs} for {d.data.for_model}")
        st.facts["victim_of"] = [d.id for _, d in taken]

    def _model_holds(self, st: Story, name: str, view: View) -> None:
        on_it = [(s, h) for s, h in self.holds if h.data.model == name][-RECENT:]
        caused = [(s, h) for s, h in self.holds if h.data.for_model == name][-RECENT:]
        st.line("")
        if not on_it and not caused:
            st.line("holds: none on it and none for it")
        rows = []
        for title, got in (("holds on it", on_it), ("holds it caused", caused)):
            if not got:
                continue
            st.line(title)
            for seq, h in got:
                state, _ = self.hold_state(seq, h, view, st.now)
                st.line(
                    f"  {h.data.model} held for {h.data.for_model} until {stamp(h.data.until)}, "
                    f"{state}; seq {seq}"
                )
                rows.append(
                    {
                        "seq": seq,
                        "model": h.data.model,
                        "for_model": h.data.for_model,
                        "until": stamp(h.data.until),
                        "state": state,
                    }
                )
        st.facts["holds"] = rows

    def _model_quota(self, st: Story, owner: str, view: View) -> None:
        tree = view.quota
        st.line("")
        if not len(tree):
            st.line(f"quota: no quota tree declared; owner {owner} is unlimited")
            st.facts["quota"] = None
            return
        holdings = view.holdings()
        usage = tree.usage_of(owner, holdings)
        borrowed = tree.borrowed(holdings)
        mine = [h for h in holdings if h.owner == owner]
        st.line(f"quota of {owner}: {guarantee_words(tree, owner)}")
        rows = []
        for q in tree.governing(owner):
            used = usage.get(q.name, quotas.ZERO)
            rows.append(
                [
                    q.name,
                    _gpus_of(q.guarantee) if q.guarantee.any() else "-",
                    _gpus_of(q.limit),
                    _gpus_of(used),
                ]
            )
        st.line(table(["LEVEL", "GUARANTEE", "LIMIT", "USED"], rows, "  "))
        lent = [h.replica for h in mine if h.replica in borrowed]
        st.line(
            f"  {len(lent)} of its {plural(len(mine), 'replica')} holding GPUs "
            f"{'is' if len(lent) == 1 else 'are'} borrowed (past a guarantee)"
            + (f": {', '.join(sorted(lent))}" if lent else "")
        )
        st.facts["quota"] = {
            "owner": owner,
            "guarantee": guarantee_words(tree, owner),
            "levels": [
                {"owner": r[0], "guarantee": r[1], "limit": r[2], "used": r[3]} for r in rows
            ],
            "borrowed": sorted(lent),
        }

    # ---------------------------------------------------------------- nodes

    def _reported(self, node: str) -> ev.Envelope | None:
        """The node's last `node.inventory` in the log replayed (its report, which a
        `node.lost` or a cordon after it does not move), or None."""
        got = self.node_marks.get((node, "node.inventory"))
        return got[1] if got is not None else None

    def _node_story(self, view: View) -> Story:
        s = view.state
        name = self.timeline.resolve(s.nodes)
        rec = s.nodes.get(name)
        st = Story(kind="node", name=name, now=self.now)
        if rec is None:
            return self._node_gone(st, name)
        flags = [w for w, on in (("LOST", rec.lost), ("cordoned", rec.cordoned)) if on]
        gpus = sorted(rec.report.gpus, key=lambda g: g.index)
        st.line(
            f"node {name}: {plural(len(gpus), 'GPU')}, "
            + (", ".join(flags) if flags else "schedulable")
            + (
                f"; inventory reported {stamp(reported.time)} ({ago(reported.time, st.now)})"
                if (reported := self._reported(name)) is not None
                else f"; last changed {stamp(rec.updated_at)} ({ago(rec.updated_at, st.now)})"
            )
        )
        self._node_marks(st, rec, name)
        self._node_gpus(st, s, name, gpus)
        self._node_failures(st, s, name)
        self._node_moves(st)
        st.timeline = list(self.timeline.entries)
        st.tail = TIMELINE_TAIL
        return st

    def _node_gone(self, st: Story, name: str) -> Story:
        """The story of a node the view does not have: removed, or never reported."""
        removed = self.node_marks.get((name, "node.removed"))
        if removed is None:
            st.line(f"node {name} is not in the view (it never reported its inventory)")
        else:
            seq, e = removed
            why = (
                f", reason {e.data.reason}"
                if isinstance(e, ev.NodeRemovedEvent) and e.data.reason
                else ""
            )
            st.line(
                f"node {name} was removed {stamp(e.time)} ({ago(e.time, st.now)}) "
                f"by {e.source}{why}; seq {seq}"
            )
            st.facts.update(removed={"seq": seq, "time": stamp(e.time), "by": e.source})
        st.timeline = list(self.timeline.entries)
        st.tail = TIMELINE_TAIL
        return st

    def _node_marks(self, st: Story, rec: NodeRecord, name: str) -> None:
        """Who marked the node lost or cordoned, when; and what its replicas do now."""
        marks = []
        for flag, on, typ in (
            ("lost", rec.lost, "node.lost"),
            ("cordoned", rec.cordoned, "node.cordoned"),
        ):
            got = self.node_marks.get((name, typ))
            if on and got is not None:
                seq, e = got
                why = f", reason {e.data.reason}" if isinstance(e, ev.NodeLostEvent) else ""
                st.line(
                    f"  {flag} since {stamp(e.time)} ({ago(e.time, st.now)}) by {e.source}{why}; seq {seq}"
                )
                marks.append({"flag": flag, "seq": seq, "time": stamp(e.time), "by": e.source})
            elif on:
                st.line(f"  {flag}; the event that did it is not in the log replayed")
        if rec.lost and rec.failing_at is not None:
            st.line(
                f"  its replicas keep their GPUs until {stamp(rec.failing_at)} "
                f"({ago(rec.failing_at, st.now)}), the grace, and fail then unless it is "
                "heard from"
            )
        elif rec.lost:
            st.line("  its replicas were failed with it")
        st.facts.update(
            lost=rec.lost,
            cordoned=rec.cordoned,
            marks=marks,
            failing_at=stamp(rec.failing_at) if rec.failing_at is not None else None,
        )

    def _node_gpus(self, st: Story, s: ViewState, name: str, gpus: list[ev.GpuInfo]) -> None:
        """The node's GPUs, each with the replica that holds it."""
        holders: dict[int, ReplicaRecord] = {}
        for r in s.replicas.values():
            if r.holds_capacity:
                for sh in r.shards:
                    if sh.node == name:
                        for g in sh.gpus:
                            holders[g] = r
        st.line("")
        rows = []
        for gpu in gpus:
            held = holders.get(gpu.index)
            rows.append(
                [
                    str(gpu.index),
                    gpu.model,
                    "yes" if gpu.healthy else "NO",
                    "-" if held is None else held.id,
                    "-" if held is None else f"{held.model} {held.state}",
                ]
            )
        st.line(table(["GPU", "MODEL", "HEALTHY", "HELD BY", "AS"], rows, "  ") or "  (no GPUs)")
        st.facts["gpus"] = [
            {
                "index": g.index,
                "healthy": g.healthy,
                "replica": holders[g.index].id if g.index in holders else None,
            }
            for g in gpus
        ]

    def _node_failures(self, st: Story, s: ViewState, name: str) -> None:
        """The replicas that failed with the node, and its shards of gangs that failed
        on another node."""
        # The replicas the fold failed for what the node became: lost past its grace, or
        # a report that no longer has their GPUs (fewer, another model, smaller). A gang
        # failed elsewhere is not one of them: its shard here failed because another did
        # (`failed_on`), and was drained.
        failed = sorted(
            (
                r
                for r in s.replicas.values()
                if (r.state == "failed" or name in r.failed_on)
                and r.reason is not None
                and r.reason.startswith(("node lost", f"node {name} no longer"))
                and any(sh.node == name for sh in r.shards)
                and (not r.failed_on or name in r.failed_on)
            ),
            key=lambda r: r.updated_at,
        )[-RECENT:]
        if failed:
            st.line("")
            st.line(f"replicas failed with the node (the last {len(failed)})")
            for r in failed:
                st.line(f"  {r.id} ({r.model}) {stamp(r.updated_at)}: {r.reason}")
        st.facts["failed"] = [
            {"replica": r.id, "model": r.model, "reason": r.reason} for r in failed
        ]
        broken = sorted(
            (
                r
                for r in s.replicas.values()
                if r.failed_on
                and name not in r.failed_on
                and any(sh.node == name for sh in r.shards)
            ),
            key=lambda r: r.updated_at,
        )[-RECENT:]
        if broken:
            st.line("")
            st.line(f"shards here of replicas that failed on another node (the last {len(broken)})")
            for r in broken:
                st.line(
                    f"  a shard of {r.id} ({r.model}) failed because {_broke(r)}; {_after(r, name)}"
                )
        st.facts["shard_failed"] = [
            {
                "replica": r.id,
                "model": r.model,
                "failed_on": list(r.failed_on),
                "reason": r.reason,
                "stopped": name in r.stopped_on,
            }
            for r in broken
        ]

    def _node_moves(self, st: Story) -> None:
        """The placements and drains on the node, and its events the fold rejected."""
        entries = self.timeline.entries
        moves = [
            e
            for e in entries
            if e.type in ("placement.decided", "replica.drain") and not e.rejected
        ]
        st.line("")
        st.line(
            f"replicas placed or drained here (the last {len(moves[-RECENT:])})"
            if moves
            else "replicas placed or drained here: none in the log"
        )
        for x in moves[-RECENT:]:
            st.line(f"  seq {x.seq} {stamp(x.time)} ({ago(x.time, st.now)}) {x.type} {x.summary}")
        st.facts["moves"] = [x.to_json() for x in moves[-RECENT:]]
        rejected = [x for x in entries if x.rejected]
        st.line("")
        st.line(
            f"events about it the fold rejected ({len(rejected)}; the last {len(rejected[-RECENT:])})"
            if rejected
            else "events about it the fold rejected: none"
        )
        for x in rejected[-RECENT:]:
            st.line(f"  seq {x.seq} {stamp(x.time)} {x.type} {x.summary}: {x.rejected}")
        st.facts["rejected"] = [x.to_json() for x in rejected[-RECENT:]]


def _broke(r: ReplicaRecord) -> str:
    """Why a gang failed, in words naming the nodes whose shards failed (`failed_on`)."""
    where = ", ".join(r.failed_on)
    why = r.reason or ""
    if why.startswith("node lost"):
        return f"{where} {'was' if len(r.failed_on) == 1 else 'were'} lost ({why})"
    if why.startswith("node ") and " no longer has its GPUs" in why:
        return why.split(":", 1)[0].replace(" has ", " had ")
    return f"its shard on {where} failed ({why or 'no reason given'})"


def _after(r: ReplicaRecord, node: str) -> str:
    """What became of a failed gang's shard on `node`: stopped, or held until it is."""
    if node in r.stopped_on:
        return "drained, and stopped"
    if node in r.drained_on:
        return "drained; its GPUs stay held until it says stopped"
    return "not drained yet; its GPUs stay held until it says stopped"


def _leaving(r: ReplicaRecord) -> str:
    if r.preempted_for:
        return f"preempted for {r.preempted_for}"
    if r.retiring_at is not None:
        return "retiring (scale down)"
    if r.drain_reason:
        return f"draining: {r.drain_reason}"
    return ""


@dataclass
class Wake:
    """A model's wake-up by demand, as far as the log has told it (`_follow_wake`)."""

    scale: tuple[int, ev.ScaleDesiredEvent]
    demand: tuple[int, ev.ModelDemandedEvent] | None = None
    failed: tuple[int, ev.PlacementFailedEvent] | None = None
    decision: tuple[int, ev.PreemptionDecidedEvent] | None = None
    drains: list[tuple[int, ev.ReplicaDrainEvent]] = field(default_factory=list)
    placed: tuple[int, ev.PlacementDecidedEvent] | None = None
    ready: tuple[int, ev.ReplicaStateEvent] | None = None


@dataclass
class Story:
    """What `explain` prints, and its key facts for `--json`."""

    kind: str
    name: str
    now: Any
    replica: ReplicaRecord | None = None
    lines: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    timeline: list[history.Entry] = field(default_factory=list)
    tail: int | None = None
    """Show only the last `tail` timeline entries as text (JSON has them all)."""

    def line(self, text: str) -> None:
        # One entry per printed line, so `--json`'s text is a list of lines, tables too.
        self.lines.extend(text.split("\n"))

    def text(self) -> str:
        entries = self.timeline
        head = "timeline"
        if self.tail is not None and len(entries) > self.tail:
            head += (
                f" (the last {self.tail} of {len(entries)} events; "
                f"`llmgw history {self.kind} {self.name}` has them all)"
            )
            entries = entries[-self.tail :]
        return "\n".join([*self.lines, "", head, history.text(entries, self.now)])

    def to_json(self) -> dict[str, Any]:
        from services.replay import render

        doc: dict[str, Any] = {"kind": self.kind, "name": self.name, **self.facts}
        if self.replica is not None:
            doc["replica"] = render.replica_json(self.replica, self.now)
        doc["text"] = self.lines
        doc["timeline"] = [e.to_json() for e in self.timeline]
        return doc


def _by(counts: dict[str, int], prefix: str) -> str:
    """`counts` in words, as `(of all: tier 0: 3, tier 2: 40)`; "" when empty (a decision
    from before they were recorded)."""
    if not counts:
        return ""
    return " (of all: " + ", ".join(f"{prefix}{k}: {n}" for k, n in counts.items()) + ")"
