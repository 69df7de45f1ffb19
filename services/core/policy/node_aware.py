"""The node-aware search for victims: the best set on the node the model would go to.

Called by `services.core.policy.plan` when its config's policy is "node-aware", with the
candidates the shared rules found (same tiers, exclusions and cap as the reference's)
and a `fits` callback that tries a set on a clone of the inventory. It only proposes
sets; the dry run, the pruning and the decision stay the caller's. No I/O, no clock.

The reference takes candidates in tier order and tries only the first `max_victims`,
wherever they are: an idle replica on a node that can never hold the model uses up a
place. This search looks only at victims on one node, the node the model would then be
placed on, and of all sets within the cap that make the model fit there it takes the
best by `key`:

1. the lowest highest tier;
2. the fewest victims;
3. the least model-loading work thrown away (GPU-seconds, `load_costs`);
4. the longest idle (the set whose least idle victim has been idle longest);
5. the smallest (GPUs, then memory);
6. then by id.

Every set the reference can take, once pruned, lies on one node for a one-shard
profile, so it is among the sets weighed here: whenever the reference finds a set this
one finds one no worse by these keys. For a model with a profile of several shards the
reference's own search is run too (`fallback`), and the better of the two is taken.

Bounded: sets are weighed level by level, (highest tier, size) in order, and a node is
passed over at a level once even its largest allowed victims could not free enough,
so on a full cluster of 1,000 nodes most nodes cost a sum or two. This is the spec: the
fast engine finds the same set, trying the same sets in the same order, by walking each
level's nodes best first (`fast.node_levels`), held to this by a differential test.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from services.core import catalog
from services.core.inventory import NodeUsage, model_words
from services.core.quota import EPSILON
from services.core.view import View


class Victim(Protocol):
    """What the search reads of a candidate (`decision.Candidate`)."""

    @property
    def replica(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def tier(self) -> int: ...
    @property
    def node(self) -> str: ...
    @property
    def gpus(self) -> int: ...
    @property
    def memory_gb(self) -> float: ...
    @property
    def idle_s(self) -> float | None: ...


C = TypeVar("C", bound=Victim)

Key = tuple[int, int, float, float, int, float, tuple[str, ...]]


def key(victims: Sequence[Victim], load_s: dict[str, float]) -> Key:
    """The order of sets: lower is better (see the module's list)."""
    return (
        max([v.tier for v in victims]),
        len(victims),
        sum([load_s.get(v.model, 0.0) * v.gpus for v in victims]),
        -min([v.idle_s or 0.0 for v in victims]),
        sum([v.gpus for v in victims]),
        sum([v.memory_gb for v in victims]),
        tuple(sorted([v.replica for v in victims])),
    )


def load_costs(view: View, models: Iterable[str] | None = None) -> dict[str, float]:
    """Per model (of `models`, default all), the seconds one of its replicas takes from
    placement to ready: the median over its replicas in the log that became ready. A
    model never seen ready costs 0: what it would throw away is unknown, and an unknown
    is not charged."""
    took = view.load_times()
    names = took if models is None else [m for m in models if m in took]
    return {m: max(statistics.median(took[m]), 0.0) for m in names}


class Need:
    """One one-shard profile, as a node's GPUs are counted against it."""

    __slots__ = ("cpu", "gpus", "mem", "min_gb", "plain", "words")

    def __init__(self, p: catalog.Profile) -> None:
        self.gpus = p.gpus
        self.cpu = p.cpu_cores - EPSILON
        self.mem = p.memory_gb - EPSILON
        self.min_gb = p.gpu_memory_gb
        self.words = model_words(p.gpu_model) if p.gpu_model else frozenset()
        self.plain = self.min_gb <= 0 and not self.words

    def qualifies(self, u: NodeUsage, i: int) -> bool:
        g = u.gpus.get(i)
        return (
            g is not None
            and g.memory_gb >= self.min_gb
            and self.words <= u.words.get(i, frozenset())
        )


class NodeSets:
    """One node's candidates and what each would free there, per one-shard profile."""

    __slots__ = ("cands", "cpu", "free_q", "freed", "mem", "usage")

    def __init__(self, usage: NodeUsage, cands: Sequence[Victim], needs: list[Need]) -> None:
        self.usage = usage
        self.cands = cands
        healthy = set(usage.healthy)
        # Per profile: qualifying free GPUs, and per candidate the qualifying GPUs it frees.
        self.free_q: list[int] = []
        self.freed: list[list[int]] = []
        self.cpu: list[float] = []
        self.mem: list[float] = []
        held = usage.held
        gpus_of = []
        for c in cands:
            idx, cpu, mem = held.get(c.replica, ((), 0.0, 0.0))
            gpus_of.append([i for i in idx if i in healthy])
            self.cpu.append(cpu)
            self.mem.append(mem)
        for n in needs:
            if n.plain:
                self.free_q.append(len(usage.free))
                self.freed.append([len(g) for g in gpus_of])
            else:
                self.free_q.append(sum(1 for i in usage.free if n.qualifies(usage, i)))
                self.freed.append([sum(1 for i in g if n.qualifies(usage, i)) for g in gpus_of])

    def fits(self, needs: list[Need], chosen: tuple[int, ...]) -> bool:
        """Whether stopping the candidates at `chosen` lets one of the profiles fit here."""
        u = self.usage
        cpu = u.free_cpu + sum([self.cpu[i] for i in chosen])
        mem = u.free_memory + sum([self.mem[i] for i in chosen])
        for j, n in enumerate(needs):
            freed = self.freed[j]
            if (
                self.free_q[j] + sum([freed[i] for i in chosen]) >= n.gpus
                and cpu >= n.cpu
                and mem >= n.mem
            ):
                return True
        return False

    def could(self, needs: list[Need], allowed: list[int], k: int) -> bool:
        """Whether any k of `allowed` could free enough GPUs for some profile: a bound
        that passes over most nodes without weighing their sets."""
        for j, n in enumerate(needs):
            freed = self.freed[j]
            best = sorted([freed[i] for i in allowed], reverse=True)[:k]
            if self.free_q[j] + sum(best) >= n.gpus:
                return True
        return False


def could_free(free: int, held: list[int], least: int, max_victims: int) -> bool:
    """Whether a node with `free` free GPUs could have `least` free once at most
    `max_victims` of the replicas holding `held` GPUs on it stop: a bound that passes
    over a node without weighing its sets. `held` may be reordered."""
    if free >= least:
        return True  # room enough already, whatever its candidates hold
    if len(held) > max_victims:
        # Sorted only where there are more candidates than victims: most nodes' few
        # candidates are summed as they are.
        held.sort(reverse=True)
        del held[max_victims:]
    return free + sum(held) >= least


def search(
    view: View,
    profiles: Sequence[catalog.Profile],
    cands: Sequence[C],
    max_victims: int,
    fits: Callable[[Sequence[C]], bool],
    fallback: Callable[[], Sequence[C]],
) -> Sequence[C]:
    """The best set of at most `max_victims` of `cands` whose stopping lets the model be
    placed, confirmed by `fits` (the dry run); empty when there is none.

    `fallback` is the reference's search, run only when a profile has
    several shards (the model would go to several nodes, which one node's sets do not
    cover)."""
    needs = [Need(p) for p in profiles if p.shards == 1 and p.gpus >= 0]
    on: list[NodeSets] = []
    if needs:
        least = min(n.gpus for n in needs)
        on = _on_nodes(view, grouped(cands), needs, least, max_victims)
    return or_fallback(view, profiles, _by_levels(view, needs, on, max_victims, fits), fallback)


def or_fallback(
    view: View,
    profiles: Sequence[catalog.Profile],
    best: Sequence[C],
    fallback: Callable[[], Sequence[C]],
) -> Sequence[C]:
    """`best`, or the reference's set (`fallback`) when a profile has several shards and
    that set is better by `key`."""
    if any(p.shards > 1 for p in profiles):
        other = fallback()
        if other:
            load_s = load_costs(view, {v.model for v in (*other, *best)})
            if not best or key(other, load_s) < key(best, load_s):
                return other
    return best


def grouped(cands: Iterable[C]) -> list[tuple[str, list[C]]]:
    """Candidates per node they are on (a gang on its first), by node name, in their
    order; those on no node are left out."""
    by: dict[str, list[C]] = {}
    for c in cands:
        if c.node:
            by.setdefault(c.node, []).append(c)
    return sorted(by.items())


_Entry = tuple["NodeSets", tuple[int, ...]]


def _by_levels(
    view: View,
    needs: list[Need],
    nodes: list[NodeSets],
    max_victims: int,
    fits: Callable[[Sequence[C]], bool],
) -> Sequence[C]:
    """The first set `fits` confirms, level by level: (highest tier, size) in order, and
    within a level in `key` order (`_first_of`)."""
    load_s: dict[str, float] | None = None
    for t in sorted({c.tier for node in nodes for c in node.cands}):
        open_at = _open_at(nodes, t)
        for k in range(1, max_victims + 1):
            level = _level(open_at, needs, k)
            if not level:
                continue
            if load_s is None:
                load_s = load_costs(view, {c.model for node in nodes for c in node.cands})

            def made(entry: _Entry) -> tuple[C, ...] | None:
                node, chosen = entry
                if not node.fits(needs, chosen):
                    return None
                return tuple([node.cands[i] for i in chosen])  # type: ignore[misc]

            best = _first_of(level, _thrown(level, load_s), load_s, fits, made)
            if best:
                return best
    return ()


def _open_at(nodes: list[NodeSets], t: int) -> list[tuple[NodeSets, list[int], list[bool]]]:
    """Per node, its candidates of tier t or below, and whether each is of tier t. A set
    whose highest tier is below t was weighed at an earlier level, so a node with no
    candidate of tier t has no set at this one."""
    out = []
    for node in nodes:
        allowed = [i for i, c in enumerate(node.cands) if c.tier <= t]
        top = [c.tier == t for c in node.cands]
        if any(top):
            out.append((node, allowed, top))
    return out


def _level(
    open_at: list[tuple[NodeSets, list[int], list[bool]]], needs: list[Need], k: int
) -> list[_Entry]:
    """The level's sets: every k of a node's allowed candidates with one of tier t, as
    (the node, which of its candidates), in order; a node is passed over once even its k
    largest allowed victims could not free enough."""
    level: list[_Entry] = []
    for node, allowed, top in open_at:
        if len(allowed) < k or not node.could(needs, allowed, k):
            continue
        for chosen in itertools.combinations(allowed, k):
            if True in [top[i] for i in chosen]:
                level.append((node, chosen))
    return level


def _thrown(level: list[_Entry], load_s: dict[str, float]) -> list[float]:
    """The work each set of a level throws away, summed as `key` sums it."""
    thrown = []
    works: dict[int, list[float]] = {}
    for node, chosen in level:
        w = works.get(id(node))
        if w is None:
            w = works[id(node)] = [load_s.get(c.model, 0.0) * c.gpus for c in node.cands]
        thrown.append(sum([w[i] for i in chosen]))
    return thrown


def _on_nodes(
    view: View,
    per_node: Iterable[tuple[str, Sequence[Victim]]],
    needs: list[Need],
    least: int,
    max_victims: int,
) -> list[NodeSets]:
    """Per schedulable node with candidates, in name order, what its candidates would
    free there for `needs` (`NodeSets`); only the nodes where at most `max_victims` of them
    could free `least` GPUs (the smallest need): a bound before anything is worked out
    per profile, which on a full cluster passes over most nodes for a large model."""
    inv = view.inventory
    out = []
    for name, mine in per_node:
        usage = inv.usage(name)
        if usage is None or not usage.schedulable:
            continue
        if could_free(len(usage.free), [c.gpus for c in mine], least, max_victims):
            out.append(NodeSets(usage, mine, needs))
    return out


_E = TypeVar("_E")


def _first_of(
    level: Sequence[_E],
    thrown: list[float],
    load_s: dict[str, float],
    fits: Callable[[Sequence[C]], bool],
    made: Callable[[_E], tuple[C, ...] | None],
) -> Sequence[C]:
    """The first of one level's sets, in `key` order, that `fits` confirms; empty when
    none does. The level is given as entries, each with the work it throws away, that
    `made` makes into a set (None: it is no set of the level after all).

    Every set of a level has the same highest tier and the same number of victims, so
    `key` orders them by the work thrown away first: they are sorted by that alone, and
    the whole key is worked out only for the sets tied with the one tried, usually the
    first few of the level rather than all of it. A search's level holds every
    combination with a candidate of its tier, and whether one frees enough on its node
    is asked only of those in the order up to the one taken: the same sets, in the same
    order, as if those that do not had been left out first (the sort is stable, and
    leaving some out keeps the others' order)."""
    order = sorted(range(len(level)), key=thrown.__getitem__)
    i, n = 0, len(order)
    while i < n:
        # The sets tied on the work thrown away, in `key` order.
        j, least = i + 1, thrown[order[i]]
        while j < n and thrown[order[j]] == least:
            j += 1
        tied = [vs for x in order[i:j] if (vs := made(level[x])) is not None]
        if len(tied) > 1:
            tied.sort(key=lambda vs: key(vs, load_s))
        for vs in tied:
            if fits(vs):
                return vs
        i = j
    return ()
