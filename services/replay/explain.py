"""Why a replica is in its state: `llmgw explain replica R`.

Called by `services.cli.replay` as a `rebuild.Watcher` over the whole log up to the
moment asked about, then `story(view)`. It follows the chain the events themselves
record (a replica's `drained_by` / `placed_by`, each event's `causation`, a
`preemption.decided`'s `trigger`) back to the decision and the rule that took it, and
falls back to matching by model and order only where an id is missing. It re-decides
nothing: every line it prints is something the log says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas import events as ev
from services.core import preemption
from services.core.view import Rejection, ReplicaRecord, View
from services.replay import history
from services.replay.errors import UnknownEntity
from services.replay.render import ago, duration, stamp, table
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
    ev.ReplicaDrainEvent,
    ev.HoldCreatedEvent,
    ev.HoldReleasedEvent,
    ev.NodeLostEvent,
)


def tier_words(tier: int) -> str:
    return f"tier {tier}: {TIER_MEANING.get(tier, 'a tier this tool does not know')}"


def _idle(s: float | None) -> str:
    return "unknown" if s is None else duration(s)


@dataclass
class Explainer:
    """Collects what `story` needs while the log is folded."""

    replica: str
    root: str = "llmgw"
    timeline: history.Timeline = field(init=False)
    by_id: dict[str, tuple[int, ev.Envelope]] = field(default_factory=dict)
    preemptions: list[tuple[int, ev.PreemptionDecidedEvent]] = field(default_factory=list)
    holds: list[tuple[int, ev.HoldCreatedEvent]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.timeline = history.Timeline("replica", self.replica, self.root)

    def before(self, item: Item, view: View) -> None:
        self.timeline.before(item, view)

    def after(self, item: Item, rejection: Rejection | None, view: View) -> None:
        self.timeline.after(item, rejection, view)
        e = item.event
        if isinstance(e, INDEXED):
            self.by_id[e.id] = (item.seq, e)
        if isinstance(e, ev.PreemptionDecidedEvent) and any(
            v.replica == self.replica for v in e.data.victims
        ):
            self.preemptions.append((item.seq, e))
        elif isinstance(e, ev.HoldCreatedEvent):
            self.holds.append((item.seq, e))

    # ---------------------------------------------------------------- the story

    def story(self, view: View) -> Story:
        r = view.state.replicas.get(self.replica)
        if r is None:
            hint = "; see `llmgw view` for the replicas there are"
            if self.timeline.entries:
                hint = " as a replica the view kept (every event about it was rejected); see `llmgw history replica`"
            raise UnknownEntity("replica", self.replica, hint)
        st = Story(replica=r, now=view.state.time)
        decl = view.state.models.get(r.model)
        cls = decl.cls if decl is not None else "undeclared"
        where = "+".join(f"{s.node}[{','.join(map(str, s.gpus))}]" for s in r.shards) or "no GPUs"
        st.line(f"replica {r.id} of {r.model} ({cls}) is {r.state}, on {where}")
        st.line(
            f"  since {stamp(r.updated_at)} ({ago(r.updated_at, st.now)}); created "
            f"{stamp(r.created_at)}; ready {ago(r.ready_at, st.now) if r.ready_at else 'never'}; "
            f"idle {_idle(r.idle_s(st.now) if st.now else None)}"
        )
        st.line("")
        if r.preempted_for is not None or r.drain_reason == "preempted":
            self._preempted(st, r, view)
        elif r.drain_reason == "scale_down" or r.retiring_at is not None:
            self._scaled_down(st, r)
        elif r.drain_reason is not None:
            self._drained(st, r)
        elif r.state == "failed":
            self._failed(st, r)
        else:
            self._placed(st, r)
        st.line("")
        st.line("timeline")
        st.line(history.text(self.timeline.entries, st.now))
        return st

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
        if decision is None and self.preemptions:
            # No causation on the drain: the latest decision naming this replica a victim.
            decision = self.preemptions[-1]
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
            if me is not None:
                st.line(f"  rule       {tier_words(me.tier)}")
                st.line(
                    f"             its class {me.cls}; above its model's minimum: "
                    f"{'yes' if me.above_min else 'no'}; idle {_idle(me.idle_s)}; "
                    f"frees {me.gpus} GPUs"
                )
                st.facts["tier"] = me.tier
                st.facts["tier_meaning"] = TIER_MEANING.get(me.tier)
            victims = ", ".join(f"{v.replica} ({v.model}, tier {v.tier})" for v in d.data.victims)
            st.line(f"  victims    {victims}")
            self._considered(st, d.data, r.id)
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

    def _considered(self, st: Story, d: ev.PreemptionDecided, me: str) -> None:
        victims = {v.replica for v in d.victims}
        cands = d.candidates
        st.line(f"  considered {max(d.considered, len(cands))} candidates")
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
        if d.excluded:
            st.line("  excluded")
            for x in d.excluded:
                st.line(
                    f"             {x.replica}"
                    + (f" ({x.model})" if x.model else "")
                    + f": {preemption.WHY.get(x.why, x.why)}"
                )
        st.facts["excluded"] = {x.replica: x.why for x in d.excluded}
        for t in d.trials:
            st.line(f"  trial      [{', '.join(t.victims)}] {'fits' if t.fits else 'does not fit'}")

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
        cur = view.state.holds.get(r.model)
        if cur is not None and cur.created_by == h.id:
            on = now is not None and view.active_hold(r.model, now) is not None
            state = "still on" if on else "over"
        else:
            state = "released or replaced since"
        st.line(
            f"  hold       {r.model} held for {h.data.for_model} until {stamp(h.data.until)} "
            f"({ago(h.data.until, now)}), {state}; {self._ref(seq, h, now)}"
        )
        st.facts["hold"] = {"until": stamp(h.data.until), "for_model": h.data.for_model}

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
                f"{sd.data.replicas} replicas (by {sd.source})"
            )
            st.facts["cause"] = sd.id

    def _drained(self, st: Story, r: ReplicaRecord) -> None:
        drain = self._drain(r)
        st.line(f"why: drained ({r.drain_reason})")
        st.facts["why"] = r.drain_reason
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
        cause = self._event(pd.causation)
        if cause is not None:
            s, ce = cause
            st.line(f"  cause      {self._ref(s, ce, st.now)}")


@dataclass
class Story:
    """What `explain` prints, and its key facts for `--json`."""

    replica: ReplicaRecord
    now: Any
    lines: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def line(self, text: str) -> None:
        self.lines.append(text)

    def text(self) -> str:
        return "\n".join(self.lines)
