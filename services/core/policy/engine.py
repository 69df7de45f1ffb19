"""Where candidates are found: one protocol, the spec's plain walk behind it.

`plan` asks an engine three things: what an owner's quota levels hold (`usage`), which
replicas are held past a guarantee (`borrowed`), and, for one decision, who may be
stopped and why not (`find`, a `Found`). `PlainWalk` answers each by walking every
replica holding capacity with the rules (`rules.candidates`, `View.holdings`) and is
what a reader verifies against the reference; a faster engine (`index.Index`) answers
the same questions from what its owner kept current as the view folded, and is held to
the plain walk by a differential test. No engine is kept by core between calls: the
caller owns it.

A `Found` is read, not listed whole: a decision lists its first candidates and
exclusions (`decision.LISTED`) and counts the rest, the reference's search reads the
first `max_victims` candidates, node-aware the candidates on the nodes that could make
room (`by_node`). Only the spec's gang search, which weighs every candidate together (a
profile of several shards, a gang), reads them all (`every`); the index's engine hands
the lazy one (`gang_levels`) the candidates of one tier and those on given nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from services.core import quota
from services.core.policy import gangs, node_aware, rules
from services.core.policy.decision import Candidate, Exclusion, counts
from services.core.view import View

if TYPE_CHECKING:
    from services.core.policy import gang_levels
    from services.core.policy.node_levels import Source


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

    def by_node(
        self, view: View, least: int, max_victims: int
    ) -> list[tuple[str, list[Candidate]]]:
        """Per node (by name) its candidates in order (a gang on its first node), for at
        least every node with candidates where at most `max_victims` of them could leave
        `least` GPUs free (`node_aware.could_free`); other nodes may be left out."""
        ...

    def lazily(self, view: View) -> Source | None:
        """The candidates per node for node-aware's lazy search (`node_levels`), read as
        it needs them; None: the spec's search, over `by_node`, runs instead."""
        ...

    def gangs_lazily(self, view: View) -> gang_levels.Source | None:
        """The candidates by tier and by node for the lazy gang search (`gang_levels`),
        read as it needs them; None: the spec's search, over `every`, runs instead."""
        ...


class Candidates(Protocol):
    """Answers the policy's questions about a view (see the module's docstring)."""

    def find(self, view: View, a: rules.Asker) -> Found:
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
        question does not pay for it (nothing, for the plain walk). Asking follows too."""
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

    def by_node(
        self, view: View, least: int, max_victims: int
    ) -> list[tuple[str, list[Candidate]]]:
        return node_aware.grouped(self.cands)

    def lazily(self, view: View) -> Source | None:
        return None

    def gangs_lazily(self, view: View) -> gang_levels.Source | None:
        return None


class PlainWalk:
    """The spec's own engine: every replica, every rule, on every call."""

    __slots__ = ()

    def follow(self, view: View) -> None:
        return None

    def find(self, view: View, a: rules.Asker) -> Found:
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


def counted_owners(view: View, owner: str) -> set[str]:
    """The owners whose replicas the quota math for `owner` reads: those sharing a level
    of its chain (its usage). Everyone else's holdings do not change it."""
    tree = view.quota
    mine = {q.name for q in tree.governing(owner)}
    everyone = {x.owner for x in view.catalog.models()}
    everyone.add("default")  # a replica of a model not in the catalog
    return {o for o in everyone if any(q.name in mine for q in tree.governing(o))}


PLAIN = PlainWalk()
