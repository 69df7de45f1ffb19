"""The dry run: a set of victims tried on a clone of the inventory, before anything stops.

The reference's `fitsWithout` (reference/preempt.go): stopping replicas that do not make
room is the one outcome worse than not preempting, so a set is stopped only once a clone
without it places the model. Used by both searches (`search`, `node_aware`); each trial
is recorded for the decision. Nothing is kept past one decision. No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.core import catalog, placement
from services.core.policy.decision import Candidate, TrialResult
from services.core.view import View


class Trials:
    """The sets tried for one decision, in the order tried, on the view's inventory."""

    __slots__ = ("_domains", "avoid", "levels", "one_shard", "profiles", "trials", "view")

    def __init__(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        avoid: tuple[str, ...],
        narrow: bool = True,
        beside: Trials | None = None,
    ) -> None:
        self.view, self.profiles, self.avoid = view, profiles, avoid
        self.trials: list[TrialResult] = []
        # Trials run only once the model fits nowhere as the cluster stands (`plan`);
        # with every profile of one shard, room can then only appear on the nodes
        # victims are stopped on (`placement.place`'s `within`).
        self.one_shard = all(p.shards == 1 for p in profiles)
        # levels: with every profile of several shards required in one domain (and the
        # others of one shard, placed anywhere), room can only appear in the domains of
        # those levels the victims are in, whole: a trial places within them (`narrow`;
        # off, on a clone of the whole inventory). None: on the whole inventory.
        self.levels: tuple[str, ...] | None = None
        if narrow and not self.one_shard and all(_kept(p) for p in profiles):
            self.levels = tuple(sorted({p.topology_level or "" for p in profiles} - {""}))
        # _domains: per level, `domains`; shared with `beside`, trials of the same view.
        self._domains: dict[str, dict[str, list[str]]] = {} if beside is None else beside._domains

    def fits_without(self, gone: Sequence[Candidate], pruning: bool = False) -> bool:
        """Whether the model could be placed with `gone` stopped, tried on a clone. The
        placement tries without the avoided nodes first, then with them: a soft
        preference never turns room that exists into a preemption."""
        on = {n for v in gone for n in (v.nodes or (v.node,))}
        within: set[str] | None = on
        if not self.one_shard:
            within = self._domains_of(on) if self.levels is not None else None
        inv = self.view.inventory
        # A placement within the victims' nodes reads no other node: the copy holds only
        # those (`Inventory.part`), not the whole cluster.
        trial = inv.clone() if within is None else inv.part(within, [v.replica for v in gone])
        for v in gone:
            trial.release_replica(v.replica)
        found = placement.place(trial, self.profiles, self.avoid, within=within)
        fits = isinstance(found, placement.Placement)
        self.trials.append(
            TrialResult(
                victims=tuple([v.replica for v in gone]),
                fits=fits,
                placement=found if isinstance(found, placement.Placement) else None,
                pruning=pruning,
            )
        )
        return fits

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

    def domains(self, level: str) -> dict[str, list[str]]:
        """The names of each domain's nodes at `level` (`placement.domains_of`), worked
        out once for the decision: its trials and the gang search read them."""
        domains = self._domains.get(level)
        if domains is None:
            domains = self._domains[level] = {
                d: [u.node.name for u in us]
                for d, us in placement.domains_of(self.view.inventory.usages(), level).items()
            }
        return domains


def _kept(p: catalog.Profile) -> bool:
    """Whether a profile's room can only appear where victims stop, given whole domains:
    one shard and no topology, or several required in one domain."""
    if p.shards == 1:
        return p.topology_level is None
    return p.topology_level is not None and p.topology_mode == "required"


def prune(tr: Trials, chosen: list[Candidate]) -> list[Candidate]:
    """`chosen` (which fits) less every victim whose stopping turns out not to be needed,
    looking from the last added back. Without it an idle replica on the wrong node,
    tried first, would be stopped along with the one that actually made the room."""
    i = len(chosen) - 1
    while i >= 0 and len(chosen) > 1:
        fewer = chosen[:i] + chosen[i + 1 :]
        if tr.fits_without(fewer, True):
            chosen = fewer
        i -= 1
    return chosen
