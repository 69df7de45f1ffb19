"""The preemption policy: which replicas to stop so a model that does not fit can be placed.

Called by the preemption service when `placement.failed` (reason no_fit) arrives for a
model, by `llmgw preemption plan` to ask "what would happen if…", and by replay to
explain a past decision. `plan(view, model, now, config)` reads the folded view and
returns a `Decision`; it changes nothing. Publishing `preemption.decided`, the drains and
the holds is the caller's step. No I/O, no clock: `now` is a parameter, and the same view,
model, time and config always give the same decision.

A port of the reference's `preemptFor` (reference/preempt.go), rule for rule:

What may be taken from whom:

- A lower class gives way to a higher one: opportunistic to standard, standard to
  critical.
- Within a class, only a replica above its model's minimum, and only for a model still
  below its own. Room a model grew into under load is not a promise; its minimum is.
- A critical model's minimum is never taken.
- A replica within its owner's guarantee is taken only for a model of the same owner: a
  guarantee that another tenant's higher class could take is not one.
- What another owner borrowed past its guarantee is taken back, whatever the classes,
  by an owner still within its own.

Victims only ever come from a lower rank, or from above a minimum for a model below one,
so two models cannot take turns stopping each other; the hold on each victim's model
keeps that true while the room changes hands.

The set of victims is tried on a clone of the inventory first, and only stopped if it
would let the model be placed: stopping replicas that do not make room is the one outcome
worse than not preempting.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, Literal, Protocol, TypeVar

import msgspec

from schemas import events as ev
from services.core import catalog, node_aware, placement, quota
from services.core.inventory import Inventory
from services.core.view import ReplicaRecord, View, before, size_of


class _Named(Protocol):
    @property
    def replica(self) -> str: ...


_C = TypeVar("_C", bound=_Named)
_O = TypeVar("_O")

Outcome = Literal[
    "fits",
    "preempted",
    "no_candidates",
    "no_fit",
    "awaiting",
    "quota_limit",
    "held",
    "unknown_model",
]

# WHY names every reason a replica is not a candidate, as the short stable codes the
# decision carries, with the sentence `llmgw explain` shows for each.
WHY: dict[str, str] = {
    "same_model": "a replica of the model being placed",
    "retiring": "already retiring (scale down)",
    "already_preempted": "already stopped for another model",
    "draining": "already draining",
    "unknown_model": "its model is not in the catalog",
    "guaranteed": "within its owner's guarantee, and the model is another owner's",
    "critical_minimum": "part of a critical model's minimum, which is never taken",
    "not_lower_class": "not a lower class, and no other rule lets it be taken",
    "young": "ready for less than the minimum lifetime",
    "multi_node": "spread over more than one node",
}


# POLICIES names the searches for victims. Both take the same candidates, tiers,
# exclusions, cap, dry run and pruning; they differ in which sets they try
# (`services.core.node_aware`).
Policy = Literal["reference", "node-aware"]
POLICIES: tuple[str, ...] = ("reference", "node-aware")


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The policy's knobs, with the reference's defaults (and the help text of their
    flags, see `services.flags`).

    hold_s: how long a model that gave up room is kept from taking it back (the hold
    ends earlier once the model it was given to has what it asked for). Long enough for
    the model it was freed for to be placed and load, so the room is not fought over
    while it changes hands.

    eviction_grace_s: an on-demand (min 0) replica of a lower class unused for at least
    this long is tier 0, the first to go. Shorter, and a model between two bursts of
    traffic would be stopped and have to load again for the next one. A replica never
    reported used counts as unused for 0 s, so with a grace of 0 it is tier 0 too, as in
    the reference.

    min_lifetime_s: a replica ready for less than this is never a victim. Stopping it
    throws away a model load that has only now been paid for.

    max_victims: the most replicas one placement may stop. Past this the model is better
    reported as not fitting than paid for with half a cluster.

    policy: which sets of victims are tried. "reference" tries the first candidates in
    tier order, wherever they are, as the reference does; "node-aware" weighs every set
    within the cap on the node the model would go to and takes the best
    (`services.core.node_aware`).
    """

    hold_s: float = field(
        default=300.0,
        metadata={"help": "how long a model that gave up room is held back"},
    )
    eviction_grace_s: float = field(
        default=600.0,
        metadata={
            "flag": "--grace",
            "help": "idle time after which an on-demand replica is evicted first",
        },
    )
    min_lifetime_s: float = field(
        default=120.0,
        metadata={"help": "a replica ready for less than this is never preempted"},
    )
    max_victims: int = field(
        default=3, metadata={"least": 1, "help": "most replicas one placement may stop"}
    )
    policy: Policy = field(
        default="reference",
        metadata={
            "choices": POLICIES,
            "help": "how victims are searched for: reference (the first candidates in "
            "tier order) or node-aware (the best set on the node the model would go to)",
        },
    )

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown policy {self.policy!r}: expected one of {', '.join(POLICIES)}"
            )


class Candidate(msgspec.Struct, frozen=True, gc=False):
    """A replica that may be stopped for the model, and where it stands in the order.

    Its fields may be given in order: the policy makes hundreds per call, and msgspec
    matches a dozen keywords in about three times the time it takes them in order.

    `idle_s` None means nobody ever reported the replica used, which is not the same as
    idle: it orders as 0, and is tier 0 only under a grace of 0 (see `_Weighing._part`).
    Negative when its last use was stamped after the decision's `now`.
    """

    replica: str
    model: str
    cls: str
    owner: str
    tier: int
    above_min: bool
    idle_s: float | None
    gpus: int
    cpu_cores: float
    memory_gb: float
    node: str
    borrowed: bool
    """Held past its owner's guarantee."""

    def to_victim(self) -> ev.Victim:
        return ev.Victim(
            replica=self.replica,
            model=self.model,
            cls=self.cls,
            tier=self.tier,
            above_min=self.above_min,
            idle_s=self.idle_s,
            gpus=self.gpus,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "model": self.model,
            "class": self.cls,
            "tier": self.tier,
            "above_min": self.above_min,
            "idle_s": self.idle_s,
            "gpus": self.gpus,
        }


class Exclusion(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A replica holding capacity that is not a candidate, and why (a code of `WHY`)."""

    replica: str
    model: str
    why: str
    detail: str = ""
    """The same reason in a sentence, with this replica's numbers."""


class TrialResult(msgspec.Struct, frozen=True, kw_only=True):
    """One set of victims tried on a clone of the inventory, and whether the model fit."""

    victims: tuple[str, ...]
    fits: bool
    placement: placement.Placement | None = None
    pruning: bool = False
    """Tried while dropping victims whose stopping proved unneeded."""


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy decided for one model at one time, and everything it weighed.

    Rich enough for `llmgw explain replica R`: a victim's entry says which tier it was
    taken in, the candidates and exclusions say what else was considered, and the trials
    say which sets were tried before this one.
    """

    model: str
    outcome: Outcome
    now: datetime
    reason: str
    """One line for people: why this outcome."""
    cls: str = catalog.DEFAULT_CLASS
    """The model's effective class."""
    owner: str = ""
    live: int = 0
    min: int = 0
    below_min: bool = False
    """Whether the model had fewer live replicas than its minimum (tier 3 needs it)."""
    reclaim: bool = False
    """Whether the model's owner stays within its guarantee with one more replica, so
    what others borrowed past theirs is tier 1."""
    profiles: tuple[str, ...] = ()
    """The profiles tried, in order (those within the owner's limits)."""
    avoid: tuple[str, ...] = ()
    victims: tuple[Candidate, ...] = ()
    holds: tuple[ev.HoldSpec, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    excluded: tuple[Exclusion, ...] = ()
    trials: tuple[TrialResult, ...] = ()
    placement: placement.Placement | None = None
    """Where the model would go: with nothing stopped (fits) or with the victims gone."""
    awaiting: tuple[str, ...] = ()
    """Victims of an earlier decision for the model that still hold capacity."""
    held_for: str | None = None
    """The model this one gave up room to, when it is held."""
    config: Config = Config()

    def to_event_data(self, trigger_id: str = "", shown: int | None = None) -> ev.PreemptionDecided:
        """The `preemption.decided` data; `trigger_id` is the placement.failed it answers.

        With `shown`, only the first `shown` candidates and exclusions are listed, and
        the victims past them (`listed`; what the published event keeps, see
        `services.core.reaction.bounded`); `considered` is the whole count either way."""
        victims = {v.replica for v in self.victims}
        return ev.PreemptionDecided(
            for_model=self.model,
            outcome=self.outcome,
            victims=tuple([v.to_victim() for v in self.victims]),
            considered=len(self.candidates),
            trigger=trigger_id,
            candidates=tuple([c.to_victim() for c in listed(self.candidates, victims, shown)]),
            excluded=tuple(
                [
                    ev.Excluded(replica=x.replica, model=x.model, why=x.why)
                    for x in self.excluded[:shown]
                ]
            ),
            trials=tuple([ev.Trial(victims=t.victims, fits=t.fits) for t in self.trials]),
            holds=self.holds,
            policy=self.config.policy,
        )

    def to_json(self) -> dict[str, Any]:
        """The decision as `llmgw preemption plan --json` prints it."""
        return {
            "model": self.model,
            "outcome": self.outcome,
            "victims": [v.to_json() for v in self.victims],
            "holds": [
                {"model": h.model, "for_model": h.for_model, "until": _rfc3339(h.until)}
                for h in self.holds
            ],
            "candidates": [c.to_json() for c in self.candidates],
            "excluded": [{"replica": x.replica, "why": x.why} for x in self.excluded],
            "trials": [{"victims": list(t.victims), "fits": t.fits} for t in self.trials],
        }


def listed(candidates: Sequence[_C], victims: Collection[str], shown: int | None) -> list[_C]:
    """The candidates a published decision lists: the first `shown` in order (all when
    None), then every victim past them, in order. The reference's victims are always
    among the first (it tries the candidates in order); node-aware's may come from
    anywhere in the order, and `llmgw explain` of a victim shows its own row."""
    if shown is None or len(candidates) <= shown:
        return list(candidates)
    head = list(candidates[:shown])
    if len(victims) == sum(c.replica in victims for c in head):
        return head  # no victim past them: the rest need not be looked at
    return [*head, *(c for c in candidates[shown:] if c.replica in victims)]


def _rfc3339(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def effective_class(m: catalog.Model) -> str:
    """The model's class as ranked: an unknown class counts as the default."""
    return m.cls if m.cls in catalog.CLASSES else catalog.DEFAULT_CLASS


def plan(
    view: View,
    model: str,
    now: datetime,
    config: Config | None = None,
    *,
    avoid: Iterable[str] = (),
) -> Decision:
    """The decision the policy takes for one more replica of `model` at `now`.

    `avoid` is the placement's soft preference (placement.failed's `avoid`): every trial
    tries without those nodes first, then with them, as the scheduler would.

    In order: an unknown model, a held model, an owner past its limit, a model that fits
    without stopping anything, a model still waiting for earlier victims, and only then
    the choice of victims.
    """
    cfg = config if config is not None else Config()
    avoided = tuple(sorted(set(avoid)))
    m = view.catalog.resolve(model)
    if m is None:
        return Decision(
            model=model,
            outcome="unknown_model",
            now=now,
            reason=f"model {model} is not in the catalog",
            avoid=avoided,
            config=cfg,
        )
    base: dict[str, Any] = {
        "model": m.name,
        "now": now,
        "cls": effective_class(m),
        "owner": m.owner,
        # The project's reading of the reference's liveCount: a replica of this model
        # preempted for another no longer counts as live for it (`ReplicaRecord.live`).
        # It was given up; counted, the model would look at its minimum while below it,
        # and tier 3 would not take for it what the model is owed.
        "live": view.live_of(m),
        "min": m.min,
        "avoid": avoided,
        "config": cfg,
    }

    # A held model gave up room for another and may not take it back until the hold
    # ends: otherwise the two would trade the same GPUs back and forth.
    hold = view.active_hold(m.name, now)
    if hold is not None:
        return Decision(
            outcome="held",
            reason=f"{m.name} gave up room for {hold.for_model} and is held until "
            f"{_rfc3339(hold.until)}",
            held_for=hold.for_model,
            **base,
        )

    # An owner past a limit is not placed, and preemption does not run for it: a limit
    # is a ceiling on what the owner may hold, which stopping others' replicas cannot lift.
    #
    # What every replica holds is summed only when a limit or a guarantee reads it, and
    # only up the owner's own chain: all that the limits and the reclaim test look at.
    tree = view.quota
    holdings: list[quota.Holding] | None = None
    usage: dict[str, quota.Amount] = {}
    if any(q.limit is not None for q in tree.governing(m.owner)):
        holdings = view.holdings(_counted_owners(view, m.owner))
        usage = tree.usage_of(m.owner, holdings)
    profiles = [p for p in m.profiles if tree.within_limit(m.owner, usage, p.need())]
    if not profiles:
        return Decision(
            outcome="quota_limit",
            reason=f"owner {m.owner} would pass a limit with any profile of {m.name}",
            **base,
        )
    base["profiles"] = tuple(p.name for p in profiles)

    answers = placements(view)
    key = (tuple(profiles), avoided, ())
    found = answers.get(key)
    if found is None:
        found = answers[key] = placement.place(view.inventory, profiles, avoided)
    if isinstance(found, placement.Placement):
        return Decision(
            outcome="fits",
            reason=f"{m.name} fits as {found.profile.name} without stopping anything",
            placement=found,
            **base,
        )

    # While victims of an earlier decision are still on their way out, the model waits
    # for the room they free rather than stopping more.
    waiting = view.awaiting(m.name)
    if waiting:
        return Decision(
            outcome="awaiting",
            reason=f"waiting for {', '.join(waiting)} to stop",
            awaiting=waiting,
            **base,
        )

    return _preempt(view, m, now, cfg, profiles, avoided, holdings, usage, base)


def _preempt(
    view: View,
    m: catalog.Model,
    now: datetime,
    cfg: Config,
    profiles: list[catalog.Profile],
    avoided: tuple[str, ...],
    holdings: list[quota.Holding] | None,
    usage: dict[str, quota.Amount],
    base: dict[str, Any],
) -> Decision:
    """The choice of victims, once m neither fits nor waits: which replicas may go, and
    the fewest of them, in order, that make room."""
    tree = view.quota
    # The owner reclaims only if it stays within its guarantee whichever profile the
    # model is placed in: the replica it gets must not itself be borrowed, or the owner
    # it took from could take it straight back.
    # With no guarantee anywhere nobody reclaims and nothing is covered: the holdings
    # are not needed at all.
    if holdings is None and tree.any_guarantee():
        holdings = view.holdings(_counted_owners(view, m.owner))
        usage = tree.usage_of(m.owner, holdings)
    reclaim = all(tree.guaranteed(m.owner, usage, p.need()) for p in profiles)
    below_min = base["live"] < m.min
    cands, excluded = _candidates(view, m, now, cfg, holdings or [], reclaim, below_min)
    base |= {"reclaim": reclaim, "below_min": below_min, "candidates": cands}
    base["excluded"] = excluded
    if not cands:
        return Decision(
            outcome="no_candidates",
            reason=f"{m.name} does not fit and no replica may be stopped for it "
            f"({len(excluded)} excluded)",
            **base,
        )

    if cfg.policy == "node-aware":
        chosen, trials = _choose_node_aware(view, profiles, avoided, cands, cfg.max_victims)
        why_not = (
            f"{m.name} would not fit with any set of at most {cfg.max_victims} "
            "candidate(s) stopped on the node(s) it could go to"
        )
    else:
        chosen, trials = _choose(view, profiles, avoided, cands, cfg.max_victims)
        tried = min(len(cands), cfg.max_victims)
        why_not = f"{m.name} would not fit even with its first {tried} candidate(s) stopped"
    if not chosen:
        return Decision(
            outcome="no_fit",
            reason=f"{why_not}; nothing is stopped",
            trials=trials,
            **base,
        )
    until = now + timedelta(seconds=cfg.hold_s)
    held = dict.fromkeys(v.model for v in chosen)
    last_fit = next(t for t in reversed(trials) if t.fits)
    return Decision(
        outcome="preempted",
        reason=f"stopping {', '.join(v.replica for v in chosen)} makes room for {m.name}",
        victims=tuple(chosen),
        holds=tuple(ev.HoldSpec(model=h, for_model=m.name, until=until) for h in held),
        trials=trials,
        placement=last_fit.placement,
        **base,
    )


def _counted_owners(view: View, owner: str) -> set[str]:
    """The owners whose replicas the quota math for `owner` reads: those sharing a level
    of its chain (its usage) and those under a guarantee (what is borrowed). Everyone
    else's holdings change neither; a replica of an owner under no guarantee is borrowed
    whatever it holds."""
    tree = view.quota
    mine = {q.name for q in tree.governing(owner)}
    everyone = {x.owner for x in view.catalog.models()}
    everyone.add("default")  # a replica of a model not in the catalog
    return {
        o
        for o in everyone
        if tree.has_guarantee(o) or any(q.name in mine for q in tree.governing(o))
    }


# The exclusions as `_candidates` collects them: per replica id, (model, why, detail),
# one tuple shared by every replica of a model excluded for the same reason. Each
# becomes an `Exclusion` once, in its model's block (`_Block`).
_Excluded = dict[str, tuple[str, str, str]]

# A candidate behind its order key (see `_Weighing.ranked`).
_Ranked = tuple[int, float, tuple[int, float], str, Candidate]

# KEPT bounds the weighings the policy keeps per view (`_kept`): one per kind of model it
# was last asked about (`_alike`: class, owner, the two flags that change the tier rules,
# the two settings). A full cluster asks about the few models that do not fit, again
# and again; past this many kinds the least recently asked about go. Each holds an
# entry per replica holding capacity: about 0.9 MB on a cluster of 4,000 replicas none
# of which was ever used (bench_policy's). Besides, `_own` keeps one block per model
# name, its replicas as same_model exclusions.
KEPT = 32


class _Block:
    """One model's replicas (by the name they give) weighed for one model m: its
    candidates behind their order keys and its exclusions by replica id, and what they
    were worked out from: the view's `version` of the name (its `state_version` when no
    replica's last use was read: `reads_use`), the model it resolves to (m itself for
    m's own replicas), and the time. Used again while all of that holds and time has
    only gone forward, unless it read the time or the quota usage of its moment
    (`timely`): such a block is used again only at the very time it was weighed at, and
    only if it did not read the quota usage (`usage`)."""

    __slots__ = (
        "excluded",
        "other",
        "ranked",
        "reads_use",
        "since",
        "state",
        "timely",
        "usage",
        "version",
    )

    def __init__(
        self,
        version: int,
        state: int,
        other: catalog.Model | None,
        since: datetime,
        timely: bool,
        reads_use: bool,
        usage: bool,
        ranked: list[_Ranked],
        excluded: list[tuple[str, Exclusion]],
    ) -> None:
        self.version, self.state, self.other, self.since = version, state, other, since
        self.timely, self.reads_use, self.usage = timely, reads_use, usage
        self.ranked, self.excluded = ranked, excluded

    def holds(self, version: int, state: int, other: catalog.Model | None, now: datetime) -> bool:
        """Whether the block still holds at `now`, with the name's `version` and
        `state_version` and what the name resolves to then: a later use of one of its
        replicas changes nothing a block that never read one says."""
        return (
            (version == self.version or (not self.reads_use and state == self.state))
            and other is self.other
            and now >= self.since
        )

    def holds_at(
        self, version: int, state: int, other: catalog.Model | None, now: datetime
    ) -> bool:
        """Whether a block that read the time (`timely`) still holds: as `holds`, at the
        very time it was weighed at (every idle time and age it read is the same then),
        and only if it did not read the quota usage of its moment, which moves with
        replicas of other models (`usage`)."""
        return not self.usage and now == self.since and self.holds(version, state, other, now)


class _Ordered(Generic[_O]):
    """Entries in order, each a key ending in its object (a candidate behind its order
    key, an exclusion behind its replica id; the key's last part is never compared,
    since the part before it, a replica id, is unique), and the objects alone in the
    same order, so that a tuple of them costs a copy rather than a walk."""

    __slots__ = ("keys", "objs")

    def __init__(self) -> None:
        self.keys: list[tuple[Any, ...]] = []
        self.objs: list[_O] = []

    def remove(self, old: list[tuple[Any, ...]]) -> None:
        """Take out `old`, entries that are here (or equal ones: an entry an earlier block
        put in stays while the blocks after it weigh it the same). A few are found by
        halving; many, by one walk through the list, by replica id."""
        keys, objs = self.keys, self.objs
        if len(old) <= _FEW:
            for k in old:
                i = bisect.bisect_left(keys, k)
                del keys[i]
                del objs[i]
            return
        drop = {k[-2] for k in old}
        self.keys = keys = [k for k in keys if k[-2] not in drop]
        self.objs = list(map(_last, keys))

    def add(self, new: list[tuple[Any, ...]]) -> None:
        """Put `new` in at their places: a few one by one, which compares each with a
        handful of entries, where sorting again would compare every entry with the next
        to find them already in order."""
        keys, objs = self.keys, self.objs
        if len(new) <= _FEW:
            for k in new:
                i = bisect.bisect_left(keys, k)
                keys.insert(i, k)
                objs.insert(i, k[-1])
            return
        keys += new
        keys.sort()
        self.objs = list(map(_last, keys))

    def with_(
        self,
        extra: list[tuple[Any, ...]],
        without: Sequence[tuple[Any, ...]] = (),
    ) -> tuple[_O, ...]:
        """The objects, less those of `without` (entries that are here) and with those of
        `extra` (in order; none of their replicas here but for those of `without`) in
        their places: each found by halving, on the key without its object (an entry
        of `extra` may share its replica id with one of `without`), and the runs
        between them copied; past a few in a long list, by one walk and one merge (a
        sort of two runs in order)."""
        keys, objs = self.keys, self.objs
        if len(extra) + len(without) > _FEW + len(keys) // 8:
            if without:
                drop = {k[-2] for k in without}
                keys = [k for k in keys if k[-2] not in drop]
            return tuple(map(_last, sorted(keys + extra)))
        # (place, 0, object to put in before the entry there) or (place, 1, None: the
        # entry there left out); at one place, what is put in comes first.
        cuts: list[tuple[int, int, Any]] = [
            (bisect.bisect_left(keys, k[:-1]), 1, None) for k in without
        ]
        cuts += [(bisect.bisect_left(keys, k[:-1]), 0, k[-1]) for k in extra]
        if without:
            cuts.sort(key=_place)
        out: list[_O] = []
        last = 0
        for i, skip, obj in cuts:
            out += objs[last:i]
            if skip:
                last = i + 1
            else:
                out.append(obj)
                last = i
        out += objs[last:]
        return tuple(out)


_FEW = 32
_place = operator.itemgetter(0, 1)
# An entry's object (see `_Ordered`): mapped over a list, a third quicker than a
# comprehension that indexes each.
_last = operator.itemgetter(-1)


class _Kept:
    """What the policy keeps on a view for the models alike in class and owner, under
    the same flags and settings (`_kept`, `_alike`): the latest block of every model
    holding capacity that did not read the time (a model's own replicas weighed as any
    other's, as the others alike weigh them), the candidates and exclusions of all those
    blocks in their orders, and what `_peer` worked out (which reads only what `_alike`
    names and the quota tree); besides, the blocks of the last call that read the time
    (`timely`, one per model name at most), and the last answer of each list (`merged_ranked`,
    `merged_excluded`)."""

    __slots__ = (
        "blocks",
        "excluded",
        "merged_excluded",
        "merged_ranked",
        "peers",
        "ranked",
        "timely",
        "tree",
        "walked",
    )

    def __init__(self, tree: quota.QuotaTree) -> None:
        self.tree = tree
        self.blocks: dict[str, _Block] = {}
        self.ranked: _Ordered[Candidate] = _Ordered()
        self.excluded: _Ordered[Exclusion] = _Ordered()
        self.peers: dict[tuple[str, str, bool], _Peer] = {}
        self.timely: dict[str, _Block] = {}
        """Per model name, its block weighed at the last call, when that read the time:
        used again by a call at the same time (`_Block.holds_at`). Replaced each call."""
        self.walked: tuple[int, tuple[catalog.Model, ...], datetime] | None = None
        """When every model's block was last checked: `View.changes`, the catalog's
        `by_rank()` and the time. A pass reports the models it cannot place one after
        another at one time, and between two of their calls most often nothing changed
        (a decision changes no replica until its victims' drains are folded): while
        these stay, every block checked then holds, those that read the time or the
        quota usage of the moment too (no replica changed, so neither did the usage;
        the quota tree is the one of these lists, `_kept`)."""
        self.merged_ranked: tuple[_MergedKey, tuple[Candidate, ...]] | None = None
        """The last candidates answered, with the blocks whose candidates it put in among
        the kept ones (the timely ones) and took out (m's replicas as any other's),
        compared by identity: the same blocks put in and taken out of the same list
        give the same answer. Dropped whenever the lists change (`update`)."""
        self.merged_excluded: tuple[_MergedKey, tuple[Exclusion, ...]] | None = None
        """The same for the exclusions (m's own put in besides the timely ones)."""

    def update(self, fresh: dict[str, _Block]) -> None:
        """Make the lists those of `fresh`: the entries of every block no longer there
        go, those of every new block come in at their place. A model weighed again
        mostly weighs as before (one replica of many changed): only the entries that
        differ move, and the new block takes the equal ones already here."""
        old = self.blocks
        self.blocks = fresh
        out_r: list[tuple[Any, ...]] = []
        in_r: list[tuple[Any, ...]] = []
        out_x: list[tuple[Any, ...]] = []
        in_x: list[tuple[Any, ...]] = []
        for name, b in old.items():
            nb = fresh.get(name)
            if nb is None:
                out_r += b.ranked
                out_x += b.excluded
            elif nb is not b:
                _diff(b.ranked, nb.ranked, out_r, in_r)
                _diff(b.excluded, nb.excluded, out_x, in_x)
        for name, nb in fresh.items():
            if name not in old:
                in_r += nb.ranked
                in_x += nb.excluded
        if out_r or in_r or out_x or in_x:
            self.ranked.remove(out_r)
            self.ranked.add(in_r)
            self.excluded.remove(out_x)
            self.excluded.add(in_x)
            self.merged_ranked = self.merged_excluded = None


def _diff(
    old: list[Any], new: list[Any], out: list[tuple[Any, ...]], into: list[tuple[Any, ...]]
) -> None:
    """Between a model's old and new entries (each a key whose part before last is the
    replica id): those to take out of a kept list into `out`, those to put in into
    `into`. An equal entry stays; neither list is changed."""
    olds = {k[-2]: k for k in old}
    for k in new:
        o = olds.pop(k[-2], None)
        if o is not None and o == k:
            continue
        into.append(k)
        if o is not None:
            out.append(o)
    out += olds.values()


def _alike(m: catalog.Model, cfg: Config, reclaim: bool, below_min: bool) -> tuple[object, ...]:
    """What weighing the replicas of other models reads of m, the flags and the settings:
    m's class and owner (the tier rules, and the words of an exclusion), the two flags
    and the two settings. Every model alike in these weighs another's replicas alike;
    only its own replicas are weighed otherwise (`same_model`)."""
    return (
        effective_class(m),
        m.owner,
        reclaim,
        below_min,
        cfg.eviction_grace_s,
        cfg.min_lifetime_s,
    )


def _kept(view: View, alike: tuple[object, ...]) -> _Kept:
    """What is kept on `view` for the models `alike`: new when nothing is, or when the
    quota tree is new since."""
    memo: dict[tuple[object, ...], _Kept] = view.memo.setdefault("preemption", {})
    kept = memo.pop(alike, None)
    if kept is None or kept.tree is not view.quota:
        kept = _Kept(view.quota)
        while len(memo) >= KEPT:
            del memo[next(iter(memo))]  # the least recently used
    memo[alike] = kept  # last in the dict: the most recently used
    return kept


# OWN bounds the blocks `_own` keeps on a view: one per model name asked about.
OWN = 4096


def _own(view: View) -> dict[str, _Block]:
    """Per model name, the block of its replicas weighed for the model the name resolves
    to: every one a same_model exclusion. Kept apart from the lists the models alike
    share (`_Kept`), where those replicas are weighed as any other's: a call leaves those
    out and puts these in. It reads neither the time nor the quota tree; a block is used
    only while it `holds`."""
    got: dict[str, _Block] | None = view.memo.get("own")
    if got is None or len(got) >= OWN:
        got = view.memo["own"] = {}
    return got


def _candidates(
    view: View,
    m: catalog.Model,
    now: datetime,
    cfg: Config,
    holdings: list[quota.Holding],
    reclaim: bool,
    below_min: bool,
) -> tuple[tuple[Candidate, ...], tuple[Exclusion, ...]]:
    """The replicas that may be stopped for m, in the order they should be, and every
    other replica holding capacity with why it may not.

    The order: idle on-demand ones first, then what other tenants borrowed past their
    guarantees when m's owner is within its own, then what lower classes grew into under
    load, then the same within m's class, then lower classes' minimums; within each, the
    longest unused first.

    Weighed model by model into blocks kept on the view for the next call about a model
    alike (`_Block`, `_Kept`, `_alike`: of one class and owner, under the same flags and
    settings, which weigh the replicas of the rest alike): on a full cluster dozens of
    models of a few kinds are reported again and again as the cluster changes, and
    between two calls most models' replicas have not changed at all. Only the blocks of
    models that changed are weighed again, and only their entries move in the two
    ordered lists. m's own replicas are kept there as any other's; the call leaves them
    out and puts them in as same_model exclusions (`_own`). A block that read the time
    (a replica used, so its idle time counts, or ready only lately, so its age may) or
    the quota usage of the moment (a replica under a guarantee, borrowed or not) is
    weighed again on every call, but for one that read only the time, asked about again
    at that same time (`_Block.holds_at`); when every block put in and taken out is the
    one of the last such call, so is the answer (`_Kept.merged_ranked`, `merged_excluded`).
    A call at the time of the last walk through every model, with nothing folded since
    (`_Kept.walked`), walks through m's own names only.
    """
    alike = _alike(m, cfg, reclaim, below_min)
    kept = _kept(view, alike)
    w = _Weighing(view, m, now, cfg, holdings, reclaim, below_min, kept.peers)
    blocks = kept.blocks
    resolve = view.catalog.resolve
    version_of, state_of = view.version, view.state_version
    timely: list[_Block] = []
    owns = _own(view)
    # m's own replicas (under its name or an alias) are kept as those of any other model,
    # for the next model alike; for this call they are taken out (`without`) and put in
    # again as same_model exclusions (`own`).
    own: list[_Block] = []
    without: list[_Block] = []
    walked = (view.changes, view.catalog.by_rank(), now)
    last = kept.walked
    if last is not None and last[0] == walked[0] and last[1] is walked[1] and last[2] == now:
        # Nothing changed since every block was checked, at this very time: each kept
        # block holds, and so does each that read the time (`walked`). Only m's own
        # names are looked at, as the walk below looks at them.
        current = view.current_models()
        mine_names = [n for n in view.catalog.names_of(m) if n in current]
        for model in mine_names:
            version = version_of(model)
            state = state_of(model)
            b = owns.get(model)
            if b is None or not b.holds(version, state, m, now):
                b = owns[model] = w.block(model, m, version, state, own=True)
            own.append(b)
            b = blocks.get(model)
            if b is not None:
                without.append(b)
        timely = [b for name, b in kept.timely.items() if name not in mine_names]
    else:
        fresh: dict[str, _Block] = {}
        # The blocks that read the time, for a next call at the same time: a pass
        # reports the models it cannot place one after another at one time.
        was_timely = kept.timely
        now_timely: dict[str, _Block] = {}
        for model in view.current_models():
            version = version_of(model)
            state = state_of(model)
            other = resolve(model)
            mine = other is m
            if mine:
                b = owns.get(model)
                if b is None or not b.holds(version, state, other, now):
                    b = owns[model] = w.block(model, other, version, state, own=True)
                own.append(b)
            b = blocks.get(model)
            if b is None or not b.holds(version, state, other, now):
                b = was_timely.get(model)
                if b is None or not b.holds_at(version, state, other, now):
                    b = w.block(model, other, version, state)
                if b.timely:
                    now_timely[model] = b
                    if not mine:
                        timely.append(b)
                    continue
            if mine:
                without.append(b)
            fresh[model] = b
        kept.timely = now_timely
        kept.update(fresh)
        kept.walked = walked
    # Both orders start (exclusions) or end (candidates) in the replica id, which is
    # unique: neither depends on the order the models were weighed in, and no
    # comparison reaches the objects behind the keys.
    # Each list's answer is kept apart (`_merged`): models alike whose own replicas are
    # none of the candidates (at their minimum, say) get the same candidates, the same
    # tuple.
    ranked = kept.merged_ranked = _merged(
        kept.merged_ranked, kept.ranked, timely, without, _ranked_of
    )
    excluded = kept.merged_excluded = _merged(
        kept.merged_excluded, kept.excluded, (*timely, *own), without, _excluded_of
    )
    return ranked[1], excluded[1]


# The blocks that put entries in among a kept list and those that took them out, each
# only if it has entries of that list, compared by identity (see `_merged`).
_MergedKey = tuple[tuple["_Block", ...], tuple["_Block", ...]]


def _merged(
    last: tuple[_MergedKey, tuple[_O, ...]] | None,
    ordered: _Ordered[_O],
    put_in: Iterable[_Block],
    taken_out: Iterable[_Block],
    entries: Callable[[_Block], list[Any]],
) -> tuple[_MergedKey, tuple[_O, ...]]:
    """`ordered`'s objects with the `entries` of the blocks `put_in` put in and those of
    `taken_out` taken out, with the blocks that have any: `last` when it was worked out
    from the very same blocks (the list is the same while `last` is kept: `_Kept.update`
    drops it when the list changes)."""
    key = (tuple([b for b in put_in if entries(b)]), tuple([b for b in taken_out if entries(b)]))
    if last is not None and last[0] == key:
        return last
    return key, ordered.with_(
        sorted([e for b in key[0] for e in entries(b)]),
        sorted([e for b in key[1] for e in entries(b)]),
    )


_ranked_of = operator.attrgetter("ranked")
_excluded_of = operator.attrgetter("excluded")


def _exclude_all(
    excluded: _Excluded, reps: list[ReplicaRecord], entry: tuple[str, str, str]
) -> None:
    """Exclude every one of `reps` with the same (model, why, detail)."""
    for r in reps:
        excluded[r.id] = entry


def _live(view: View, model: str, excluded: _Excluded) -> list[ReplicaRecord]:
    """The live replicas of one model (by the name its replicas give); every other
    replica of it holding capacity is excluded by the rules that read only its own state
    (retiring, already preempted, draining). Read from the view's index, so a model
    whose current replicas are all live costs a count, not a look at each.

    Draining is this project's reading of what the reference leaves to its replica
    states (`State.Counts`, a package we do not have): a draining replica is on its way
    out. It holds its GPUs until its agent reports it stopped (ev.HOLDING_STATES), so the
    trials count them as taken, but it is neither live nor a candidate: it is already
    stopping, so choosing it would stop nothing more, and the room it frees is already
    on its way to whoever waits for it.
    """
    reps = list(view.current_of(model))
    if view.live_count(model) == len(reps):
        # Every current replica of the model is live (a live one is always current):
        # none is excluded by its own state, and no replica needs to be looked at.
        return reps
    live = []
    for r in reps:
        # Every current replica holds capacity (`View.current`).
        if r.retiring_at is not None:
            excluded[r.id] = (model, "retiring", WHY["retiring"])
        elif r.preempted_for is not None:
            why = f"already stopped for {r.preempted_for}"
            excluded[r.id] = (model, "already_preempted", why)
        elif r.state == "draining" or r.drain_reason == "placement_timeout":
            # not r.live, for a replica holding capacity, neither retiring nor preempted
            excluded[r.id] = (model, "draining", WHY["draining"])
        else:
            live.append(r)
    return live


class _Peer:
    """What the rules read of another model, worked out once per model."""

    __slots__ = (
        "cls",
        "covered",
        "critical",
        "excluded",
        "idle_decides",
        "lower",
        "owner",
        "owner_guaranteed",
        "same_owner",
        "same_rank",
        "tiers",
        "whys",
    )

    def __init__(
        self, other: catalog.Model, m: catalog.Model, any_guarantee: bool, tree: quota.QuotaTree
    ) -> None:
        self.cls = cls = effective_class(other)
        rank, my_rank = catalog.class_rank(cls), catalog.class_rank(m.cls)
        self.lower = rank < my_rank
        self.same_rank = rank == my_rank
        self.critical = cls == "critical"
        self.owner = other.owner
        self.same_owner = other.owner == m.owner
        self.covered = any_guarantee and tree.has_guarantee(other.owner)
        self.owner_guaranteed = not self.same_owner and self.covered
        # Idle time decides tier 0 only for an on-demand lower class; for the others it
        # is looked up once the replica is known to be a candidate.
        self.idle_decides = self.lower and other.on_demand
        self.tiers: list[int] = []
        """The outcomes of the tier rules, by `_tiers`' index."""
        self.whys: dict[int, tuple[str, str]] = {}
        """Per untiered index, the exclusion (code, detail) it stands for."""
        self.excluded: tuple[str, str] | None = None
        """The exclusion every replica of the model gets, when the tier rules take none
        and give them all the same reason."""


def _class_tier(p: _Peer, idle_past_grace: bool, above_min: bool, below_min: bool) -> int | None:
    """The tier rules by class: an idle on-demand replica of a lower class (0), what a
    lower class grew into (2), the same class above its minimum for a model below its
    own (3), a lower class's minimum unless critical (4); None when none applies."""
    if p.idle_decides and idle_past_grace:
        return 0
    if p.lower and above_min:
        return 2
    if p.same_rank and above_min and below_min:
        return 3
    if p.lower and not p.critical:
        return 4
    return None


def _owner_tier(
    p: _Peer, tier: int | None, above_min: bool, borrowed: bool, reclaim: bool
) -> int | str | None:
    """The tier rules across owners, on top of `_class_tier`: what another owner borrowed
    past its guarantee is taken back (1) by an owner within its own, whatever the
    classes (but never a critical minimum); what is within another owner's guarantee is
    not taken at all ("guaranteed")."""
    if p.same_owner:
        return tier
    if borrowed and reclaim and (not p.critical or above_min):
        return tier if tier == 0 else 1
    if not borrowed and p.owner_guaranteed:
        return "guaranteed"
    return tier


# _GUARANTEED and _UNTIERED stand in `_tiers`' table for the two outcomes that are not a
# tier: within another owner's guarantee, and no tier rule applies.
_GUARANTEED = -1
_UNTIERED = -2


def _tiers(p: _Peer, below_min: bool, reclaim: bool) -> list[int]:
    """Every outcome of the tier rules for one model's replicas, by what they read of a
    replica: indexed by idle past the grace * 4 + above its minimum * 2 + borrowed.
    Worked out once per kind of model, so each replica costs a look-up."""
    out = []
    for idle in (False, True):
        for above in (False, True):
            for borrowed in (False, True):
                t = _owner_tier(p, _class_tier(p, idle, above, below_min), above, borrowed, reclaim)
                out.append(_GUARANTEED if t == "guaranteed" else _UNTIERED if t is None else int(t))
    return out


def _why_not(
    p: _Peer, m: catalog.Model, tier: int, above_min: bool, below_min: bool
) -> tuple[str, str]:
    """The exclusion rule for a replica no tier rule lets be taken (`tier` is
    _GUARANTEED or _UNTIERED): within another owner's guarantee, part of a critical
    minimum, or not of a lower class."""
    if tier == _GUARANTEED:
        return "guaranteed", f"within {p.owner}'s guarantee"
    if p.critical and not above_min:
        return "critical_minimum", WHY["critical_minimum"]
    return "not_lower_class", _not_lower(m, p.cls, above_min, below_min)


def _young(r: ReplicaRecord, now: datetime, lifetime: float) -> str:
    """The exclusion rule for a replica only now loaded: its detail when it has been
    ready for less than the minimum lifetime, else "". Stopping it throws away a model
    load that has only now been paid for."""
    if r.ready_at is None:
        return ""
    age = (now - r.ready_at).total_seconds()
    return f"ready for {age:g}s, less than {lifetime:g}s" if age < lifetime else ""


def _where(r: ReplicaRecord) -> tuple[str, int] | None:
    """The node a replica is on and the GPUs it holds there; None when it is spread over
    more than one node (the exclusion rule "multi_node"): stopping it is its own
    decision, not one taken to make room for a single replica (the reference leaves it
    to makeRoomFor), since it would lose a whole multi-node model for room on one."""
    shards = r.shards
    if len(shards) > 1:
        nodes = r.nodes
        if len(nodes) > 1:
            return None
        return nodes[0], sum(len(s.gpus) for s in shards)
    if shards:
        return shards[0].node, len(shards[0].gpus)
    return "", 0


# What stopping a replica of one profile and shape frees, as `_part` keeps it per
# profile: the GPUs and shards of the shape it was worked out for, then the freed GPUs,
# CPU cores and memory (size_of), and the part of the order key they give, one object
# for all equal sizes (`_Weighing.sizes`).
_Sized = tuple[int, int, int, float, float, tuple[int, float]]


class _Weighing:
    """One call of `_candidates`: what every model's replicas are weighed against, and
    the candidates and exclusions of the model being weighed (`block`)."""

    __slots__ = (
        "any_guarantee",
        "below_min",
        "borrowed",
        "cfg",
        "excluded",
        "m",
        "now",
        "peers",
        "ranked",
        "reads_use",
        "reclaim",
        "settled",
        "sizes",
        "timely",
        "usage",
        "view",
    )

    def __init__(
        self,
        view: View,
        m: catalog.Model,
        now: datetime,
        cfg: Config,
        holdings: list[quota.Holding],
        reclaim: bool,
        below_min: bool,
        peers: dict[tuple[str, str, bool], _Peer],
    ) -> None:
        self.view, self.m, self.now, self.cfg = view, m, now, cfg
        self.reclaim, self.below_min = reclaim, below_min
        # What `_peer` worked out, kept with the blocks (`_Kept.peers`).
        self.peers = peers
        # borrowed only matters across owners with a guarantee in play; with no
        # guarantee anywhere no replica is covered, and no owner can reclaim. `holdings`
        # has every replica under a guarantee; one of an owner under none is borrowed.
        self.any_guarantee = view.quota.any_guarantee()
        self.borrowed = view.quota.borrowed(holdings) if self.any_guarantee else set()
        self.excluded: _Excluded = {}
        # Each candidate behind its order key: tier, then the longest idle (unknown
        # counts as 0, a use after `now` below it), then the smaller, then the id. The
        # smaller first: the least served is lost if it is enough, and the pruning after
        # keeps a larger one only when it is needed. Without the size, equally idle
        # victims (idle times are all unknown after a restart) would be tried in
        # whatever order the replicas happened to be listed.
        self.ranked: list[_Ranked] = []
        # The size part of the order key, one object per size across all models: most
        # candidates are never reported used, so their keys are equal up to the size,
        # which the sort then compares at once, and only then the ids.
        self.sizes: dict[tuple[int, float], tuple[int, float]] = {}
        self.settled = before(now, cfg.min_lifetime_s + 1.0)
        self.timely = False
        """Whether the block being weighed read the time or the quota usage of now."""
        self.reads_use = False
        """Whether it read when any of its replicas was last used."""
        self.usage = False
        """Whether it read the quota usage of now (a replica under a guarantee)."""

    def block(
        self, name: str, other: catalog.Model | None, version: int, state: int, own: bool = False
    ) -> _Block:
        """Weigh the replicas of one model (by the name they give; `other` is what it
        resolves to, None when nothing does) into a block. `own`: m's own replicas,
        each excluded as same_model; without it, m's replicas are weighed as those of
        any other model, as every model alike with m weighs them."""
        self.ranked, self.excluded, self.timely, self.reads_use = [], {}, False, False
        self.usage = False
        if own:
            # The model's own replicas, under its name or an alias that names it (those
            # placed before a rename; `Catalog.names_of`): never a victim for a replica
            # of the same model.
            _exclude_all(self.excluded, list(self.view.current_of(name)), (name, *_SAME))
        else:
            reps = _live(self.view, name, self.excluded)
            if reps and other is None:
                _exclude_all(self.excluded, reps, (name, *_UNKNOWN))
            elif reps and other is not None:
                self.weigh(name, other, reps)
        self.ranked.sort()
        return _Block(
            version,
            state,
            other,
            self.now,
            self.timely,
            self.reads_use,
            self.usage,
            self.ranked,
            sorted(
                [
                    (rid, Exclusion(replica=rid, model=x[0], why=x[1], detail=x[2]))
                    for rid, x in self.excluded.items()
                ]
            ),
        )

    def weigh(self, name: str, other: catalog.Model, reps: list[ReplicaRecord]) -> None:
        """Weigh the live replicas of one model (its name, declaration and replicas):
        each becomes a candidate or an exclusion."""
        p = self._peer(other)
        if p.excluded is not None:
            _exclude_all(self.excluded, reps, (name, *p.excluded))
            return
        # What stopping one replica frees, per profile (see `_part`).
        shaped: dict[str, _Sized] = {}
        above = len(reps) - other.min
        if above <= 0 or above >= len(reps):
            self._part(name, p, reps, above > 0, shaped)
        else:
            # Ties in creation time by id, so the same log always marks the same
            # replicas as above the minimum.
            reps.sort(key=_newest, reverse=True)
            self._part(name, p, reps[:above], True, shaped)
            self._part(name, p, reps[above:], False, shaped)

    def _part(
        self,
        name: str,
        p: _Peer,
        reps: list[ReplicaRecord],
        above_min: bool,
        shaped: dict[str, _Sized],
    ) -> None:
        """Weigh replicas of one model on the same side of its minimum. `shaped` is the
        model's, per profile: what stopping one replica of the last shape seen frees."""
        tiers, whys, idle_decides, covered = p.tiers, p.whys, p.idle_decides, p.covered
        excluded = self.excluded
        # Neither idle time nor a guarantee tells one replica from another: one outcome
        # of the tier rules for all, looked up once.
        alike = not idle_decides and not covered
        if covered:
            self.timely = self.usage = True  # borrowed or not is the quota usage of now
        tier, is_borrowed = 0, self.any_guarantee
        if alike:
            at = above_min * 2 + is_borrowed
            tier = tiers[at]
            if tier < 0:
                _exclude_all(excluded, reps, (name, *whys[at]))
                return
        # Past the exclusion of them all above, each replica's last use is read: its
        # idle time orders a candidate, and may decide its tier.
        self.reads_use = True
        now, grace = self.now, self.cfg.eviction_grace_s
        borrowed = self.borrowed
        settled, lifetime = self.settled, self.cfg.min_lifetime_s
        view, append = self.view, self.ranked.append
        cls, owner = p.cls, p.owner
        for r in reps:
            # How long the replica has gone unused, as the reference's idleFor: `now`
            # minus its last use, unclamped; None when nobody has said, which is not
            # the same as idle (the rules count it as 0). A use stamped after `now`
            # (clock skew between hosts, `--now` in the past) is a negative idle time,
            # and the replica sorts after an equal one never reported used. Clamped to
            # 0 it would tie with that one and the id would choose the victim instead,
            # a choice the reference does not make. (`ReplicaRecord.idle_s` clamps: it
            # is what people are shown, not what the policy orders by.)
            used = r.last_used_at
            if used is None:
                idle = None
            else:
                idle = (now - used).total_seconds()
                self.timely = True
            rid = r.id
            if not alike:
                # Unknown idleness counts as 0 against the grace, as the reference's
                # `idleFor(rep, now) >= EvictionGrace`: under a grace of 0 a never-used
                # on-demand replica is tier 0 (0 >= 0).
                past_grace = idle_decides and (0.0 if idle is None else idle) >= grace
                if covered:
                    is_borrowed = rid in borrowed
                at = past_grace * 4 + above_min * 2 + is_borrowed
                tier = tiers[at]
                if tier < 0:
                    excluded[rid] = (name, *whys[at])
                    continue
            # Ready at or before `settled`, a replica is at least a second past the
            # minimum lifetime: only those ready later need the exact age.
            ready = r.ready_at
            if ready is not None and ready > settled:
                self.timely = True  # its age, or whether it is young, is of now
                young = _young(r, now, lifetime)
                if young:
                    excluded[rid] = (name, "young", young)
                    continue
            shards = r.shards
            n = len(shards)
            if n == 1:
                shard = shards[0]
                node, gpus = shard.node, len(shard.gpus)
            elif (where := _where(r)) is not None:
                node, gpus = where
            else:
                excluded[rid] = (name, "multi_node", f"spread over {', '.join(r.nodes)}")
                continue
            sized = shaped.get(r.profile)
            if sized is None or sized[0] != gpus or sized[1] != n:
                size = size_of(view, r)
                part = (size.gpus, size.memory_gb)
                sized = shaped[r.profile] = (
                    gpus,
                    n,
                    size.gpus,
                    size.cpu_cores,
                    size.memory_gb,
                    self.sizes.setdefault(part, part),
                )
            # In field order: replica, model, cls, owner, tier, above_min, idle_s, gpus,
            # cpu_cores, memory_gb, node, borrowed.
            cand = Candidate(
                rid,
                name,
                cls,
                owner,
                tier,
                above_min,
                idle,
                sized[2],
                sized[3],
                sized[4],
                node,
                is_borrowed,
            )
            append((tier, -idle if idle else _NEVER_IDLE, sized[5], rid, cand))

    def _peer(self, other: catalog.Model) -> _Peer:
        """What the rules read of `other`, with the outcomes of the tier rules for its
        replicas and the exclusion each untiered outcome stands for; the same for every
        model of one class, owner and on-demand flag."""
        key = (other.cls, other.owner, other.on_demand)
        p = self.peers.get(key)
        if p is None:
            p = self.peers[key] = _Peer(other, self.m, self.any_guarantee, self.view.quota)
            p.tiers = _tiers(p, self.below_min, self.reclaim)
            p.whys = {
                at: _why_not(p, self.m, tier, bool(at & 2), self.below_min)
                for at, tier in enumerate(p.tiers)
                if tier < 0
            }
            if len(p.whys) == len(p.tiers) and len(set(p.whys.values())) == 1:
                p.excluded = p.whys[0]
        return p


_newest = operator.attrgetter("created_at", "id")
_UNKNOWN = ("unknown_model", WHY["unknown_model"])
_SAME = ("same_model", WHY["same_model"])
# The idle part of the order key of a replica never reported used (or used at `now`):
# one object, which the sort compares at once.
_NEVER_IDLE = -0.0


def _not_lower(m: catalog.Model, cls: str, above_min: bool, below_min: bool) -> str:
    mine = effective_class(m)
    if catalog.class_rank(cls) > catalog.class_rank(mine):
        return f"{cls} ranks above {mine}"
    # The words name m's class, not m: what is weighed for one model is shared with every
    # model of its class and owner (`_kept`).
    if not above_min:
        return f"{cls} like the model to place, and part of its own model's minimum"
    if not below_min:
        return (
            f"{cls} like the model to place, above its minimum, but the model to place "
            "is not below its own"
        )
    return WHY["not_lower_class"]


def _choose(
    view: View,
    profiles: Sequence[catalog.Profile],
    avoid: tuple[str, ...],
    cands: Sequence[Candidate],
    max_victims: int,
) -> tuple[list[Candidate], tuple[TrialResult, ...]]:
    """The victims to stop (empty when no set of at most max_victims makes room), and
    every trial made on the way: the reference's search.

    Candidates are added in order until the model fits; then every one whose stopping
    turns out not to be needed is kept after all, looking from the last added back.
    Without that second step an idle replica on the wrong node, tried first, would be
    stopped along with the one that actually made the room.
    """
    tr = _Trials(view, profiles, avoid)
    chosen: list[Candidate] = []
    for c in cands:
        if len(chosen) == max_victims:
            break
        chosen.append(c)
        if not tr.fits_with_one_more(chosen):
            continue
        return tr.prune(chosen), tuple(tr.trials)
    return [], tuple(tr.trials)


def _choose_node_aware(
    view: View,
    profiles: Sequence[catalog.Profile],
    avoid: tuple[str, ...],
    cands: Sequence[Candidate],
    max_victims: int,
) -> tuple[list[Candidate], tuple[TrialResult, ...]]:
    """The node-aware search (`services.core.node_aware.search`) over the same candidates,
    with the same dry run and pruning as the reference's: each set it proposes is tried
    on a clone of the inventory, and only one that fits there is taken."""
    tr = _Trials(view, profiles, avoid)
    found = node_aware.search(
        view,
        profiles,
        cands,
        max_victims,
        lambda gone: tr.fits_without(gone, False),
        lambda: _choose(view, profiles, avoid, cands, max_victims)[0],
    )
    if not found:
        return [], tuple(tr.trials)
    chosen = list(found)
    if not tr.trials or tr.trials[-1].victims != tuple(v.replica for v in chosen):
        # The reference's set, taken for a profile of several shards: tried here too, so
        # the decision's trials end with the set it stops.
        tr.fits_without(chosen, False)
    return tr.prune(chosen), tuple(tr.trials)


# PLACED bounds the placements `placements` keeps for one state of a view's inventory.
PLACED = 4096

# A placement as the policy keeps it: by the profiles, the avoided nodes and the
# replicas released (none for where the model goes as the cluster stands).
_PlacedKey = tuple[tuple[catalog.Profile, ...], tuple[str, ...], tuple[str, ...]]


def placements(view: View) -> dict[_PlacedKey, placement.Placement | placement.NoFit]:
    """Where models go on the view's inventory as it stands, as worked out so far: per
    (profiles, avoided nodes, replicas released), what `placement.place` said.

    Kept on the view (`View.memo`) for as long as the inventory's `version` stays, and
    dropped at the first call after it moves: a pass reports the models it cannot place
    one after another, the policy answers each before the fold changes the inventory (a
    decision holds no capacity, and victims hold theirs until their agents report them
    stopped), and one shape of profiles is tried with the same first victims again and
    again. An answer depends on nothing else: the inventory the version names, the
    profiles (compared by value), the avoided nodes and the replicas released. A
    `NoFit`'s reasons may speak of the victims' nodes only (`placement.place`'s
    `within`); the policy reads only whether it fits."""
    version = view.inventory.version
    kept: tuple[int, dict[_PlacedKey, placement.Placement | placement.NoFit]] | None
    kept = view.memo.get("placements")
    if kept is None or kept[0] != version or len(kept[1]) >= PLACED:
        kept = view.memo["placements"] = (version, {})
    return kept[1]


class _Trials:
    """The dry run both searches share: sets of victims tried on a clone of the
    inventory, each trial recorded, and the pruning of victims whose stopping proved
    unneeded. A set tried before on the inventory as it stands is answered from
    `placements` without a clone."""

    __slots__ = ("answers", "avoid", "grown", "one_shard", "profiles", "shape", "trials", "view")

    def __init__(
        self, view: View, profiles: Sequence[catalog.Profile], avoid: tuple[str, ...]
    ) -> None:
        self.view, self.profiles, self.avoid = view, profiles, avoid
        self.shape = tuple(profiles)
        self.answers = placements(view)
        self.trials: list[TrialResult] = []
        # Both searches run only once the model fits nowhere as the cluster stands
        # (`plan`); with every profile of one shard, room can then only appear on the
        # nodes victims are stopped on (`placement.place`'s `within`).
        self.one_shard = all(p.shards == 1 for p in profiles)
        self.grown: tuple[list[Candidate], Inventory] | None = None
        """The set `fits_with_one_more` last tried on a clone, and the clone without it."""

    def fits_without(self, gone: Sequence[Candidate], pruning: bool) -> bool:
        ids = tuple([v.replica for v in gone])
        found = self.answers.get((self.shape, self.avoid, ids))
        if found is None:
            trial = self.view.inventory.clone()
            for v in gone:
                trial.release_replica(v.replica)
            found = self._place(trial, gone, ids)
        return self._record(ids, found, pruning)

    def fits_with_one_more(self, gone: list[Candidate]) -> bool:
        """`fits_without(gone)`, where `gone` is the set this was last asked about with
        one more victim: the reference adds candidates one at a time, and the clone
        without the last set tried on one is the one to release the new victim from."""
        ids = tuple([v.replica for v in gone])
        found = self.answers.get((self.shape, self.avoid, ids))
        if found is None:
            grown = self.grown
            if grown is None or grown[0] != gone[:-1]:
                trial = self.view.inventory.clone()
                for v in gone[:-1]:
                    trial.release_replica(v.replica)
            else:
                trial = grown[1]
            trial.release_replica(gone[-1].replica)
            self.grown = (list(gone), trial)
            found = self._place(trial, gone, ids)
        return self._record(ids, found, False)

    def _place(
        self, trial: Inventory, gone: Sequence[Candidate], ids: tuple[str, ...]
    ) -> placement.Placement | placement.NoFit:
        # place() tries without the avoided nodes first, then with them: a soft
        # preference never turns room that exists into a preemption.
        within = {v.node for v in gone} if self.one_shard else None
        found = placement.place(trial, self.profiles, self.avoid, within=within)
        self.answers[self.shape, self.avoid, ids] = found
        return found

    def _record(
        self, ids: tuple[str, ...], found: placement.Placement | placement.NoFit, pruning: bool
    ) -> bool:
        ok = isinstance(found, placement.Placement)
        self.trials.append(
            TrialResult(
                victims=ids,
                fits=ok,
                placement=found if isinstance(found, placement.Placement) else None,
                pruning=pruning,
            )
        )
        return ok

    def prune(self, chosen: list[Candidate]) -> list[Candidate]:
        """`chosen` (which fits) less every victim not needed, looking from the last back."""
        i = len(chosen) - 1
        while i >= 0 and len(chosen) > 1:
            fewer = chosen[:i] + chosen[i + 1 :]
            if self.fits_without(fewer, True):
                chosen = fewer
            i -= 1
        return chosen
