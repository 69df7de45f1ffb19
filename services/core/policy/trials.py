"""The dry run: a set of victims tried on a clone of the inventory, before anything stops.

The reference's `fitsWithout` (reference/preempt.go): stopping replicas that do not make
room is the one outcome worse than not preempting, so a set is stopped only once a clone
without it places the model. Used by both searches (`search`, `node_aware`); each trial
is recorded for the decision. Nothing is kept past one decision. No I/O.

The fast engine's trials (`fast.narrow.Narrow`) are the same on a copy of only the nodes
where room can appear, proven equal to these by tests/core/test_gangs.py and
tests/core/test_policy_index.py; an engine makes a decision's trials (`Engine.trials`).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.core import catalog, placement
from services.core.inventory import Inventory
from services.core.policy.decision import Candidate, TrialResult
from services.core.view import View


class Trials:
    """The sets tried for one decision, in the order tried, on the view's inventory."""

    __slots__ = ("avoid", "profiles", "trials", "view")

    def __init__(
        self, view: View, profiles: Sequence[catalog.Profile], avoid: tuple[str, ...]
    ) -> None:
        self.view, self.profiles, self.avoid = view, profiles, avoid
        self.trials: list[TrialResult] = []

    def beside(self) -> Trials:
        """Trials of their own for the same decision, of the same kind (the reference's
        search that node-aware runs too, whose sets are not the decision's)."""
        return Trials(self.view, self.profiles, self.avoid)

    def fits_without(self, gone: Sequence[Candidate], pruning: bool = False) -> bool:
        """Whether the model could be placed with `gone` stopped, tried on a clone. The
        placement tries without the avoided nodes first, then with them: a soft
        preference never turns room that exists into a preemption."""
        trial, within = self.copy(gone)
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

    def copy(self, gone: Sequence[Candidate]) -> tuple[Inventory, set[str] | None]:
        """The inventory a trial of `gone` places on, and the nodes it may place within
        (None: any): a clone of the whole."""
        return self.view.inventory.clone(), None


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
