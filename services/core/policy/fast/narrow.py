"""Narrowed trials: the spec's dry run (`trials.Trials`) on a copy of only the nodes
where room can appear, instead of a clone of the whole cluster.

A trial runs only once the model fits nowhere as the cluster stands (`plan`), so:
- with every profile of one shard and no topology, room can only appear on the nodes
  the victims are stopped on: a trial copies those (`Inventory.part`) and places
  within them;
- with every profile required in one domain (and the others of one shard, with no
  topology), room can only appear in the domains, at those levels, that the victims
  are in, and a placement there reads those domains whole: a trial copies and places
  within them;
- otherwise it clones the whole inventory, as the spec does.

The same results, placements and all: tests/core/test_gangs.py (domains) and
tests/core/test_policy_index.py (random clusters, both policies) try the same sets both ways. What it
moves: a one-shard trial at 10,000 nodes costs a copy of a few nodes instead of ten
thousand, and a gang's at 10,000 nodes 8.7 ms instead of 15.5 ms
(tests/bench/bench_gangs.py). The fast engine's trials (`Fast.trials`); the plain engine
tries every set on a clone of the whole inventory.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.core import catalog, placement
from services.core.inventory import Inventory
from services.core.policy.decision import Candidate
from services.core.policy.trials import Trials
from services.core.view import View


class Narrow(Trials):
    """`Trials` whose copies hold only the nodes where room can appear."""

    __slots__ = ("_domains", "levels", "one_shard")

    def __init__(
        self, view: View, profiles: Sequence[catalog.Profile], avoid: tuple[str, ...]
    ) -> None:
        super().__init__(view, profiles, avoid)
        # A profile with a topology is placed by how it leaves its domains (the least
        # fragmented first), which reads the domain's other nodes too: one shard or
        # several, it is tried on its victims' domains whole, never on their nodes alone.
        self.one_shard = all(p.shards == 1 and p.topology_level is None for p in profiles)
        # levels: the topology levels whose domains a trial places within, for profiles
        # of several shards each required in one domain; None: the whole inventory.
        self.levels: tuple[str, ...] | None = None
        if not self.one_shard and all(_kept(p) for p in profiles):
            self.levels = tuple(sorted({p.topology_level or "" for p in profiles} - {""}))
        self._domains: dict[str, dict[str, list[str]]] = {}

    def beside(self) -> Narrow:
        """Trials of their own for the same decision (the reference's search that
        node-aware runs too), reading the domains these worked out."""
        other = Narrow(self.view, self.profiles, self.avoid)
        other._domains = self._domains
        return other

    def domains(self, level: str) -> dict[str, list[str]]:
        """The names of each domain's nodes at `level` (`placement.domains_of`), worked
        out once for the decision: its trials and the lazy gang search read them."""
        domains = self._domains.get(level)
        if domains is None:
            domains = self._domains[level] = {
                d: [u.node.name for u in us]
                for d, us in placement.domains_of(self.view.inventory.usages(), level).items()
            }
        return domains

    def copy(self, gone: Sequence[Candidate]) -> tuple[Inventory, set[str] | None]:
        on = {n for v in gone for n in (v.nodes or (v.node,))}
        if self.one_shard:
            within = on
        elif self.levels is not None:
            within = self._domains_of(on)
        else:
            return super().copy(gone)
        return self.view.inventory.part(within, [v.replica for v in gone]), within

    def _domains_of(self, nodes: set[str]) -> set[str]:
        """`nodes` and every node of a domain, at `levels`, that one of them is in."""
        inv = self.view.inventory
        out = set(nodes)
        for level in self.levels or ():
            domains = self.domains(level)
            for n in nodes:
                node = inv.node(n)
                d = None if node is None else node.labels.get(level)
                if d is not None:
                    out.update(domains.get(d, ()))
        return out


def _kept(p: catalog.Profile) -> bool:
    """Whether a profile's room can only appear where victims stop, given whole domains:
    one shard and no topology, or any shards required in one domain."""
    if p.topology_level is None:
        return p.shards == 1
    return p.topology_mode == "required"
