"""Who may be stopped for a model, why not, in which tier, and in what order.

The reference's `victims()` (reference/preempt.go), rule for rule, read beside it:
`candidates` walks every replica holding capacity once, `excluded_by_state` and
`excluded_by_rule` say why one may not go, `replica_tier` says which tier one that may
goes in (`eligible_tier` adds the young rule, `single_node` the multi-node one,
`replica_candidate` puts them together for one replica, `model_candidates` for one
model's), and `order_key` is the order they are tried in. Called by `engine.Plain`
(the spec's own walk) and, replica by replica, by the fast engine's index
(`fast.index.Index`); nothing here keeps anything
between calls. No I/O, no clock: `now` is a parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from services.core import catalog, quota
from services.core.policy.config import WHY, Config
from services.core.policy.decision import Candidate, Exclusion
from services.core.view import ReplicaRecord, View, size_of


def effective_class(m: catalog.Model) -> str:
    """The model's class as ranked: an unknown class counts as the default."""
    return m.cls if m.cls in catalog.CLASSES else catalog.DEFAULT_CLASS


@dataclass(frozen=True, slots=True, kw_only=True)
class Asker:
    """What the rules read of the model to place and of the moment: its class and owner,
    whether it is below its minimum (tier 3 needs it), whether its owner reclaims
    (tier 1 needs it), the settings, the time, and who borrowed past a guarantee."""

    m: catalog.Model
    now: datetime
    cfg: Config
    reclaim: bool
    below_min: bool
    any_guarantee: bool
    borrowed: frozenset[str]
    tree: quota.QuotaTree


def asker(
    view: View,
    m: catalog.Model,
    now: datetime,
    cfg: Config,
    borrowed: frozenset[str],
    reclaim: bool,
    below_min: bool,
) -> Asker:
    """The `Asker` for m; `borrowed` as `borrowed_of` gives it. Borrowed only matters
    across owners with a guarantee in play: with none anywhere, no replica is covered and
    no owner can reclaim."""
    tree = view.quota
    any_guarantee = tree.any_guarantee()
    return Asker(
        m=m,
        now=now,
        cfg=cfg,
        reclaim=reclaim,
        below_min=below_min,
        any_guarantee=any_guarantee,
        borrowed=borrowed if any_guarantee else frozenset(),
        tree=tree,
    )


def borrowed_of(tree: quota.QuotaTree, holdings: list[quota.Holding]) -> frozenset[str]:
    """The replicas of owners under a guarantee held past it (`QuotaTree.borrowed`): the
    only ones whose being borrowed the rules read (`replica_tier`); a replica of an owner
    under no guarantee is borrowed whatever it holds."""
    if not tree.any_guarantee():
        return frozenset()
    return frozenset(tree.borrowed([h for h in holdings if tree.has_guarantee(h.owner)]))


@dataclass(frozen=True, slots=True)
class Peer:
    """What the rules read of another model, as seen by the model to place."""

    cls: str
    owner: str
    lower: bool
    same_rank: bool
    critical: bool
    same_owner: bool
    covered: bool
    """Its owner has a guarantee somewhere up its tree (the reference's `guaranteed`)."""
    on_demand: bool


def peer_of(other: catalog.Model, a: Asker) -> Peer:
    return peer_by(effective_class(other), other.owner, other.on_demand, a)


def peer_by(cls: str, owner: str, on_demand: bool, a: Asker) -> Peer:
    """The `Peer` of a model of class `cls` (effective), `owner` and `on_demand`: all the
    rules read of another model."""
    rank, mine = catalog.class_rank(cls), catalog.class_rank(a.m.cls)
    return Peer(
        cls=cls,
        owner=owner,
        lower=rank < mine,
        same_rank=rank == mine,
        critical=cls == "critical",
        same_owner=owner == a.m.owner,
        covered=a.any_guarantee and a.tree.has_guarantee(owner),
        on_demand=on_demand,
    )


def excluded_by_state(r: ReplicaRecord, mine: Sequence[str]) -> tuple[str, str] | None:
    """Why a replica holding capacity is no candidate whatever the model's rules say:
    (code, detail), or None. The reference skips its own model's replicas, those
    retiring and those already stopped for another (`victims()`, its first loop).

    Draining is this project's reading of what the reference leaves to its replica
    states (`State.Counts`): a draining replica holds its GPUs until its agent reports
    it stopped, so the trials count them as taken, but choosing it would stop nothing
    more, and the room it frees is already on its way to whoever waits for it."""
    if r.model in mine:
        # Under its name or an alias that names it (placed before a rename).
        return "same_model", WHY["same_model"]
    if r.retiring_at is not None:
        return "retiring", WHY["retiring"]
    if r.preempted_for is not None:
        return "already_preempted", f"already stopped for {r.preempted_for}"
    if not r.live:
        return "draining", WHY["draining"]
    return None


def above_minimum(reps: Iterable[ReplicaRecord], least: int) -> list[tuple[ReplicaRecord, bool]]:
    """A model's live replicas, newest first, each with whether it is above the model's
    minimum: the newest are the ones above it. Ties in creation time go by id, so the
    same log always marks the same replicas."""
    newest = sorted(reps, key=lambda r: (r.created_at, r.id), reverse=True)
    above = max(len(newest) - least, 0)
    return [(r, i < above) for i, r in enumerate(newest)]


def idle_of(r: ReplicaRecord, now: datetime) -> float | None:
    """How long a replica has gone unused, as the reference's idleFor: None when nobody
    has said, which is not the same as idle (the rules count it as 0). Unclamped: a use
    stamped after `now` (clock skew, `--now` in the past) is negative, and orders after
    a replica never reported used rather than tying with it."""
    return None if r.last_used_at is None else (now - r.last_used_at).total_seconds()


def class_tier(p: Peer, idle_past_grace: bool, above_min: bool, below_min: bool) -> int | None:
    """The tier rules by class, the reference's switch: an idle on-demand replica of a
    lower class (0), what a lower class grew into under load (2), the same class above
    its minimum for a model below its own (3), a lower class's minimum unless critical
    (4); None when none applies. Room a model grew into is not a promise; its minimum is,
    and a critical model's minimum is never taken."""
    if p.lower and p.on_demand and idle_past_grace:
        return 0
    if p.lower and above_min:
        return 2
    if p.same_rank and above_min and below_min:
        return 3
    if p.lower and not p.critical:
        return 4
    return None


def replica_tier(p: Peer, r: ReplicaRecord, above_min: bool, a: Asker) -> int | str:
    """Which tier is this replica in? Its tier, or the code of the rule that keeps it
    (`tier_from_facts`), from how long it has gone unused and whether it is borrowed.
    Unknown idleness counts as 0 against the grace, as the reference's idleFor does."""
    idle = idle_of(r, a.now)
    past_grace = (0.0 if idle is None else idle) >= a.cfg.eviction_grace_s
    return tier_from_facts(p, past_grace, above_min, is_borrowed(p, r, a), a)


def is_borrowed(p: Peer, r: ReplicaRecord, a: Asker) -> bool:
    """Whether the replica is held past its owner's guarantee. A replica of an owner
    under no guarantee is borrowed whatever it holds (when any guarantee is in play)."""
    return (r.id in a.borrowed) if p.covered else a.any_guarantee


def tier_from_facts(
    p: Peer, past_grace: bool, above_min: bool, borrowed: bool, a: Asker
) -> int | str:
    """Which tier do these facts give (past the grace, above the minimum, borrowed)? The
    tier, or the code of the rule that keeps it: the class rules (`class_tier`), then
    across owners. What another owner borrowed past its guarantee is taken back (1)
    by an owner within its own, whatever the classes (but never a critical minimum);
    what is within another owner's guarantee is not taken at all: a guarantee that
    another tenant's higher class could take is not one."""
    tier = class_tier(p, past_grace, above_min, a.below_min)
    if not p.same_owner:
        if borrowed and a.reclaim and (not p.critical or above_min):
            tier = tier if tier == 0 else 1
        elif not borrowed and p.covered:
            return "guaranteed"
    if tier is None:
        return "critical_minimum" if p.critical and not above_min else "not_lower_class"
    return tier


def why_not(code: str, p: Peer, a: Asker, above_min: bool) -> str:
    """The sentence for a replica the tier rules keep (`replica_tier`'s code). The words name
    the model's class, not the model: they follow from the class rules alone."""
    if code == "guaranteed":
        return f"within {p.owner}'s guarantee"
    if code == "critical_minimum":
        return WHY["critical_minimum"]
    mine = effective_class(a.m)
    if catalog.class_rank(p.cls) > catalog.class_rank(mine):
        return f"{p.cls} ranks above {mine}"
    if not above_min:
        return f"{p.cls} like the model to place, and part of its own model's minimum"
    if not a.below_min:
        return (
            f"{p.cls} like the model to place, above its minimum, but the model to place "
            "is not below its own"
        )
    return WHY["not_lower_class"]


def young(r: ReplicaRecord, now: datetime, lifetime: float) -> str:
    """The exclusion rule for a replica only now loaded: its detail when it has been
    ready for less than the minimum lifetime, else "". Stopping it throws away a model
    load that has only now been paid for."""
    if r.ready_at is None:
        return ""
    age = (now - r.ready_at).total_seconds()
    return f"ready for {age:g}s, less than {lifetime:g}s" if age < lifetime else ""


def single_node(r: ReplicaRecord, nodes: tuple[str, ...] | None = None) -> str | None:
    """The multi-node rule: is the replica on a single node, and which? The node it is on
    (`nodes`: its `nodes`, when the caller has them); None when it is spread over more
    than one (the rule "multi_node"): stopping it is its own
    decision, which the reference leaves to makeRoomFor, since it would lose a whole
    multi-node model for room on one node."""
    if nodes is None:
        nodes = r.nodes
    if len(nodes) > 1:
        return None
    return nodes[0] if nodes else ""


def eligible_tier(p: Peer, r: ReplicaRecord, above_min: bool, a: Asker) -> int | str:
    """May this live replica of another model go, and in which tier? Its tier, or the
    code that keeps it: the tier rules, then young (in the reference's order). Where it
    is (`single_node`) is `replica_candidate`'s last check."""
    tier = replica_tier(p, r, above_min, a)
    if isinstance(tier, str):
        return tier
    if young(r, a.now, a.cfg.min_lifetime_s):
        return "young"
    return tier


def replica_candidate(
    view: View, p: Peer, r: ReplicaRecord, above_min: bool, a: Asker
) -> Candidate | str:
    """Is this live replica of another model a candidate? The candidate, or the code
    that keeps it."""
    tier = eligible_tier(p, r, above_min, a)
    if isinstance(tier, str):
        return tier
    node = single_node(r)
    if node is None:
        return "multi_node"
    return candidate(p, r, above_min, a, tier, node, size_of(view, r))


def candidate(
    p: Peer, r: ReplicaRecord, above_min: bool, a: Asker, tier: int, node: str, size: quota.Amount
) -> Candidate:
    """The candidate a replica is, once `eligible_tier` gave it a tier, on `node`,
    freeing `size` (`view.size_of`) when stopped."""
    return Candidate(
        r.id, r.model, p.cls, p.owner, tier, above_min, idle_of(r, a.now),
        size.gpus, size.cpu_cores, size.memory_gb, node, is_borrowed(p, r, a),
    )  # fmt: skip


def detail(code: str, r: ReplicaRecord, p: Peer | None, a: Asker, above_min: bool) -> str:
    """The sentence for an exclusion of `r` with `code`, with this replica's numbers."""
    if code == "young":
        return young(r, a.now, a.cfg.min_lifetime_s)
    if code == "multi_node":
        return f"spread over {', '.join(r.nodes)}"
    if p is not None and code in ("guaranteed", "critical_minimum", "not_lower_class"):
        return why_not(code, p, a, above_min)
    return WHY[code]


def order_key(c: Candidate) -> tuple[int, float, int, float, str]:
    """CandidatesOrdering, the reference's sort of victims, lowest first:
    0. the tier;
    1. the longest unused (never reported used counts as 0);
    2. the smaller, by GPUs then memory: the least served is lost if it is enough, and
       the pruning after keeps a larger one only when it is needed (without it equally
       idle victims, all unknown after a restart, go in whatever order they are listed);
    3. the id."""
    return (c.tier, -(c.idle_s or 0.0), c.gpus, c.memory_gb, c.replica)


def exclusion_key(x: Exclusion) -> str:
    """Exclusions are listed by replica id."""
    return x.replica


def candidates(view: View, a: Asker) -> tuple[tuple[Candidate, ...], tuple[Exclusion, ...]]:
    """The replicas that may be stopped for the model, in `order_key` order, and every
    other replica holding capacity with why it may not, by id: the reference's
    `victims()`. Per model, its live replicas newest first (the newest are the ones
    above its minimum), each weighed by the rules above."""
    mine = view.catalog.names_of(a.m)
    out: list[Candidate] = []
    excluded: list[Exclusion] = []
    live: dict[str, list[ReplicaRecord]] = {}
    for r in view.current():
        if not r.holds_capacity:
            continue
        code = excluded_by_state(r, mine)
        if code is not None:
            excluded.append(Exclusion(replica=r.id, model=r.model, why=code[0], detail=code[1]))
        else:
            live.setdefault(r.model, []).append(r)
    for name, reps in live.items():
        model_candidates(view, name, reps, a, out, excluded)
    return tuple(sorted(out, key=order_key)), tuple(sorted(excluded, key=exclusion_key))


def model_candidates(
    view: View,
    name: str,
    reps: list[ReplicaRecord],
    a: Asker,
    out: list[Candidate],
    excluded: list[Exclusion],
) -> None:
    """Which of one model's live replicas (by the name they give) are candidates? Each
    into `out` or `excluded`.
    A replica of a model no longer in the catalog is not weighed: what it may be taken
    for is unknown."""
    other = view.catalog.resolve(name)
    if other is None:
        for r in reps:
            excluded.append(
                Exclusion(
                    replica=r.id, model=name, why="unknown_model", detail=WHY["unknown_model"]
                )
            )
        return
    p = peer_of(other, a)
    for r, above in above_minimum(reps, other.min):
        got = replica_candidate(view, p, r, above, a)
        if isinstance(got, Candidate):
            out.append(got)
        else:
            why = detail(got, r, p, a, above)
            excluded.append(Exclusion(replica=r.id, model=name, why=got, detail=why))
