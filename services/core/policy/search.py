"""The reference's search for victims: the first candidates in order until the model fits.

`preemptFor` (reference/preempt.go), read beside it. Called by `plan` under the policy
"reference", and by node-aware for a profile of several shards. It only reads the first
`max_victims` candidates of the order, so the engine's `first` is all it asks for.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.core.policy.decision import Candidate
from services.core.policy.trials import Trials, prune


def reference(tr: Trials, cands: Sequence[Candidate], max_victims: int) -> list[Candidate]:
    """The victims to stop, empty when none of the sets tried makes room. Candidates are
    added in order until the model fits, then pruned (`trials.prune`); past
    `max_victims` the model is better reported as not fitting than paid for with half a
    cluster."""
    chosen: list[Candidate] = []
    for c in cands[:max_victims]:
        chosen.append(c)
        if tr.fits_without(chosen):
            return prune(tr, chosen)
    return []
