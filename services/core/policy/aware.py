"""Node-aware's choice of victims, as `plan` asks for it once the model neither fits nor
waits: the best set on the node the model would go to, then, where gangs are in play,
the best set of whole gangs, and the better of the two by `node_aware.key`.

The set on one node comes from the spec's search (`node_aware.search`, over the nodes
that could make room) or, when the engine offers it, from the lazy walk
(`node_levels.search`): the same set, the same sets tried in the same order, reading
fewer nodes. The set of whole gangs comes from the spec's gang search (`gangs.search`,
over every candidate) or, when the engine offers it, from the lazy one
(`gang_levels.search`), likewise the same. The trials are the decision's (`tr`); the reference's search, which
node-aware runs too for a profile of several shards, tries on trials of its own. No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.core import catalog
from services.core.policy import gang_levels, gangs, node_aware, node_levels, search
from services.core.policy.decision import Candidate
from services.core.policy.engine import Found
from services.core.policy.narrow import Narrow
from services.core.policy.trials import Trials
from services.core.view import View


def choose(
    view: View,
    profiles: list[catalog.Profile],
    found: Found,
    max_victims: int,
    tr: Trials,
) -> Sequence[Candidate]:
    """The victims node-aware proposes (empty when none), each set tried on `tr`."""
    first = found.first(max_victims)

    def fallback() -> list[Candidate]:
        # Its own trials: the decision's are those of the sets node-aware proposed.
        own = tr.beside() if isinstance(tr, Narrow) else Trials(view, profiles, tr.avoid)
        return search.reference(own, first, max_victims)

    lazily = found.lazily(view)
    if lazily is None:
        found_set = node_aware.search(
            view,
            profiles,
            first,
            max_victims,
            lambda gone: tr.fits_without(gone),
            fallback,
            lambda least: found.by_node(view, least, max_victims),
        )
    else:
        found_set = node_levels.search(
            view, profiles, first, max_victims, tr.fits_without, fallback, lazily
        )
    if found.has_gangs or any(p.shards > 1 for p in profiles):
        source = found.gangs_lazily(view)
        if source is None:
            whole = gangs.search(view, profiles, found.every(), max_victims, tr.fits_without)
        else:
            # The same set, the same sets tried (`gang_levels`), reading fewer candidates.
            domains = tr.domains if isinstance(tr, Narrow) else gang_levels.domains(view)
            whole = gang_levels.search(
                view, profiles, source, max_victims, tr.fits_without, domains
            )
        if whole:
            load_s = node_aware.load_costs(view, {v.model for v in (*whole, *found_set)})
            if not found_set or node_aware.key(whole, load_s) < node_aware.key(found_set, load_s):
                found_set = whole
    return found_set
