"""Gangs as victims, for node-aware: a replica whose shards are on several nodes is one
candidate whose stopping frees all of them.

Called by `services.core.policy.plan` when its config's policy is "node-aware". The
shared rules exclude a multi-node replica ("multi_node", the reference's: "a multi-node
replica is its own decision"), so the reference never weighs one; node-aware takes such
a replica back as a candidate, with the tier the same rules give it (`candidates`), and
weighs sets of candidates inside one group of nodes (`search`): one domain of the level a
profile's topology requires, or, for a profile with no topology, the whole cluster (several
shards) or each node a gang is on (one shard). Every set is confirmed by the caller's dry
run on a cloned inventory, where placement itself keeps the shards inside one domain, so
a set is taken only when the model then fits within one domain of the level.

The keys are node-aware's own (`node_aware.key`): a gang counts as one victim (the cap
counts replicas, not shards), and its GPUs are all its shards', so the loading work it
throws away is counted for every shard. Bounded: each group weighs `POOL` candidates, of
each tier the largest first, and a set is tried only when enough nodes of the group could hold
a shard once it stops (`_could`). No I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from datetime import datetime

from services.core import catalog, placement
from services.core.policy import node_aware, rules
from services.core.policy.decision import Candidate, Exclusion, rfc3339
from services.core.view import ReplicaRecord, View, size_of

# POOL bounds the candidates weighed together in one group (a domain, a node, the
# cluster): of each tier the largest first. Past it the sets grow as POOL**max_victims,
# and within the cap the small victims past the first POOL free too little to matter.
POOL = 16


def candidates(view: View, a: rules.Asker, excluded: Sequence[Exclusion]) -> tuple[Candidate, ...]:
    """The multi-node replicas the rules excluded only for being spread over several
    nodes, as candidates: the tier the rules give them, every node in `nodes`."""
    spread = {x.replica for x in excluded if x.why == "multi_node"}
    if not spread:
        return ()
    models = {x.model for x in excluded if x.replica in spread}
    mine = view.catalog.names_of(a.m)
    live: dict[str, list[ReplicaRecord]] = {}
    for r in view.current():
        if r.holds_capacity and r.model in models and rules.excluded_by_state(r, mine) is None:
            live.setdefault(r.model, []).append(r)
    out: list[Candidate] = []
    for name, reps in live.items():
        other = view.catalog.resolve(name)
        if other is None:
            continue
        p = rules.peer_of(other, a)
        for r, above in rules.above_minimum(reps, other.min):
            if r.id not in spread:
                continue
            tier = rules.eligible_tier(p, r, above, a)
            if isinstance(tier, str):
                continue
            c = rules.candidate(p, r, above, a, tier, r.nodes[0], size_of(view, r))
            out.append(_spread(c, tuple(r.nodes)))
    return tuple(sorted(out, key=rules.order_key))


def _spread(c: Candidate, nodes: tuple[str, ...]) -> Candidate:
    return Candidate(
        c.replica, c.model, c.cls, c.owner, c.tier, c.above_min, c.idle_s, c.gpus,
        c.cpu_cores, c.memory_gb, c.node, c.borrowed, nodes,
    )  # fmt: skip


class _Group:
    """Nodes a set must make room within, their free GPUs, the profiles that must fit
    within them, and the candidates weighed there (the first `POOL` in order)."""

    __slots__ = ("base", "cands", "free", "profiles")

    def __init__(
        self, free: dict[str, int], profiles: list[catalog.Profile], cands: list[Candidate]
    ) -> None:
        self.free, self.profiles = free, profiles
        # Within the cap only large victims can make room for a large model: the pool
        # is the largest of each tier first (then in the order), not the first in it.
        self.cands = sorted(cands, key=_pooled)[:POOL] if len(cands) > POOL else cands
        # base: per profile, the nodes of the group with a shard's GPUs free already.
        self.base = [sum(1 for f in free.values() if f >= p.gpus) for p in profiles]


def _pooled(c: Candidate) -> tuple[int, int, tuple[int, float, int, float, str]]:
    return (c.tier, -c.gpus, rules.order_key(c))


def _nodes_of(c: Candidate) -> tuple[str, ...]:
    return c.nodes or (c.node,)


def _groups(
    view: View, profiles: Sequence[catalog.Profile], cands: Sequence[Candidate]
) -> list[_Group]:
    """The groups to weigh sets in, for the profiles (see the module's docstring)."""
    inv = view.inventory
    out: list[_Group] = []
    # at: per node, where its candidates are in `cands` (so a group's are in order).
    at: dict[str, list[int]] = {}
    for i, c in enumerate(cands):
        for n in _nodes_of(c):
            at.setdefault(n, []).append(i)

    def group(names: Sequence[str], ps: list[catalog.Profile]) -> None:
        free = {n: len(u.free) for n in names if (u := inv.usage(n)) is not None and u.schedulable}
        mine = [cands[i] for i in sorted({i for n in free for i in at.get(n, ())})]
        if mine and (any(c.nodes for c in mine) or any(p.shards > 1 for p in ps)):
            out.append(_Group(free, ps, mine))

    for level in sorted({p.topology_level for p in profiles if p.topology_level}):
        ps = [p for p in profiles if p.topology_level == level]
        domains = placement.domains_of(inv.usages(), level)
        for d in sorted(domains):
            group(sorted(u.node.name for u in domains[d]), ps)
    loose = [p for p in profiles if not p.topology_level]
    if any(p.shards > 1 for p in loose):
        group(inv.names(), loose)
    elif loose:
        for n in sorted({n for c in cands if c.nodes for n in c.nodes}):
            group([n], loose)
    return out


def _could(g: _Group, vs: Sequence[Candidate], freed_of: Callable[[str], dict[str, int]]) -> bool:
    """Whether, with `vs` stopped, enough nodes of the group would have the GPUs for a
    shard of one of its profiles: what the dry run needs at least (it also checks the
    GPUs' model and memory, CPU and memory), worked out without cloning anything."""
    touched: dict[str, int] = {}
    for v in vs:
        for n, k in freed_of(v.replica).items():
            if n in g.free:
                touched[n] = touched.get(n, g.free[n]) + k
    for p, base in zip(g.profiles, g.base, strict=True):
        gained = sum(1 for n, f in touched.items() if f >= p.gpus and g.free[n] < p.gpus)
        if base + gained >= p.shards:
            return True
    return False


def search(
    view: View,
    profiles: Sequence[catalog.Profile],
    cands: Sequence[Candidate],
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
) -> Sequence[Candidate]:
    """The best set of at most `max_victims` of `cands` (gangs among them) inside one
    group, by `node_aware.key`, that `fits` confirms; empty when none does. Sets are
    weighed level by level, (highest tier, size) in order, each level in key order."""
    groups = _groups(view, profiles, cands)
    if not groups:
        return ()
    freed_of = freed(view)
    load_s = node_aware.load_costs(view, {c.model for c in cands})
    for t in sorted({c.tier for c in cands}):
        for k in range(1, max_victims + 1):
            got = first_of_level(groups, t, k, freed_of, load_s, fits)
            if got:
                return got
    return ()


def freed(view: View) -> Callable[[str], dict[str, int]]:
    """Per replica, the GPUs it would free on each of its nodes (read once each)."""
    inv = view.inventory
    got: dict[str, dict[str, int]] = {}

    def freed_of(replica: str) -> dict[str, int]:
        out = got.get(replica)
        if out is None:
            al = inv.allocation(replica)
            out = got[replica] = {} if al is None else {s.node: len(s.gpus) for s in al.shards}
        return out

    return freed_of


def first_of_level(
    groups: Sequence[_Group],
    t: int,
    k: int,
    freed_of: Callable[[str], dict[str, int]],
    load_s: dict[str, float],
    fits: Callable[[Sequence[Candidate]], bool],
) -> tuple[Candidate, ...]:
    """The first set of level (t, k) in key order that `fits` confirms: every k of a
    group's candidates of tier t or below, one of them of tier t, that `_could` make
    room there, each set once (as the first group it is found in has it)."""
    level: dict[tuple[str, ...], tuple[Candidate, ...]] = {}
    for g in groups:
        allowed = [c for c in g.cands if c.tier <= t]
        for vs in itertools.combinations(allowed, k):
            if any(c.tier == t for c in vs) and _could(g, vs, freed_of):
                level.setdefault(tuple(sorted(c.replica for c in vs)), vs)
    for vs in sorted(level.values(), key=lambda vs: node_aware.key(vs, load_s)):
        if fits(vs):
            return vs
    return ()


def domain_of(view: View, placed: placement.Placement | None) -> str:
    """`level=value` of the domain a placement is in, for a profile that keeps its
    shards in one; "" otherwise."""
    if placed is None or not placed.profile.topology_level:
        return ""
    level = placed.profile.topology_level
    values = set()
    for s in placed.shards:
        node = view.inventory.node(s.node)
        values.add(None if node is None else node.labels.get(level))
    if len(values) != 1 or None in values:
        return ""
    return f"{level}={values.pop()}"


def pinned_elsewhere(
    view: View,
    model: str,
    profiles: Sequence[catalog.Profile],
    avoid: tuple[str, ...],
    now: datetime,
) -> str:
    """For a model that fits: the words to add when it fits only outside the domain its
    placement is pinned to (`View.pin`), where the scheduler keeps it until the pin's
    hold ends; "" otherwise."""
    pin = view.pin(model, now)
    if pin is None or isinstance(
        placement.place(view.inventory, profiles, avoid, domain=pin.domain), placement.Placement
    ):
        return ""
    assert pin.until is not None  # Invariant: a pin on has its end.
    return (
        f", but not in {pin.domain}, where its placement is pinned by "
        f"{pin.decision} until {rfc3339(pin.until)}"
    )
