"""The gang search read lazily: the same set as `gangs.search`, the one-victim levels
from only the candidates of their tier, best first, and the groups they are in.

The spec (`gangs.search`) reads every candidate, builds every group (each domain of a
required level, or each node a gang is on), then walks the levels (highest tier, size)
building every set of every group. A level of one victim needs less: its sets are the
candidates of its tier, each alone, that `_could` make room in a group whose pool holds
it; each set is one candidate, so it is the same set whichever group finds it, and the
level's order (`node_aware.key`, a total order: the last of it is the ids) is that of
the candidates' own keys. So here a level (t, 1) reads the candidates of tier t from the
engine's `Source` (`of_tier`), heaps them by their keys, and works out the groups of a
candidate (its nodes' domains, or its nodes; each group's candidates from `on`) only
when it comes off the heap: the first that could make room in one of its groups is
tried, and the first the dry run confirms is the set taken, as in the spec. A level of
two victims or more, reached only when no one victim of its tier made room, is the
spec's own (`gangs.first_of_level`) over the spec's groups, read then. A profile of
several shards with no topology weighs the whole cluster in one group, whose pool is
every candidate's: the spec runs.

The sets tried, their order and the one taken are the spec's. Held to it by a
differential test (tests/core/test_gang_levels.py) and, under the checked engine
(`checked.Checked`), on every call. No I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Protocol

from services.core import catalog
from services.core.policy import gangs, node_aware
from services.core.policy.decision import Candidate
from services.core.view import View

# Order: `rules.order_key` (tier, minus the time unused or 0, GPUs, memory, id).
Order = tuple[int, float, int, float, str]


class Source(Protocol):
    """Where the lazy gang search reads candidates (the fast engine's `Found`)."""

    def tiers(self) -> list[int]:
        """Every tier a candidate has, lowest first."""
        ...

    def of_tier(self, t: int) -> list[tuple[Order, str, object]]:
        """The candidates of tier t, in no set order, as (its `rules.order_key`, its
        model, what `candidate` makes it from)."""
        ...

    def candidate(self, made_from: object) -> Candidate:
        """The candidate of an entry of `of_tier`."""
        ...

    def on(self, names: Sequence[str]) -> list[Candidate]:
        """The candidates with a node among `names` (a gang's every node counts), in
        `rules.order_key` order."""
        ...

    def every(self) -> Sequence[Candidate]:
        """Every candidate, in order."""
        ...


def search(
    view: View,
    profiles: Sequence[catalog.Profile],
    source: Source,
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
    domains: Callable[[str], dict[str, list[str]]],
) -> Sequence[Candidate]:
    """`gangs.search`'s set, read from `source`. `domains(level)` is the names of each
    domain's nodes at `level` (`Trials.domains`, `placement.domains_of`)."""
    if any(p.shards > 1 and not p.topology_level for p in profiles):
        return gangs.search(view, profiles, source.every(), max_victims, fits)
    walk = _Walk(view, profiles, source, domains)
    for t in source.tiers():
        for k in range(1, max_victims + 1):
            got = walk.alone(t, fits) if k == 1 else walk.level(t, k, fits)
            if got:
                return got
    return ()


_GroupKey = tuple[str, str]


class _Walk:
    """What one search has read: the groups built (by level and domain, or "" and the
    node), the candidates' loading costs, and the spec's groups once a level needs them."""

    __slots__ = (
        "by_level",
        "domains",
        "freed_of",
        "groups",
        "levels",
        "load_s",
        "loose",
        "pools",
        "profiles",
        "source",
        "spec_groups",
        "view",
    )

    def __init__(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        source: Source,
        domains: Callable[[str], dict[str, list[str]]],
    ) -> None:
        self.view, self.source, self.domains = view, source, domains
        self.profiles = list(profiles)
        self.levels = sorted({p.topology_level for p in profiles if p.topology_level})
        self.by_level = {
            level: [p for p in profiles if p.topology_level == level] for level in self.levels
        }
        # loose: the profiles of one shard with no topology (one of several is the spec's).
        self.loose = [p for p in profiles if not p.topology_level]
        self.freed_of = gangs.freed(view)
        self.load_s: dict[str, float] = {}
        self.groups: dict[_GroupKey, gangs._Group | None] = {}
        self.pools: dict[_GroupKey, set[str]] = {}
        self.spec_groups: list[gangs._Group] | None = None

    def _costed(self, models: set[str]) -> dict[str, float]:
        new = models - self.load_s.keys()
        if new:
            # Models never seen ready cost 0 (`load_costs` leaves them out): noted as 0.
            got = node_aware.load_costs(self.view, new)
            for m in new:
                self.load_s[m] = got.get(m, 0.0)
        return self.load_s

    def alone(self, t: int, fits: Callable[[Sequence[Candidate]], bool]) -> tuple[Candidate, ...]:
        """Level (t, 1): the candidates of tier t in key order, each tried when it could
        make room in one of its groups, until one fits."""
        entries = self.source.of_tier(t)
        if not entries:
            return ()
        load_s = self._costed({model for _o, model, _x in entries})
        # `node_aware.key` of one candidate c is (t, 1, load * c.gpus, -(c.idle_s or 0),
        # c.gpus, c.memory_gb, (c.replica,)): within the level, (the work, then its
        # order key past the tier), compared the same (a sum or a min of one is itself).
        heap = [
            (load_s[model] * o[2], o[1], o[2], o[3], o[4], i)
            for i, (o, model, _x) in enumerate(entries)
        ]
        heapq.heapify(heap)
        make = self.source.candidate
        while heap:
            c = make(entries[heapq.heappop(heap)[5]][2])
            if self._could_alone(c) and fits((c,)):
                return (c,)
        return ()

    def _could_alone(self, c: Candidate) -> bool:
        """Whether `c` alone is a set of the spec's level (t, 1): in the pool of a group
        it is in, where stopping it `_could` make room."""
        for key in self._groups_of(c):
            g = self._group(key)
            if (
                g is not None
                and c.replica in self.pools[key]
                and gangs._could(g, (c,), self.freed_of)
            ):
                return True
        return False

    def _groups_of(self, c: Candidate) -> list[_GroupKey]:
        """The groups a candidate is in: for each level, the domain of each of its
        schedulable nodes; with loose profiles, each of those nodes."""
        inv = self.view.inventory
        out: list[_GroupKey] = []
        nodes = []
        for n in c.nodes or (c.node,):
            u = inv.usage(n)
            if u is not None and u.schedulable:
                nodes.append(u)
        for level in self.levels:
            for u in nodes:
                d = u.node.labels.get(level)
                if d is not None:
                    out.append((level, d))
        if self.loose:
            out.extend(("", u.node.name) for u in nodes)
        return out

    def _group(self, key: _GroupKey) -> gangs._Group | None:
        """The spec's group (`gangs._groups`'s `group`) of a domain or a node, built once;
        None where the spec has none."""
        if key in self.groups:
            return self.groups[key]
        level, name = key
        if level:
            names = sorted(self.domains(level).get(name, ()))
            ps = self.by_level[level]
        else:
            names, ps = [name], self.loose
        inv = self.view.inventory
        free = {n: len(u.free) for n in names if (u := inv.usage(n)) is not None and u.schedulable}
        mine = self.source.on(list(free)) if free else []
        g = None
        if mine and (any(c.nodes for c in mine) or any(p.shards > 1 for p in ps)):
            g = gangs._Group(free, ps, mine)
            self.pools[key] = {c.replica for c in g.cands}
        self.groups[key] = g
        return g

    def level(
        self, t: int, k: int, fits: Callable[[Sequence[Candidate]], bool]
    ) -> tuple[Candidate, ...]:
        """Level (t, k), k > 1: the spec's, over the spec's groups."""
        if self.spec_groups is None:
            cands = self.source.every()
            self.spec_groups = gangs._groups(self.view, self.profiles, cands)
            self._costed({c.model for c in cands})
        if not self.spec_groups:
            return ()
        return gangs.first_of_level(self.spec_groups, t, k, self.freed_of, self.load_s, fits)
