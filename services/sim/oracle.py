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
of several shards every set of the candidates is tried.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from operator import attrgetter

from services.core import placement
from services.core.preemption import Candidate, Decision
from services.core.view import View

# LIMIT is the most sets the oracle tries for one decision: every one of them is a
# placement on a cloned inventory, fine on the small clusters it is meant for.
LIMIT = 3000


@functools.cache
def sets(n: int, max_victims: int) -> int:
    """How many sets of 1 to max_victims of n candidates there are."""
    return sum(math.comb(n, k) for k in range(1, min(n, max_victims) + 1))


def exists(view: View, d: Decision, max_victims: int, limit: int = LIMIT) -> bool | None:
    """Whether some set of at most `max_victims` of `d.candidates` makes room for `d.model`
    on `view`; None when there are more than `limit` such sets to try."""
    m = view.catalog.resolve(d.model)
    if m is None:
        return False
    profiles = [p for p in m.profiles if p.name in d.profiles]
    groups: list[tuple[Candidate, ...]]
    if all(p.shards == 1 for p in profiles):
        # Counted per node before any group is built: on a large cluster the answer is
        # most often that there are too many sets to try.
        per_node = Counter(map(_node, d.candidates))
        # Summed per count of candidates, not per node: a couple of hundred nodes hold
        # a handful of distinct counts, and nodes with as many give as many sets.
        counts = Counter(per_node.values())
        if sum(sets(n, max_victims) * k for n, k in counts.items()) > limit:
            return None
        # Each node's list made up front (in the order nodes first appear, as before),
        # so the loop over the candidates only appends.
        by_node: dict[str, list[Candidate]] = {n: [] for n in per_node}
        for c in d.candidates:
            by_node[c.node].append(c)
        groups = [tuple(g) for g in by_node.values()]
    else:
        groups = [d.candidates]
        if sets(len(d.candidates), max_victims) > limit:
            return None
    least = min((p.gpus for p in profiles), default=0)
    for g in groups:
        if len(groups) > 1 and not _could(view, g, least, max_victims):
            continue
        for k in range(1, min(len(g), max_victims) + 1):
            for chosen in itertools.combinations(g, k):
                inv = view.inventory.clone()
                for c in chosen:
                    inv.release_replica(c.replica)
                if isinstance(placement.place(inv, profiles, d.avoid), placement.Placement):
                    return True
    return False


_node = attrgetter("node")


def _could(view: View, group: tuple[Candidate, ...], least: int, max_victims: int) -> bool:
    """Whether one node's candidates could free enough GPUs for the smallest profile: its
    free GPUs and the most any `max_victims` of them hold. Only a bound, to pass over a
    node without trying its sets; a node that passes is tried in full."""
    free = len(view.inventory.free_gpus(group[0].node))
    if free >= least:
        return True  # room already, whatever its candidates hold
    held = [c.gpus for c in group]
    if len(held) > max_victims:
        # Sorted only where there are more candidates than victims: most nodes' few
        # candidates are summed as they are.
        held.sort(reverse=True)
        del held[max_victims:]
    return free + sum(held) >= least
