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

With every profile of several shards required inside one domain of one level, the sets
tried are those of each domain's own candidates (the replicas with a shard there), with
the same answer: the model fits once a set S stops only if some domain D then holds it;
D's nodes have as much free after stopping just the victims of S with a shard in D, a
set within D's candidates and no larger than S, so one of D's largest sets makes room
too, and fits inside D (so it is placed within D's nodes alone). A set whose domain's
GPUs could not hold the model even with it stopped is passed over without a placement
(`_by_domain`). The count against `limit` is still that of every set of the candidates,
so the same decisions are answered None. `tests/sim/test_oracle.py` compares it with
every set tried; on the gangs scenario it is what makes a week a matter of seconds.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from operator import attrgetter

from services.core import placement
from services.core.catalog import Profile
from services.core.inventory import Inventory
from services.core.policy import Candidate, Decision, every_candidate, node_aware
from services.core.view import View

# LIMIT is the most sets the oracle counts for one decision: on the small clusters it
# is meant for, few enough to try.
LIMIT = 3000


@functools.cache
def sets(n: int, max_victims: int) -> int:
    """How many sets of 1 to max_victims of n candidates there are."""
    return sum(math.comb(n, k) for k in range(1, min(n, max_victims) + 1))


def exists(
    view: View, d: Decision, max_victims: int, limit: int = LIMIT, *, by_domain: bool = True
) -> bool | None:
    """Whether some set of at most `max_victims` of the candidates `d` weighed (all of
    them, not only those it lists: `policy.every_candidate`) makes room for `d.model` on
    `view`; None when there are more than `limit` such sets to try. `by_domain=False`
    tries every set of the candidates where the profiles keep the model in one domain
    (the plain rule the domain groups are compared with)."""
    m = view.catalog.resolve(d.model)
    if m is None:
        return False
    profiles = [p for p in m.profiles if p.name in d.profiles]
    one_shard = all(p.shards == 1 for p in profiles)
    cands = every_candidate(view, d)
    groups = _groups(view, cands, one_shard, max_victims, limit)
    if groups is None:
        return None
    level = _required_level(profiles)
    if level is not None and by_domain:
        return _by_domain(view, d, cands, profiles, level, max_victims)
    least = min((p.gpus for p in profiles), default=0)
    usage = view.inventory.usage
    trial: Inventory | None = None
    for g in groups:
        if not g:
            continue
        if one_shard and len(groups) > 1:
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


def _required_level(profiles: Sequence[Profile]) -> str | None:
    """The level every profile of several shards is required inside one domain of, when
    all of them are (and there is one); None otherwise."""
    levels = {p.topology_level if p.topology_mode == "required" else None for p in profiles}
    if len(levels) != 1 or any(p.shards == 1 for p in profiles):
        return None
    return levels.pop()


def _by_domain(
    view: View,
    d: Decision,
    cands: Sequence[Candidate],
    profiles: Sequence[Profile],
    level: str,
    max_victims: int,
) -> bool:
    """`exists` for profiles all required inside one domain of `level`: the largest sets
    of each domain's own candidates, each placed inside that domain (see the module's
    docstring for why that is every set that matters). A set is placed only when the
    domain's GPUs could hold the model with it stopped: per node, its free GPUs and those
    the set holds there, at least one profile's GPUs on at least its shards' count of
    schedulable nodes. That bound is only a bound (it counts GPUs of any model, memory
    and health, and no CPU or memory), so a set it passes over cannot make room."""
    inv = view.inventory
    if cands and isinstance(placement.place(inv, profiles, d.avoid), placement.Placement):
        return True  # as every set tried first does: it fits as the cluster stands
    trial: Inventory | None = None
    for name, group, held, free in _domain_groups(view, cands, level):
        shapes = [(p.gpus, p.shards) for p in profiles]
        for chosen in itertools.combinations(range(len(group)), min(len(group), max_victims)):
            room = dict(free)
            for i in chosen:
                for node, n in held[i].items():
                    room[node] += n
            if not any(sum(x >= gpus for x in room.values()) >= k for gpus, k in shapes):
                continue
            if trial is None:
                trial = inv.clone()
            gone = [a for a in map(trial.allocation, [group[i].replica for i in chosen]) if a]
            for a in gone:
                trial.release_replica(a.replica)
            found = placement.place(trial, profiles, d.avoid, domain=f"{level}={name}")
            for a in gone:
                trial.restore(a)
            if isinstance(found, placement.Placement):
                return True
    return False


def _domain_groups(
    view: View, candidates: Sequence[Candidate], level: str
) -> list[tuple[str, list[Candidate], list[dict[str, int]], dict[str, int]]]:
    """Per domain of `level`, by name: the candidates with a shard on one of its nodes
    (as the inventory holds them: what stopping one frees), in the candidates' order, a
    gang across domains in each; the GPUs each holds per schedulable node of the domain;
    and each such node's free GPUs."""
    inv = view.inventory
    free: dict[str, dict[str, int]] = {}
    for u in inv.usages():
        dom = u.node.labels.get(level)
        if dom is not None and u.schedulable:
            free.setdefault(dom, {})[u.node.name] = len(u.free)
    by: dict[str, tuple[list[Candidate], list[dict[str, int]]]] = {}
    for c in candidates:
        a = inv.allocation(c.replica)
        if a is None:
            continue  # stopping it frees nothing
        for sh in a.shards:
            node = inv.node(sh.node)
            dom = None if node is None else node.labels.get(level)
            if dom is None:
                continue
            group, held = by.setdefault(dom, ([], []))
            if not group or group[-1] is not c:
                group.append(c)
                held.append({})
            if sh.node in free.get(dom, {}):
                held[-1][sh.node] = held[-1].get(sh.node, 0) + len(sh.gpus)
    return [(k, *by[k], free.get(k, {})) for k in sorted(by)]


_node = attrgetter("node")
