"""The fast engine's `Found`: who may be stopped for one decision, from the index's
groups (`IndexFound`): the counts worked out at once, the candidates and exclusions
merged lazily from the groups' orders, each group weighed once for the call
(`Weighed`). No I/O, no clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from services.core.policy import rules
from services.core.policy.config import WHY
from services.core.policy.decision import Candidate, Exclusion
from services.core.policy.fast.entries import Group, Rep
from services.core.policy.fast.walks import Kept
from services.core.view import ReplicaRecord, View


class Weighed:
    """One group as one call sees it: its tiers past the grace and not (or the code
    that keeps it), where the grace cuts its order, and the replicas set apart."""

    __slots__ = ("above", "code", "cut", "g", "never_past", "p", "skip", "tier_not", "tier_past")

    def __init__(self, g: Group, a: rules.Asker) -> None:
        self.g = g
        cls, owner, on_demand, above, borrowed = g.key
        self.above = above
        self.p = p = rules.peer_by(cls, owner, on_demand, a)
        past = rules.tier_from_facts(p, True, above, borrowed, a)
        not_past = rules.tier_from_facts(p, False, above, borrowed, a)
        self.code: str | None = None
        self.tier_past = self.tier_not = 0
        self.cut = 0
        self.never_past = False
        self.skip: dict[str, tuple[str, Rep]] = {}
        if isinstance(past, str) or isinstance(not_past, str):
            # Invariant: the grace only moves a lower class between tiers 0 and 2.
            assert past == not_past
            self.code = str(past)
            return
        self.tier_past, self.tier_not = past, not_past
        now, grace = a.now, a.cfg.eviction_grace_s
        self.never_past = grace <= 0.0
        # The used are in order of last use, the longest unused first: those past the
        # grace are a prefix.
        used = g.used
        lo, hi = 0, len(used)
        while lo < hi:
            mid = (lo + hi) // 2
            lu = used[mid].lu
            assert lu is not None
            if (now - lu).total_seconds() >= grace:
                lo = mid + 1
            else:
                hi = mid
        self.cut = lo

    def past(self, r: ReplicaRecord, a: rules.Asker) -> bool:
        idle = rules.idle_of(r, a.now)
        return (0.0 if idle is None else idle) >= a.cfg.eviction_grace_s


class IndexFound:
    """The index's `Found`: counts worked out at once, candidates and exclusions merged
    lazily from the groups."""

    __slots__ = (
        "_a",
        "_cands",
        "_gangs",
        "_head",
        "_index",
        "_mine",
        "_mine_ids",
        "_stream",
        "_view",
        "_weighed",
        "by_tier",
        "considered",
        "excluded_by",
        "excluded_count",
    )

    def __init__(self, index: Kept, view: View, a: rules.Asker) -> None:
        self._index, self._view, self._a = index, view, a
        self._gangs = a.cfg.policy != "reference"
        models = index._models
        mine_names = [n for n in view.catalog.names_of(a.m) if n in models]
        self._mine = [h.r for n in mine_names for h in models[n].held.values()]
        self._mine_ids = {r.id for r in self._mine}
        weighed = {id(g): Weighed(g, a) for g in index._groups.values() if g.ids}
        self._weighed = weighed
        tiers: dict[str, int] = {}
        why: dict[str, int] = {}
        # The model's own, whatever their state.
        _add(why, "same_model", len(self._mine))
        for _rid, x in index._by_state:
            if x.replica not in self._mine_ids:
                _add(why, x.why, 1)
        _add(why, "unknown_model", len(index._unknown))
        # Set apart in each group: its own model's, then the young, then (the
        # reference's) the multi-node.
        for n in mine_names:
            for rep in models[n].reps.values():
                assert rep.group is not None
                weighed[id(rep.group)].skip[rep.r.id] = ("same_model", rep)
        for w in weighed.values():
            if w.code is not None:
                _add(why, w.code, len(w.g.ids) - len(w.skip))
            else:
                self._count(w, tiers, why)
        self.by_tier = dict(sorted(tiers.items()))
        self.excluded_by = dict(sorted(why.items()))
        self.considered = sum(tiers.values())
        self.excluded_count = sum(why.values())
        self._cands: list[Candidate] = []
        self._stream: Iterator[Candidate] | None = None
        self._head = 0

    def _count(self, w: Weighed, tiers: dict[str, int], why: dict[str, int]) -> None:
        """Set apart a weighed group's young (and, for the reference, its multi-node),
        and count the rest by tier and those set apart by code."""
        a, g = self._a, w.g
        lifetime = a.cfg.min_lifetime_s
        for item in reversed(g.ready):
            ready_at, young = item[0], item[-1]
            assert isinstance(ready_at, datetime) and isinstance(young, Rep)
            if (a.now - ready_at).total_seconds() >= lifetime:
                break
            if young.r.id not in w.skip:
                w.skip[young.r.id] = ("young", young)
        if not self._gangs:
            for rid, spread in g.multi.items():
                if rid not in w.skip:
                    w.skip[rid] = ("multi_node", spread)
        n_past = w.cut + (len(g.never) if w.never_past else 0)
        n_not = len(g.ids) - n_past
        for code, rep in w.skip.values():
            if code != "same_model":
                _add(why, code, 1)
            if w.past(rep.r, a):
                n_past -= 1
            else:
                n_not -= 1
        _add(tiers, str(w.tier_past), n_past)
        _add(tiers, str(w.tier_not), n_not)

    @property
    def has_gangs(self) -> bool:
        if not self._gangs:
            return False
        return any(
            rid not in w.skip for w in self._weighed.values() if w.code is None for rid in w.g.multi
        )

    # Candidates.

    def _candidate(self, w: Weighed, rep: Rep, tier: int) -> Candidate:
        a, r, p, size = self._a, rep.r, w.p, rep.size
        if rep.node is None:
            nodes = tuple(r.nodes)
            return Candidate(
                r.id, r.model, p.cls, p.owner, tier, rep.above, rules.idle_of(r, a.now),
                size.gpus, size.cpu_cores, size.memory_gb, nodes[0], w.g.borrowed, nodes,
            )  # fmt: skip
        return Candidate(
            r.id, r.model, p.cls, p.owner, tier, rep.above, rules.idle_of(r, a.now),
            size.gpus, size.cpu_cores, size.memory_gb, rep.node, w.g.borrowed,
        )  # fmt: skip

    def _part(
        self, w: Weighed, tier: int, lo: int, hi: int, never: bool
    ) -> Iterator[tuple[tuple[int, float, int, float, str], Weighed, Rep, int]]:
        """One group's candidates of one tier, in order: its used from `lo` to `hi` (in
        order of last use), merged with those never reported used when `never`."""
        now, skip, used = self._a.now, w.skip, w.g.used

        def of_used() -> Iterator[tuple[tuple[int, float, int, float, str], Weighed, Rep, int]]:
            for i in range(lo, hi):
                rep = used[i]
                r = rep.r
                if r.id in skip:
                    continue
                assert r.last_used_at is not None
                idle = (now - r.last_used_at).total_seconds()
                yield (tier, -(idle or 0.0), rep.size.gpus, rep.size.memory_gb, r.id), w, rep, tier

        def of_never() -> Iterator[tuple[tuple[int, float, int, float, str], Weighed, Rep, int]]:
            for rep in w.g.never:
                if rep.r.id in skip:
                    continue
                yield (tier, -0.0, rep.size.gpus, rep.size.memory_gb, rep.r.id), w, rep, tier

        if not never or not w.g.never:
            return of_used()
        if lo >= hi:
            return of_never()
        return heapq.merge(of_used(), of_never(), key=by_key)

    def _ordered(self) -> Iterator[Candidate]:
        parts = []
        for w in self._weighed.values():
            if w.code is not None:
                continue
            n = len(w.g.used)
            if w.tier_past == w.tier_not:
                parts.append(self._part(w, w.tier_past, 0, n, True))
                continue
            parts.append(self._part(w, w.tier_past, 0, w.cut, w.never_past))
            parts.append(self._part(w, w.tier_not, w.cut, n, not w.never_past))
        for _key, w, rep, tier in heapq.merge(*parts, key=by_key):
            yield self._candidate(w, rep, tier)

    def first(self, n: int) -> tuple[Candidate, ...]:
        if self._stream is None:
            self._stream = self._ordered()
        while len(self._cands) < n:
            got = next(self._stream, None)
            if got is None:
                break
            self._cands.append(got)
        return tuple(self._cands[:n])

    def every(self) -> tuple[Candidate, ...]:
        return self.first(self.considered)

    def _on(self, name: str) -> list[tuple[Weighed, Rep, int]]:
        """The candidates on node `name` (a gang on its first), as (its group as weighed,
        the replica, its tier), in no set order."""
        a, weighed = self._a, self._weighed
        out = []
        for rep in self._index._nodes[name].values():
            w = weighed.get(id(rep.group))
            if w is None or w.code is not None or rep.r.id in w.skip:
                continue
            if w.tier_past == w.tier_not:
                out.append((w, rep, w.tier_past))
            else:
                out.append((w, rep, w.tier_past if w.past(rep.r, a) else w.tier_not))
        return out

    def candidates_of(self, on: list[tuple[Weighed, Rep, int]]) -> list[Candidate]:
        """`_on`'s candidates as `Candidate`s, in order."""
        mine = [self._candidate(w, rep, tier) for w, rep, tier in on]
        if len(mine) > 1:
            mine.sort(key=rules.order_key)
        return mine

    # Exclusions.

    def excluded_first(self, n: int) -> tuple[Exclusion, ...]:
        return tuple(x for _rid, x in itertools.islice(self._exclusions(), n))

    def _exclusions(self) -> Iterator[tuple[str, Exclusion]]:
        mine_ids, index = self._mine_ids, self._index
        name = WHY["same_model"]
        own = sorted(
            (r.id, Exclusion(replica=r.id, model=r.model, why="same_model", detail=name))
            for r in self._mine
        )
        unknown = WHY["unknown_model"]
        sources: list[Iterator[tuple[str, Exclusion]]] = [
            iter(own),
            (x for x in index._by_state if x[0] not in mine_ids),
            (
                (rid, Exclusion(replica=rid, model=r.model, why="unknown_model", detail=unknown))
                for rid, r in index._unknown
            ),
        ]
        for w in self._weighed.values():
            if w.code is not None:
                sources.append(self._excluded_group(w))
            else:
                set_apart = sorted(
                    (rid, code) for rid, (code, _) in w.skip.items() if code != "same_model"
                )
                if set_apart:
                    sources.append(self._set_apart(w, set_apart))
        return heapq.merge(*sources, key=by_key)

    def _excluded_group(self, w: Weighed) -> Iterator[tuple[str, Exclusion]]:
        code, skip, a = w.code, w.skip, self._a
        assert code is not None
        for rid, rep in w.g.ids:
            if rid in skip:
                continue
            why = rules.detail(code, rep.r, w.p, a, w.above)
            yield rid, Exclusion(replica=rid, model=rep.r.model, why=code, detail=why)

    def _set_apart(
        self, w: Weighed, items: list[tuple[str, str]]
    ) -> Iterator[tuple[str, Exclusion]]:
        a = self._a
        for rid, code in items:
            rep = w.skip[rid][1]
            why = rules.detail(code, rep.r, w.p, a, w.above)
            yield rid, Exclusion(replica=rid, model=rep.r.model, why=code, detail=why)


def by_key(item: tuple[Any, ...]) -> Any:
    return item[0]


def _add(d: dict[str, int], k: str, n: int) -> None:
    if n:
        d[k] = d.get(k, 0) + n
