"""Node-aware's search read lazily: the same set as `node_aware.search`, from only the
nodes that could make room at each level.

The spec (`node_aware.search`) works out what every candidate of every node that could
free the smallest need would free there (`_Node`), then walks the levels (highest tier,
size) building every set on every open node. What it finds depends on less: a level's
sets are those with a candidate of its tier, all of its tier or below, that free enough
on their node (`_Node.fits`), tried in `key` order until the dry run confirms one. So
here each node is first read as its candidates' tiers and GPUs only (`Slot`, from the
engine's `Source`), and a node joins the levels (t, k) at which even its k largest
candidates of tier t or below could not free less than the smallest need: a bound that
`_Node.fits` implies (a candidate frees at most its own GPUs on a node, a node has at
most its free GPUs qualifying). Only the nodes of a level reached are worked out
(`_Node`, the spec's), only their sets that fit, and those in `key` order: every set of
a level has the same highest tier and size, so the spec's order (by the work thrown
away, then `key` among equals) is `key`'s, a total order (the last of it is the ids).

So the sets tried, their order and the one taken are the spec's: a level here holds the
spec's sets of that level that fit on their node, and the levels with none are the
spec's empty ones. Held to the spec by a differential test (tests/core/test_policy_index.py)
and, with `LLMGW_POLICY_CHECK=1`, on every call (`Source.spec`). No I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from services.core import catalog
from services.core.inventory import NodeUsage
from services.core.policy import node_aware
from services.core.policy.decision import Candidate
from services.core.policy.engine import PolicyMismatch
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
    """Where the lazy search reads candidates per node (an engine's `Found.lazily`)."""

    @property
    def spec(self) -> Callable[[int, int], list[tuple[str, list[Candidate]]]] | None:
        """When set, the candidates per node the spec's search reads (`Found.by_node`,
        given `least` and `max_victims`): the spec is run beside and the two compared
        (the check)."""
        ...

    def slots(self, least: int, max_victims: int) -> list[Slot]:
        """At least every schedulable node with candidates where at most `max_victims`
        of them could leave `least` GPUs free (`node_aware.could_free`)."""
        ...

    def candidates(self, slot: Slot) -> list[Candidate]:
        """The slot's candidates in `rules.order_key` order."""
        ...


def search(
    view: View,
    profiles: Sequence[catalog.Profile],
    cands: Sequence[Candidate],
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
    fallback: Callable[[], Sequence[Candidate]],
    source: Source,
) -> Sequence[Candidate]:
    """`node_aware.search`'s set, the nodes read from `source` level by level."""
    spec = source.spec
    if spec is not None:
        return _checked(view, profiles, cands, max_victims, fits, fallback, source, spec)
    needs = [node_aware._Need(p) for p in profiles if p.shards == 1 and p.gpus >= 0]
    best: Sequence[Candidate] = ()
    if needs:
        least = min(n.gpus for n in needs)
        best = _by_levels(view, needs, source, least, max_victims, fits)
    return node_aware.or_fallback(view, profiles, best, fallback)


def _levels(slots: list[Slot], least: int, max_victims: int) -> dict[tuple[int, int], list[int]]:
    """Per level (t, k), the slots (by position) where k of the candidates of tier t or
    below, one of them of tier t, could free enough: the node's free GPUs and its k
    largest such candidates' GPUs reach `least`."""
    out: dict[tuple[int, int], list[int]] = {}
    for at, slot in enumerate(slots):
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
                    for j in range(k + 1, most + 1):
                        out.setdefault((t, j), []).append(at)
                    break
    return out


def _by_levels(
    view: View,
    needs: list[node_aware._Need],
    source: Source,
    least: int,
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
) -> Sequence[Candidate]:
    """The first set `fits` confirms, level by level, each level's sets that fit on
    their node in `key` order."""
    slots = source.slots(least, max_victims)
    levels = _levels(slots, least, max_victims)
    built: dict[int, node_aware._Node] = {}
    for t, k in sorted(levels):
        sets: list[tuple[Candidate, ...]] = []
        for at in levels[(t, k)]:
            node = built.get(at)
            if node is None:
                slot = slots[at]
                node = built[at] = node_aware._Node(slot.usage, source.candidates(slot), needs)
            cands = node.cands
            allowed = [i for i, c in enumerate(cands) if c.tier <= t]
            if len(allowed) < k or not node.could(needs, allowed, k):
                continue
            for chosen in itertools.combinations(allowed, k):
                if any(cands[i].tier == t for i in chosen) and node.fits(needs, chosen):
                    sets.append(tuple([cands[i] for i in chosen]))  # type: ignore[misc]
        if not sets:
            continue
        load_s = node_aware.load_costs(view, {c.model for vs in sets for c in vs})
        sets.sort(key=lambda vs: node_aware.key(vs, load_s))
        for vs in sets:
            if fits(vs):
                return vs
    return ()


def _checked(
    view: View,
    profiles: Sequence[catalog.Profile],
    cands: Sequence[Candidate],
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
    fallback: Callable[[], Sequence[Candidate]],
    source: Source,
    spec: Callable[[int, int], list[tuple[str, list[Candidate]]]],
) -> Sequence[Candidate]:
    """The lazy search, then the spec's over `spec`'s nodes: the same sets must be tried
    in the same order (each of the spec's answered by the dry run the lazy one ran) and
    the same set taken; `PolicyMismatch` with one line on the first difference."""

    class Lazy:
        spec = None
        slots = source.slots
        candidates = source.candidates

    tried: list[tuple[tuple[str, ...], bool]] = []

    def recorded(vs: Sequence[Candidate]) -> bool:
        ok = fits(vs)
        tried.append((tuple([v.replica for v in vs]), ok))
        return ok

    got = search(view, profiles, cands, max_victims, recorded, fallback, Lazy())
    at = 0

    def replayed(vs: Sequence[Candidate]) -> bool:
        nonlocal at
        ids = tuple([v.replica for v in vs])
        if at >= len(tried) or tried[at][0] != ids:
            lazy = tried[at][0] if at < len(tried) else "nothing"
            raise PolicyMismatch(
                f"policy check: node-aware's set {at} tried is {ids} by the spec, {lazy} by "
                "the lazy search"
            )
        at += 1
        return tried[at - 1][1]

    def nodes(least: int) -> list[tuple[str, list[Candidate]]]:
        return spec(least, max_victims)

    want = node_aware.search(view, profiles, cands, max_victims, replayed, fallback, nodes)
    if at != len(tried) or [v.replica for v in got] != [v.replica for v in want]:
        raise PolicyMismatch(
            f"policy check: node-aware takes {[v.replica for v in want]} after {at} sets by "
            f"the spec, {[v.replica for v in got]} after {len(tried)} by the lazy search"
        )
    return want
