"""Node-aware's search read lazily: the same set as `node_aware.search`, from only the
nodes that could make room at each level, walked best first.

The spec (`node_aware.search`) works out what every candidate of every node that could
free the smallest need would free there (`NodeSets`), then walks the levels (highest tier,
size) building every set on every open node. What it finds depends on less: a level's
sets are those with a candidate of its tier, all of its tier or below, that free enough
on their node (`NodeSets.fits`), tried in `key` order until the dry run confirms one. Every
set of a level has the same highest tier and size, so the spec's order (by the work
thrown away, then `key` among equals) is `key`'s, a total order (the last of it is the
ids).

So here a level (t, k) reads its nodes from the engine's `Source` in the order of a
bound on the keys of their sets (`walk`): the work the k of its replicas that throw away
least would throw away, then how long the least idle of the k longest unused has gone
unused; only nodes whose k largest replicas hold the smallest need (or with free GPUs,
`loose`) are walked. A node walked is read as its candidates' tiers and GPUs (`Slot`),
joins the levels at which its largest candidates of tier t or below could free the need,
and is worked out (`NodeSets`, the spec's) only when a level reaches it. Its sets that fit
go on a heap by `key`; the least is tried as soon as no node not yet walked could hold a
set before it. The sets tried, their order and the one taken are the spec's. Held to
the spec by a differential test (tests/core/test_policy_index.py) and, under the checked
engine (`checked.Checked`), on every call. No I/O, no clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from services.core import catalog
from services.core.inventory import NodeUsage
from services.core.policy import node_aware
from services.core.policy.decision import Candidate
from services.core.view import View


class Slot:
    """One node as the lazy search first reads it: its usage, and per candidate (in no
    set order) its tier and GPUs; `data` is the source's, to build the candidates."""

    __slots__ = ("data", "gpus", "name", "tiers", "usage")

    def __init__(
        self, name: str, usage: NodeUsage, tiers: list[int], gpus: list[int], data: object
    ) -> None:
        self.name, self.usage, self.tiers, self.gpus, self.data = name, usage, tiers, gpus, data


class Source(Protocol):
    """Where the lazy search reads candidates per node (the fast engine's `Found`)."""

    def tiers(self) -> list[int]:
        """Every tier a candidate has, lowest first."""
        ...

    def loose(self) -> list[Slot]:
        """The schedulable nodes with candidates and a free GPU (on a full cluster few),
        read at once."""
        ...

    def walk(self, least: int, k: int) -> Iterator[tuple[float, float, str]]:
        """The nodes with k replicas or more whose k largest hold `least` GPUs or more,
        as (the least work any k of its replicas throw away, as `key` sums it; the
        longest the least idle of any k of them has gone unused, `idle_s or 0`, at least
        0; the node), in order of those two (the first lowest, the second highest)."""
        ...

    def slot(self, name: str) -> Slot | None:
        """The node with its candidates; None when it is not schedulable or has none."""
        ...

    def candidates(self, slot: Slot) -> list[Candidate]:
        """The slot's candidates in `rules.order_key` order."""
        ...


def search(
    view: View,
    profiles: Sequence[catalog.Profile],
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
    fallback: Callable[[], Sequence[Candidate]],
    source: Source,
) -> Sequence[Candidate]:
    """`node_aware.search`'s set, the nodes read from `source` level by level, else the
    fallback's."""
    needs = [node_aware.Need(p) for p in profiles if p.shards == 1 and p.gpus >= 0]
    best: Sequence[Candidate] = ()
    if needs:
        least = min(n.gpus for n in needs)
        best = _by_levels(view, needs, source, least, max_victims, fits)
    return node_aware.or_fallback(view, profiles, best, fallback)


def _levels(slot: Slot, least: int, max_victims: int) -> set[tuple[int, int]]:
    """The levels (t, k) where k of the slot's candidates of tier t or below, one of
    them of tier t, could free enough: the node's free GPUs and its k largest such
    candidates' GPUs reach `least` (what `NodeSets.fits` needs at least)."""
    out: set[tuple[int, int]] = set()
    free = len(slot.usage.free)
    pairs = sorted(zip(slot.tiers, slot.gpus, strict=True))
    allowed: list[int] = []
    i, n = 0, len(pairs)
    while i < n:
        t = pairs[i][0]
        while i < n and pairs[i][0] == t:
            allowed.append(pairs[i][1])
            i += 1
        top = sorted(allowed, reverse=True) if len(allowed) > 1 else allowed
        most = min(len(top), max_victims)
        room = free
        for k in range(most):
            room += top[k]
            if room >= least:
                out.update((t, j) for j in range(k + 1, most + 1))
                break
    return out


# MARGIN: a node's bound on the work thrown away, less this share, is below the work of
# every set on it however the floats of a sum round.
MARGIN = 1e-9


def _before(k: node_aware.Key, work: float, idle: float, exact: bool) -> bool:
    """Whether a set of key `k` comes before every set of a node whose bound is (`work`,
    `idle`), and so before every set of the nodes walked after it. `exact`: the bound's
    work is summed as `key` sums a set's (one victim: 0 + its work, the same float), so
    a tie in work is a tie, and the idle bound decides it; otherwise a tie is only
    trusted at 0."""
    if k[2] < work * (1 - MARGIN):
        return True
    if exact:
        return k[2] < work or (k[2] == work and -k[3] > idle)
    return k[2] == 0.0 and work == 0.0 and -k[3] > idle


class _Walked:
    """What one search has read of the nodes: each slot once, its levels, its `NodeSets`."""

    __slots__ = ("built", "least", "levels", "max_victims", "needs", "slots", "source")

    def __init__(
        self, source: Source, needs: list[node_aware.Need], least: int, max_victims: int
    ) -> None:
        self.source, self.needs, self.least, self.max_victims = source, needs, least, max_victims
        self.slots: dict[str, Slot | None] = {}
        self.levels: dict[str, set[tuple[int, int]]] = {}
        self.built: dict[str, node_aware.NodeSets] = {}

    def read(self, slot: Slot) -> None:
        self.slots[slot.name] = slot
        self.levels[slot.name] = _levels(slot, self.least, self.max_victims)

    def sets(self, name: str, t: int, k: int) -> list[tuple[Candidate, ...]]:
        """The node's sets of level (t, k) that fit on it (`NodeSets.fits`)."""
        if name not in self.slots:
            got = self.source.slot(name)
            if got is None:
                self.slots[name] = None
            else:
                self.read(got)
        slot = self.slots[name]
        if slot is None or (t, k) not in self.levels[name]:
            return []
        needs = self.needs
        node = self.built.get(name)
        if node is None:
            node = self.built[name] = node_aware.NodeSets(
                slot.usage, self.source.candidates(slot), needs
            )
        cands = node.cands
        allowed = [i for i, c in enumerate(cands) if c.tier <= t]
        if len(allowed) < k or not node.could(needs, allowed, k):
            return []
        out = []
        for chosen in itertools.combinations(allowed, k):
            if any(cands[i].tier == t for i in chosen) and node.fits(needs, chosen):
                out.append(tuple([cands[i] for i in chosen]))
        return out  # type: ignore[return-value]


def _by_levels(
    view: View,
    needs: list[node_aware.Need],
    source: Source,
    least: int,
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
) -> Sequence[Candidate]:
    """The first set `fits` confirms, level by level, each level's sets that fit on
    their node in `key` order: a set is tried once no node left to walk could hold one
    before it (`_before`)."""
    walked = _Walked(source, needs, least, max_victims)
    loose = source.loose()
    for slot in loose:
        walked.read(slot)
    load_s: dict[str, float] = {}
    costed: set[str] = set()

    def keyed(vs: tuple[Candidate, ...]) -> node_aware.Key:
        new = {v.model for v in vs} - costed
        if new:
            costed.update(new)
            load_s.update(node_aware.load_costs(view, new))
        return node_aware.key(vs, load_s)

    for t in source.tiers():
        for k in range(1, max_victims + 1):
            got = _level(walked, loose, least, t, k, keyed, fits)
            if got:
                return got
    return ()


def _level(
    walked: _Walked,
    loose: list[Slot],
    least: int,
    t: int,
    k: int,
    keyed: Callable[[tuple[Candidate, ...]], node_aware.Key],
    fits: Callable[[Sequence[Candidate]], bool],
) -> tuple[Candidate, ...]:
    """The first of level (t, k)'s sets, in `key` order, that `fits` confirms; () when
    none does. The nodes with a free GPU first, then the others best first."""
    heap: list[tuple[node_aware.Key, tuple[Candidate, ...]]] = []
    seen: set[str] = set()

    def add(name: str) -> None:
        if name not in seen:
            seen.add(name)
            for vs in walked.sets(name, t, k):
                heapq.heappush(heap, (keyed(vs), vs))

    for slot in loose:
        add(slot.name)
    nodes = walked.source.walk(least, k)
    at = next(nodes, None)
    while True:
        # One victim a set: a node's many equally costly replicas (one model's) are
        # told apart by how long they have gone unused, without reading them all.
        while heap and (at is None or _before(heap[0][0], at[0], at[1], k == 1)):
            vs = heapq.heappop(heap)[1]
            if fits(vs):
                return vs
        if at is None:
            return ()
        add(at[2])
        at = next(nodes, None)
