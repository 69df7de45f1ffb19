"""Where candidates are found: one protocol, the spec's plain walk behind it.

`plan` asks an engine for the candidates and exclusions of one decision. `PlainWalk`
walks every replica holding capacity with the rules (`rules.candidates`) and is what a
reader verifies against the reference; a faster engine (`index.Index`) answers the same
question from what its owner kept current as the view folded, and is held to the plain
walk by a differential test. No engine is kept by core between calls: the caller owns it.
"""

from __future__ import annotations

from typing import Protocol

from services.core.policy import rules
from services.core.policy.decision import Candidate, Exclusion
from services.core.view import View


class Candidates(Protocol):
    """Finds who may be stopped for a model (`rules.Asker`) on a view."""

    def candidates(
        self, view: View, a: rules.Asker
    ) -> tuple[tuple[Candidate, ...], tuple[Exclusion, ...]]:
        """The candidates in `rules.order_key` order, and the exclusions by replica id."""
        ...


class PlainWalk:
    """The spec's own engine: every replica, every rule, on every call."""

    __slots__ = ()

    def candidates(
        self, view: View, a: rules.Asker
    ) -> tuple[tuple[Candidate, ...], tuple[Exclusion, ...]]:
        return rules.candidates(view, a)


PLAIN = PlainWalk()
