"""The fast engine's candidates as its lazy searches read them: per node for
node-aware's (`Slots`, a `node_levels.Source`), by tier and by node for the gang
search's (`GangSlots`, a `gang_levels.Source`). No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from services.core.policy.decision import Candidate
from services.core.policy.fast import gang_levels
from services.core.policy.fast.entries import Rep
from services.core.policy.fast.found import IndexFound, Weighed
from services.core.policy.fast.node_levels import Slot
from services.core.policy.fast.walks import GangNodes


class Slots:
    """The index's candidates per node for node-aware's lazy search: a node's tiers and
    GPUs from its replicas' groups, its `Candidate`s made only when a level reaches it."""

    __slots__ = ("_found", "_view")
    spec = None

    def __init__(self, found: IndexFound) -> None:
        self._found = found
        self._view = found._view

    def tiers(self) -> list[int]:
        return sorted(int(t) for t in self._found.by_tier)

    def loose(self) -> list[Slot]:
        nodes = self._found._index._nodes
        out = []
        for name in self._view.inventory.with_free():
            if name in nodes:
                got = self.slot(name)
                if got is not None:
                    out.append(got)
        return out

    def walk(self, least: int, k: int) -> Iterator[tuple[float, float, str]]:
        found = self._found
        now = found._a.now
        for work, never, last, name in found._index._walks.stream(
            found._index, self._view, least, k
        ):
            yield work, 0.0 if never else max((now - last).total_seconds(), 0.0), name

    def slot(self, name: str) -> Slot | None:
        found = self._found
        u = self._view.inventory.usage(name)
        reps = found._index._nodes.get(name)
        if u is None or not u.schedulable or reps is None:
            return None
        weighed = found._weighed
        now, grace = found._a.now, found._a.cfg.eviction_grace_s
        # `_on`, with each candidate's tier and GPUs listed as it is found.
        on: list[tuple[Weighed, Rep, int]] = []
        tiers, gpus = [], []
        for rep in reps.values():
            w = weighed.get(id(rep.group))
            if w is None or w.code is not None or rep.r.id in w.skip:
                continue
            tier = w.tier_past
            if tier != w.tier_not:
                lu = rep.r.last_used_at
                if (0.0 if lu is None else (now - lu).total_seconds()) < grace:
                    tier = w.tier_not
            on.append((w, rep, tier))
            tiers.append(tier)
            gpus.append(rep.size.gpus)
        return Slot(name, u, tiers, gpus, on) if on else None

    def candidates(self, slot: Slot) -> list[Candidate]:
        return self._found.candidates_of(slot.data)  # type: ignore[arg-type]


class GangSlots:
    """The index's candidates for the lazy gang search: those of one tier from the
    groups' orders cut at the grace, those on given nodes from the replicas per node and
    the gangs per node (read once a call needs them)."""

    __slots__ = ("_found", "_spread")
    spec = None

    def __init__(self, found: IndexFound) -> None:
        self._found = found
        self._spread: dict[str, list[tuple[Weighed, Rep]]] | None = None

    def tiers(self) -> list[int]:
        return sorted(int(t) for t in self._found.by_tier)

    def of_tier(self, t: int) -> list[tuple[gang_levels.Order, str, object]]:
        found = self._found
        parts = []
        for w in found._weighed.values():
            if w.code is not None:
                continue
            n = len(w.g.used)
            if w.tier_past == w.tier_not:
                if w.tier_past == t:
                    parts.append(found._part(w, t, 0, n, True))
                continue
            if w.tier_past == t:
                parts.append(found._part(w, t, 0, w.cut, w.never_past))
            if w.tier_not == t:
                parts.append(found._part(w, t, w.cut, n, not w.never_past))
        return [(key, rep.r.model, (w, rep, tier)) for part in parts for key, w, rep, tier in part]

    def candidate(self, made_from: object) -> Candidate:
        item: tuple[Weighed, Rep, int] = made_from  # type: ignore[assignment]
        return self._found._candidate(*item)

    def on(self, names: Sequence[str]) -> list[Candidate]:
        found = self._found
        spread = self._spread
        if spread is None:
            spread = self._spread = {}
        a, nodes = found._a, found._index._nodes
        on: dict[str, tuple[Weighed, Rep, int]] = {}
        for name in names:
            if name in nodes:
                for item in found._on(name):
                    on[item[1].r.id] = item
            gangs = spread.get(name)
            if gangs is None:
                gangs = spread[name] = self._gangs_on(name)
            for w, rep in gangs:
                if rep.r.id not in on:
                    tier = w.tier_past
                    if tier != w.tier_not and not w.past(rep.r, a):
                        tier = w.tier_not
                    on[rep.r.id] = (w, rep, tier)
        return found.candidates_of(list(on.values()))

    def _gangs_on(self, name: str) -> list[tuple[Weighed, Rep]]:
        """The candidates that are gangs with a shard on node `name`, with their groups
        as weighed (`_on` has a gang on its first node only)."""
        found = self._found
        weighed = found._weighed
        out = []
        for rep in GangNodes.of(found._index, found._view).get(name, ()):
            w = weighed.get(id(rep.group))
            if w is not None and w.code is None and rep.r.id not in w.skip:
                out.append((w, rep))
        return out

    def every(self) -> Sequence[Candidate]:
        return self._found.every()
