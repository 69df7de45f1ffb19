"""Node-aware's choice of victims, as `plan` asks for it once the model neither fits nor
waits: the best set on the node the model would go to, then, where gangs are in play,
the best set of whole gangs, and the better of the two by `node_aware.key`.

Both sets come from the engine (`Engine.node_set`, `Engine.gang_set`): the spec's
searches (`node_aware.search`, `gangs.search`) under the plain engine, the lazy walks
that find the same sets, trying the same sets in the same order, under the fast one.
The sets are tried on the decision's trials (`tr`); the reference's search, which
node-aware runs too for a profile of several shards, tries on trials of its own
(`Trials.beside`). No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from services.core import catalog
from services.core.policy import node_aware, search
from services.core.policy.decision import Candidate
from services.core.policy.trials import Trials
from services.core.view import View

if TYPE_CHECKING:
    from services.core.policy.engine import Engine, Found

F = TypeVar("F", bound="Found")
T = TypeVar("T", bound=Trials)


def choose(
    view: View,
    profiles: list[catalog.Profile],
    engine: Engine[F, T],
    found: F,
    max_victims: int,
    tr: T,
) -> Sequence[Candidate]:
    """The victims node-aware proposes (empty when none), each set tried on `tr`."""
    first = found.first(max_victims)

    def fallback() -> list[Candidate]:
        # Its own trials: the decision's are those of the sets node-aware proposed.
        return search.reference(tr.beside(), first, max_victims)

    found_set = engine.node_set(view, profiles, found, max_victims, tr.fits_without, fallback)
    if found.has_gangs or any(p.shards > 1 for p in profiles):
        whole = engine.gang_set(view, profiles, found, max_victims, tr.fits_without, tr)
        if whole:
            load_s = node_aware.load_costs(view, {v.model for v in (*whole, *found_set)})
            if not found_set or node_aware.key(whole, load_s) < node_aware.key(found_set, load_s):
                found_set = whole
    return found_set
