"""The check of a fast search against its spec (`LLMGW_POLICY_CHECK=1`): the sets the
fast one tried, with the dry run's answers, replayed to the spec in the same order.

A search's sets are tried on the dry run one at a time and the first that fits is
taken, so two searches agree when they try the same sets in the same order and take the
same one. The fast search runs first with the real dry run (`recorded`); the spec then
runs with `replayed`, which answers each set from the record and stops with one line
on the first set out of order; `agreed` checks both took the same. Used by
`node_levels` and `gang_levels`. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.core.errors import PolicyMismatch
from services.core.policy.decision import Candidate


class Tried:
    """One check: what the fast search tried (`recorded`), replayed to the spec."""

    __slots__ = ("at", "fits", "tried", "what")

    def __init__(self, fits: Callable[[Sequence[Candidate]], bool], what: str) -> None:
        self.fits, self.what = fits, what
        self.tried: list[tuple[tuple[str, ...], bool]] = []
        self.at = 0

    def recorded(self, vs: Sequence[Candidate]) -> bool:
        ok = self.fits(vs)
        self.tried.append((tuple([v.replica for v in vs]), ok))
        return ok

    def replayed(self, vs: Sequence[Candidate]) -> bool:
        ids, at, tried = tuple([v.replica for v in vs]), self.at, self.tried
        if at >= len(tried) or tried[at][0] != ids:
            lazy = tried[at][0] if at < len(tried) else "nothing"
            raise PolicyMismatch(
                f"policy check: {self.what}'s set {at} tried is {ids} by the spec, {lazy} by "
                "the lazy search"
            )
        self.at += 1
        return tried[at][1]

    def agreed(self, got: Sequence[Candidate], want: Sequence[Candidate], whole: bool) -> None:
        """Raise unless the spec replayed every set and took what the fast search took
        (`whole`: every field of each victim alike, not only the ids)."""
        same = (
            list(got) == list(want)
            if whole
            else [v.replica for v in got] == [v.replica for v in want]
        )
        if self.at != len(self.tried) or not same:
            raise PolicyMismatch(
                f"policy check: {self.what} takes {[v.replica for v in want]} after {self.at} "
                f"sets by the spec, {[v.replica for v in got]} after {len(self.tried)} by the "
                "lazy search"
            )
