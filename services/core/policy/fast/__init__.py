"""The fast engine: the spec's answers (`engine.PLAIN`) worked out from less.

Four speed-ups, behind the one protocol (`engine.Engine`), each held to the spec by a
differential test and, under the checked engine (`checked.Checked`), on every call:
- `index`: the candidates from groups of replicas kept in order as the view folds
  (`Index.follow`), not from a walk of every replica (`found`, `entries`, `walks`);
- `node_levels`: node-aware's set on one node from only the nodes that could make room
  at each level, walked best first (`slots.Slots` reads them from the index);
- `gang_levels`: the set of whole gangs, a level of one victim read from the candidates
  of its tier, best first (`slots.GangSlots`);
- `narrow`: each set tried on a copy of only the nodes where room can appear.

`Fast` is the engine a caller owns (the preemption service's leader, the simulator's
engine): one follows one view. No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.core import catalog
from services.core.policy.decision import Candidate
from services.core.policy.fast import gang_levels, node_levels
from services.core.policy.fast.found import IndexFound
from services.core.policy.fast.index import Index
from services.core.policy.fast.narrow import Narrow
from services.core.policy.fast.slots import GangSlots, Slots
from services.core.policy.plain_sets import Fits
from services.core.view import View

__all__ = ["Fast", "Index", "Narrow"]


class Fast(Index):
    """The fast engine: the index's candidates, the lazy walks, the narrowed trials."""

    __slots__ = ()
    name = "fast"

    def trials(
        self, view: View, profiles: Sequence[catalog.Profile], avoid: tuple[str, ...]
    ) -> Narrow:
        return Narrow(view, profiles, avoid)

    def node_set(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        found: IndexFound,
        max_victims: int,
        fits: Fits,
        fallback: Callable[[], Sequence[Candidate]],
    ) -> Sequence[Candidate]:
        return node_levels.search(view, profiles, max_victims, fits, fallback, Slots(found))

    def gang_set(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        found: IndexFound,
        max_victims: int,
        fits: Fits,
        tr: Narrow,
    ) -> Sequence[Candidate]:
        source = GangSlots(found)
        return gang_levels.search(view, profiles, source, max_victims, fits, tr.domains)
