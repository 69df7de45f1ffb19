"""Helpers the policy's tests share and the policy itself does not use.

`first_fit` is node-aware's walk of one level (`node_aware._first_of`) over sets given as
they are, for the tests that check it tries them in `node_aware.key` order; `Listed` is a
`gang_levels.Source` from a whole list of candidates, for the tests that hold the lazy
gang search to the plain one. Production code keeps only what it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from services.core.policy import node_aware, rules
from services.core.policy.decision import Candidate
from services.core.policy.fast.gang_levels import Order

C = TypeVar("C", bound=node_aware.Victim)


def first_fit(
    level_sets: list[tuple[C, ...]],
    load_s: dict[str, float],
    fits: Callable[[Sequence[C]], bool],
) -> Sequence[C]:
    """The first of one level's sets, in `node_aware.key` order, that `fits` confirms;
    empty when none does.

    Every set of a level has the same highest tier and the same number of victims, so
    `key` orders them by the work thrown away first: they are sorted by that alone, and
    the whole key is worked out only for the sets tied with the one tried, usually the
    first few of the level rather than all of it."""
    thrown = [sum([load_s.get(v.model, 0.0) * v.gpus for v in vs]) for vs in level_sets]
    return node_aware._first_of(level_sets, thrown, load_s, fits, _as_is)


def _as_is(vs: tuple[C, ...]) -> tuple[C, ...]:
    return vs


class Listed:
    """A `gang_levels.Source` from a whole list of candidates in order (the plain walk's
    `every`)."""

    __slots__ = ("_by_node", "cands", "spec")

    def __init__(self, cands: Sequence[Candidate]) -> None:
        self.cands = cands
        self.spec: Callable[[], Sequence[Candidate]] | None = None
        self._by_node: dict[str, list[int]] | None = None

    def tiers(self) -> list[int]:
        return sorted({c.tier for c in self.cands})

    def of_tier(self, t: int) -> list[tuple[Order, str, object]]:
        return [(rules.order_key(c), c.model, c) for c in self.cands if c.tier == t]

    def candidate(self, made_from: object) -> Candidate:
        assert isinstance(made_from, Candidate)
        return made_from

    def on(self, names: Sequence[str]) -> list[Candidate]:
        by = self._by_node
        if by is None:
            by = self._by_node = {}
            for i, c in enumerate(self.cands):
                for n in c.nodes or (c.node,):
                    by.setdefault(n, []).append(i)
        return [self.cands[i] for i in sorted({i for n in names for i in by.get(n, ())})]

    def every(self) -> Sequence[Candidate]:
        return self.cands
