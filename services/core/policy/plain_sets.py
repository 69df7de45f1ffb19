"""Node-aware's sets as the plain engine (`engine.Plain`) finds them: the spec's searches
(`node_aware.search`, `gangs.search`) over every candidate. Node-aware is this project's
own policy, not the reference's; these are its searches behind the engine's protocol.
No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from services.core import catalog
from services.core.policy import gangs, node_aware
from services.core.policy.decision import Candidate
from services.core.policy.trials import Trials
from services.core.view import View

Fits = Callable[[Sequence[Candidate]], bool]
"""A dry run of one set (`Trials.fits_without`): whether the model fits with it gone."""


class Every(Protocol):
    """What the spec's searches read of a `Found`: every candidate, in order."""

    def every(self) -> tuple[Candidate, ...]: ...


class PlainSets:
    """Node-aware's set on one node and its set of whole gangs, by the spec's searches."""

    __slots__ = ()

    def node_set(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        found: Every,
        max_victims: int,
        fits: Fits,
        fallback: Callable[[], Sequence[Candidate]],
    ) -> Sequence[Candidate]:
        return node_aware.search(view, profiles, found.every(), max_victims, fits, fallback)

    def gang_set(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        found: Every,
        max_victims: int,
        fits: Fits,
        tr: Trials,
    ) -> Sequence[Candidate]:
        return gangs.search(view, profiles, found.every(), max_victims, fits)
