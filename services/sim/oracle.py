"""The exhaustive oracle: was a `no_fit` needless?

Used by `services.sim.engine` for every `no_fit` decision, and by the node-aware
policy's tests. A `no_fit` is needless when some set of at most `max_victims` of the
decision's own candidates (the replicas the shared rules let go) would have let the
model be placed. The oracle tries such sets with `placement.place` on a clone of the
inventory, so it is only run where they are few: past `limit` sets it answers None (not
checked). Pure.

When every profile has one shard, a set that makes room and is as small as it can be
lies on one node (a victim elsewhere could be kept), so the sets tried are those of each
node's own candidates: every set that matters, at a fraction of the cost. With a profile
of several shards every set of the candidates is tried. `limit` counts those sets, of
every size from 1 to `max_victims`.

Fewer are placed than counted, with the same answer. Stopping a replica only adds to
what its nodes have free (its GPUs, and its CPU and memory, never negative), so whatever
fits without a set fits without any set that holds it: a group's sets of the largest
size it allows are the only ones placed, since every smaller set lies within one of
them. A model that fits as the cluster stands fits with the first set tried, so that is
one placement on the whole inventory; one that does not can then, with one shard per
profile, only fit on the nodes a set stops replicas on, and only those are looked at
(`placement.place`'s `within`). One clone serves every set: its victims are released,
the model placed, and their allocations restored.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from operator import attrgetter

from services.core import placement
from services.core.inventory import Inventory
from services.core.policy import every_candidate, node_aware
from services.core.preemption import Candidate, Decision
from services.core.view import View

# LIMIT is the most sets the oracle counts for one decision: on the small clusters it
# is meant for, few enough to try.
LIMIT = 3000


@functools.cache
def sets(n: int, max_victims: int) -> int:
    """How many sets of 1 to max_victims of n candidates there are."""
    return sum(math.comb(n, k) for k in range(1, min(n, max_victims) + 1))


def exists(view: View, d: Decision, max_victims: int, limit: int = LIMIT) -> bool | None:
    """Whether some set of at most `max_victims` of the candidates `d` weighed (all of
    them, not only those it lists: `policy.every_candidate`) makes room for `d.model` on
    `view`; None when there are more than `limit` such sets to try."""
    m = view.catalog.resolve(d.model)
    if m is None:
        return False
    profiles = [p for p in m.profiles if p.name in d.profiles]
    one_shard = all(p.shards == 1 for p in profiles)
    groups = _groups(view, every_candidate(view, d), one_shard, max_victims, limit)
    if groups is None:
        return None
    least = min((p.gpus for p in profiles), default=0)
    usage = view.inventory.usage
    trial: Inventory | None = None
    for g in groups:
        if not g:
            continue
        if len(groups) > 1:
            # Whether the node's candidates could free enough GPUs for the smallest
            # profile: its free GPUs and the most any `max_victims` of them hold. Only a
            # bound, to pass over a node without trying its sets.
            u = usage(g[0].node)
            free = 0 if u is None else len(u.free)
            if not node_aware.could_free(free, [c.gpus for c in g], least, max_victims):
                continue
        if trial is None:
            # The first group with a set to try: if the model fits as the cluster
            # stands, that set makes room.
            if isinstance(placement.place(view.inventory, profiles, d.avoid), placement.Placement):
                return True
            trial = view.inventory.clone()
        for chosen in itertools.combinations(g, min(len(g), max_victims)):
            gone = [a for a in map(trial.allocation, [c.replica for c in chosen]) if a]
            for a in gone:
                trial.release_replica(a.replica)
            within = {s.node for a in gone for s in a.shards} if one_shard else None
            if isinstance(
                placement.place(trial, profiles, d.avoid, within=within), placement.Placement
            ):
                return True
            for a in gone:
                trial.restore(a)
    return False


def _groups(
    view: View, candidates: Sequence[Candidate], one_shard: bool, max_victims: int, limit: int
) -> list[Sequence[Candidate]] | None:
    """The groups of candidates whose sets are tried: each node's own with one shard per
    profile, else all of them in one; None when they hold more than `limit` sets. Most
    decisions on a large cluster are answered None from the count alone."""
    groups: list[Sequence[Candidate]] | None
    if one_shard:
        # Counted per node before any group is built: on a large cluster the answer is
        # most often that there are too many sets to try. (Counter counts in C: a
        # loop here would take twice its time over the hundreds of candidates.)
        per_node = Counter(map(_node, candidates))
        # Summed per count of candidates, not per node: a couple of hundred nodes hold
        # a handful of distinct counts, and nodes with as many give as many sets.
        counts = Counter(per_node.values())
        if sum(sets(n, max_victims) * k for n, k in counts.items()) > limit:
            groups = None
        else:
            # Each node's list made up front (in the order nodes first appear), so the
            # loop over the candidates only appends.
            by_node: dict[str, list[Candidate]] = {n: [] for n in per_node}
            for c in candidates:
                by_node[c.node].append(c)
            groups = list(by_node.values())
    else:
        groups = None if sets(len(candidates), max_victims) > limit else [candidates]
    return groups


_node = attrgetter("node")
