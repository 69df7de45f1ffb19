"""How the policy's answers are worked out: one protocol, the spec's own engine behind it.

`plan` asks an engine (`Engine`) everything that may be worked out faster than the spec
writes it: what an owner's quota levels hold (`usage`), which replicas are held past a
guarantee (`borrowed`), who may be stopped for one decision and why not (`find`, a
`Found`), the dry run the decision's sets are tried on (`trials`), node-aware's best set
on one node (`node_set`) and its best set of whole gangs (`gang_set`). The rules, the
order, the searches' keys and the decision are the same whoever answers.

`PLAIN` answers with the spec itself, what a reader verifies against the reference:
every replica holding capacity walked with the rules (`rules.candidates`,
`View.holdings`), node-aware's `node_aware.search` and `gangs.search` over every
candidate, every set tried on a clone of the whole cluster (`trials.Trials`). The fast
engine (`fast.Fast`) answers the same from an index its owner keeps current as the view
folds, with lazy walks and trials on copies of only the nodes where room can appear;
`checked.Checked` runs an engine and the spec side by side and stops on the first
difference. Which one a caller runs is its config's `engine` (`config.ENGINES`), and a
decision records it. No engine is kept by core between calls: the caller owns it.

A `Found` is read, not listed whole: a decision lists its first candidates and
exclusions (`decision.LISTED`) and counts the rest, the reference's search reads the
first `max_victims` candidates; the spec's node-aware and gang searches read them all
(`every`), the fast engine's only those they reach.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from services.core import catalog, quota
from services.core.policy import gangs, rules
from services.core.policy.decision import Candidate, Exclusion, counts
from services.core.policy.plain_sets import Fits, PlainSets
from services.core.policy.trials import Trials
from services.core.view import View


class Found(Protocol):
    """Who may be stopped for one model at one time, and who may not: the candidates in
    `rules.order_key` order (under node-aware with its gangs among them), the exclusions
    by replica id."""

    @property
    def considered(self) -> int:
        """How many candidates there are."""
        ...

    @property
    def by_tier(self) -> dict[str, int]:
        """How many candidates of each tier, by tier (as a string)."""
        ...

    @property
    def excluded_count(self) -> int: ...

    @property
    def excluded_by(self) -> dict[str, int]:
        """How many exclusions of each code (`config.WHY`), by code."""
        ...

    @property
    def has_gangs(self) -> bool:
        """Whether a candidate is a gang (its shards on several nodes)."""
        ...

    def first(self, n: int) -> tuple[Candidate, ...]:
        """The first `n` candidates in order."""
        ...

    def excluded_first(self, n: int) -> tuple[Exclusion, ...]:
        """The first `n` exclusions by replica id."""
        ...

    def every(self) -> tuple[Candidate, ...]:
        """Every candidate, in order."""
        ...


F = TypeVar("F", bound=Found)
T = TypeVar("T", bound=Trials)


class Engine(Protocol[F, T]):
    """Answers the policy's questions about a view (see the module's docstring). `F` is
    the engine's own `Found` and `T` its own `Trials`: what its `find` and `trials` give
    its searches back."""

    @property
    def name(self) -> str:
        """One of `config.ENGINES`, as the decision records it."""
        ...

    def find(self, view: View, a: rules.Asker) -> F:
        """Who may be stopped for `a.m`, and why not the others."""
        ...

    def usage(self, view: View, owner: str) -> dict[str, quota.Amount]:
        """`QuotaTree.usage_of(owner, ...)` over what the replicas holding capacity hold."""
        ...

    def borrowed(self, view: View) -> frozenset[str]:
        """`rules.borrowed_of` over what the replicas holding capacity hold."""
        ...

    def follow(self, view: View) -> None:
        """Bring what the engine keeps up to date with `view` now, so that the next
        question does not pay for it (nothing, for the plain engine). Asking follows too."""
        ...

    def trials(self, view: View, profiles: Sequence[catalog.Profile], avoid: tuple[str, ...]) -> T:
        """The dry run one decision's sets are tried on, each recorded (`Trials`)."""
        ...

    def node_set(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        found: F,
        max_victims: int,
        fits: Fits,
        fallback: Callable[[], Sequence[Candidate]],
    ) -> Sequence[Candidate]:
        """Node-aware's set on one node (`node_aware.search`): the sets tried through
        `fits` in the spec's order, `fallback` the reference's search for a profile of
        several shards."""
        ...

    def gang_set(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        found: F,
        max_victims: int,
        fits: Fits,
        tr: T,
    ) -> Sequence[Candidate]:
        """Node-aware's set of whole gangs (`gangs.search`), the sets tried through
        `fits` in the spec's order; `tr` the decision's trials (the domains they read)."""
        ...


class Listing:
    """A `Found` from whole lists: the plain walk's."""

    __slots__ = ("by_tier", "cands", "excluded", "excluded_by")

    def __init__(self, cands: tuple[Candidate, ...], excluded: tuple[Exclusion, ...]) -> None:
        self.cands, self.excluded = cands, excluded
        self.by_tier = counts(str(c.tier) for c in cands)
        self.excluded_by = counts(x.why for x in excluded)

    @property
    def considered(self) -> int:
        return len(self.cands)

    @property
    def excluded_count(self) -> int:
        return len(self.excluded)

    @property
    def has_gangs(self) -> bool:
        return any(c.nodes for c in self.cands)

    def first(self, n: int) -> tuple[Candidate, ...]:
        return self.cands[:n]

    def excluded_first(self, n: int) -> tuple[Exclusion, ...]:
        return self.excluded[:n]

    def every(self) -> tuple[Candidate, ...]:
        return self.cands


class Plain(PlainSets):
    """The spec's own engine: every replica, every rule, every set on a clone of the
    whole cluster, on every call (node-aware's: `plain_sets.PlainSets`)."""

    __slots__ = ()
    name = "plain"

    def follow(self, view: View) -> None:
        return None

    def find(self, view: View, a: rules.Asker) -> Listing:
        cands, excluded = rules.candidates(view, a)
        if a.cfg.policy != "reference":
            # Node-aware weighs a multi-node replica whole (`gangs`); the reference skips it.
            spread = gangs.candidates(view, a, excluded)
            if spread:
                gone = {c.replica for c in spread}
                cands = tuple(sorted((*cands, *spread), key=rules.order_key))
                excluded = tuple(x for x in excluded if x.replica not in gone)
        return Listing(cands, excluded)

    def usage(self, view: View, owner: str) -> dict[str, quota.Amount]:
        return view.quota.usage_of(owner, view.holdings(counted_owners(view, owner)))

    def borrowed(self, view: View) -> frozenset[str]:
        tree = view.quota
        if not tree.any_guarantee():
            return frozenset()
        owners = {x.owner for x in view.catalog.models()}
        owners.add("default")  # a replica of a model not in the catalog
        owners = {o for o in owners if tree.has_guarantee(o)}
        return rules.borrowed_of(tree, view.holdings(owners))

    def trials(
        self, view: View, profiles: Sequence[catalog.Profile], avoid: tuple[str, ...]
    ) -> Trials:
        return Trials(view, profiles, avoid)


def counted_owners(view: View, owner: str) -> set[str]:
    """The owners whose replicas the quota math for `owner` reads: those sharing a level
    of its chain (its usage). Everyone else's holdings do not change it."""
    tree = view.quota
    mine = {q.name for q in tree.governing(owner)}
    everyone = {x.owner for x in view.catalog.models()}
    everyone.add("default")  # a replica of a model not in the catalog
    return {o for o in everyone if any(q.name in mine for q in tree.governing(o))}


PLAIN = Plain()
"""The plain engine: it keeps nothing, so one serves every caller."""
