"""The fast engine: the plain walk's answers from groups of replicas kept in order.

Owned by its caller (the preemption service's leader, the simulator's engine), never by
`View` or a module: one `Index` follows one view, and whoever folds that view asks with
it. Behind the same protocol as the plain walk (`engine.Candidates`), held to it by a
differential test (tests/core/test_policy_index.py) and, with `LLMGW_POLICY_CHECK=1`, on
every call of the preemption service and `llmgw simulate` (`Checked`).

Why it can be fast: every rule that decides a replica's tier reads of it only whether it
is above its model's minimum and whether it is borrowed (both known as the view folds),
how long it has gone unused and how long it has been ready (both compared with one
threshold per call); the rest is its model's class, owner and on-demand flag. So the
live replicas are kept in groups (`_Group`) of one (class, owner, on-demand, above
minimum, borrowed), each kept sorted by last use (the order key after the tier) and by
readiness. A call weighs each group once (`rules.tier_from_facts`, for "past the grace" and
not), cuts it at the grace and at the minimum lifetime by bisection, and merges the
groups' streams by the order key, building only the candidates it is asked for: the
first for the decision's list and the reference's search, those on the nodes that could
make room for node-aware (`by_node`). The counts by tier and by exclusion come from the
groups' sizes, less the few replicas a call sets apart (the model's own, the young, the
multi-node). What a call costs then grows with the groups and what it lists, not with the
replicas.

Kept current by `follow`, replica by replica: the view journals the replicas each change
touched (`View.journal`, and `View.uses` for a later use alone), and only those are looked
at again. A replica that was only used again moves within its group's order (to its end
when it is now the most recently used; a group many of whose replicas moved takes them
out and merges them back in one pass); one that starts or stops holding capacity, or
changes otherwise, leaves its entries and comes back. What depends on the other
replicas is kept alongside and moved by the change alone: which of a model's live
replicas are above its minimum (`_Model.live`, oldest first: adding or removing one moves
at most one other across the minimum), what each owner holds (counts of each amount,
summed when asked), and who is borrowed, per guaranteed quota level (`_Level`: its
members oldest first, the running sums through those within the guarantee; a change
moves the boundary, and only the members it passes change group). A declaration enters
again the replicas of the models it changed (`_redeclared`: at 10,000 nodes a model
declared for the first time cost a whole rebuild, 170-210 ms, in the decision that
followed it); a new quota tree builds everything again, as does a journal that no
longer reaches back to the last follow.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

from services.core import catalog, quota
from services.core.errors import PolicyMismatch
from services.core.inventory import NodeUsage
from services.core.policy import gang_levels, rules
from services.core.policy.config import WHY
from services.core.policy.decision import Candidate, Exclusion
from services.core.policy.engine import PLAIN, Candidates, Found, Listing
from services.core.policy.node_aware import could_free
from services.core.policy.node_levels import Slot, Source
from services.core.view import ReplicaRecord, View, size_of

# CHECK_ENV names the switch that runs the plain walk beside the index on every call and
# stops on the first difference (`Checked`); the shells read it, core reads no environment.
CHECK_ENV = "LLMGW_POLICY_CHECK"
# INDEX_ENV names the switch that turns the index off (`LLMGW_POLICY_INDEX=0`): the
# shells then decide with the plain walk.
INDEX_ENV = "LLMGW_POLICY_INDEX"
# LAZY_ENV names the switch that turns node-aware's lazy search off
# (`LLMGW_POLICY_LAZY=0`): the index then hands the spec's search every node that could
# make room (`by_node`).
LAZY_ENV = "LLMGW_POLICY_LAZY"
# LAZY_GANGS_ENV names the switch that turns the lazy gang search off
# (`LLMGW_POLICY_LAZY_GANGS=0`): the index then hands the spec's gang search every
# candidate (`every`).
LAZY_GANGS_ENV = "LLMGW_POLICY_LAZY_GANGS"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class _Rep:
    """One live replica of a declared model, as its group keeps it."""

    __slots__ = (
        "above",
        "first_node",
        "group",
        "key_ids",
        "key_ready",
        "lu",
        "node",
        "r",
        "size",
        "tie",
        "used",
    )

    def __init__(self, r: ReplicaRecord, above: bool, size: quota.Amount) -> None:
        # The record is the fold's, changed in place by later events: what the groups
        # are ordered by is read here, and again when the view journals a change of it
        # (`Index.follow`).
        self.r, self.above, self.size = r, above, size
        nodes = r.nodes
        self.node = rules.single_node(r, nodes)
        self.first_node = nodes[0] if nodes else None
        self.used = r.last_used_at is not None
        self.group: _Group | None = None
        # Where it comes in its group's `used` (by `lu`, its last use as the order was
        # made, then `tie`: `_USED`) or `never` (by `tie`: `_NEVER`), the order key after
        # the tier.
        self.tie = (size.gpus, size.memory_gb, r.id)
        self.lu = r.last_used_at
        self.key_ready = None if r.ready_at is None else (r.ready_at, r.id, self)
        self.key_ids = (r.id, self)


_USED = attrgetter("lu", "tie")
_NEVER = attrgetter("tie")


class _Group:
    """The live replicas of one (class, owner, on-demand, above minimum, borrowed): in
    order of last use (`used`, then `never` for those never reported used, both by
    `_USED` and `_NEVER`), by readiness and by id.

    The used are kept as a dict in order (`order`, its last `last`): a replica used
    again is most often the most recently used of all, and moves to the end in two dict
    steps, where a sorted list would take it out of the middle. `used` is the same as a
    list, copied when a call reads it after a change."""

    __slots__ = (
        "borrowed",
        "ids",
        "key",
        "last",
        "listed",
        "multi",
        "never",
        "order",
        "pending",
        "ready",
    )

    def __init__(self, key: tuple[str, str, bool, bool, bool]) -> None:
        self.key = key
        self.borrowed = key[4]
        self.order: dict[_Rep, None] = {}
        self.last: _Rep | None = None
        # pending: used ones whose place is before `last`, merged in by `settle`.
        self.pending: dict[_Rep, None] = {}
        self.listed: list[_Rep] | None = []
        self.never: list[_Rep] = []
        self.ready: list[tuple[object, ...]] = []
        self.ids: list[tuple[str, _Rep]] = []
        self.multi: dict[str, _Rep] = {}

    @property
    def used(self) -> list[_Rep]:
        got = self.listed
        if got is None:
            self.settle()
            got = self.listed = list(self.order)
        return got

    def add(self, x: _Rep) -> None:
        x.group = self
        if x.used:
            self._put(x)
        else:
            insort(self.never, x, key=_NEVER)
        if x.key_ready is not None:
            insort(self.ready, x.key_ready)
        insort(self.ids, x.key_ids)
        if x.node is None:
            self.multi[x.r.id] = x

    def remove(self, x: _Rep) -> None:
        if x.used:
            self._take(x)
        else:
            _unsort(self.never, x)
        if x.key_ready is not None:
            _drop(self.ready, x.key_ready)
        _drop(self.ids, x.key_ids)
        self.multi.pop(x.r.id, None)
        x.group = None

    def used_again(self, x: _Rep) -> None:
        """`x`'s last use moved on (later: the fold keeps only a later one): its place in
        the order moves, to the end when it is now the most recently used."""
        lu = x.r.last_used_at
        assert lu is not None  # invariant: a use is never taken back
        if x.used:
            self._take(x)
        else:
            _unsort(self.never, x)
            x.used = True
        x.lu = lu
        self._put(x)

    def _put(self, x: _Rep) -> None:
        last = self.last
        if last is None or _before(last, x):
            self.order[x] = None
            self.last = x
        else:
            self.pending[x] = None
        self.listed = None

    def _take(self, x: _Rep) -> None:
        if self.pending.pop(x, 0) is None:
            return
        order = self.order
        del order[x]
        if x is self.last:
            self.last = next(reversed(order), None)
        self.listed = None

    def settle(self) -> bool:
        """Merge the pending into the order, in one pass; whether there were any."""
        pending = self.pending
        if not pending:
            return False
        items = list(self.order)
        items += sorted(pending, key=_USED)
        items.sort(key=_USED)  # two sorted runs: merged in one pass
        self.order = dict.fromkeys(items)
        self.last = items[-1]
        pending.clear()
        return True


def _before(x: _Rep, y: _Rep) -> bool:
    """Whether `x` comes before `y` in a `used` order (`_USED`)."""
    a, b = x.lu, y.lu
    assert a is not None and b is not None
    return a < b or (a == b and x.tie < y.tie)


def _unsort(items: list[_Rep], x: _Rep) -> None:
    """Take `x` out of a `never` list (in `_NEVER` order)."""
    i = bisect_left(items, x.tie, key=_NEVER)
    assert items[i] is x  # invariant: kept in its list at its key
    del items[i]


def _summed(on: Mapping[str, _Rep]) -> tuple[int, ...]:
    sizes = sorted((rep.size.gpus for rep in on.values()), reverse=True)
    return (0, *itertools.accumulate(sizes))


def _drop(items: list[Any], key: Any) -> None:
    i = bisect_left(items, key)
    assert items[i] is key or items[i] == key  # invariant: kept keys are in their list
    del items[i]


def _signature(r: ReplicaRecord) -> tuple[object, ...]:
    """What the index reads of a replica besides its last use (and its id, model and
    creation, which never change): when it stays, a journaled change was a use."""
    return (
        r.state,
        r.shards,
        r.profile,
        r.ready_at,
        r.retiring_at,
        r.preempted_for,
        r.drain_reason,
    )


class _Held:
    """One replica holding capacity, as its model's entry keeps it: what it holds, and
    its entry in one of the lists (excluded by its state, of a model not in the catalog,
    or live in a group)."""

    __slots__ = ("age", "excluded", "r", "rep", "sig", "size", "unknown")

    def __init__(self, r: ReplicaRecord, size: quota.Amount) -> None:
        self.r, self.size, self.sig = r, size, _signature(r)
        # age: the order quota counts holdings in (`QuotaTree.borrowed`), with the amount.
        self.age = (r.created_at, r.id, size)
        self.excluded: tuple[str, Exclusion] | None = None
        self.unknown: tuple[str, ReplicaRecord] | None = None
        self.rep: _Rep | None = None


class _Model:
    """One model name's replicas holding capacity (`View.current_of`), as kept: each
    one's entry, and its live ones oldest first (by creation, then id), the minimum's
    first (`rules.above_minimum`: the newest are the ones above it)."""

    __slots__ = ("held", "live", "min", "name", "other", "owner", "reps")

    def __init__(self, name: str, other: catalog.Model | None) -> None:
        self.name, self.other = name, other
        self.owner = other.owner if other is not None else "default"
        self.min = other.min if other is not None else 0
        self.held: dict[str, _Held] = {}
        self.reps: dict[str, _Rep] = {}
        self.live: list[tuple[datetime, str]] = []


class _Level:
    """One guaranteed quota level: its members' holdings oldest first (the order
    `QuotaTree.borrowed` counts them in), and the running sums through each of those
    within the guarantee (`within`). Amounts are never negative, so once past, every
    later member is past too: those within are a prefix, the rest are borrowed here."""

    __slots__ = ("guarantee", "members", "within")

    def __init__(self, guarantee: quota.Amount) -> None:
        self.guarantee = guarantee
        self.members: list[tuple[datetime, str, quota.Amount]] = []
        self.within: list[tuple[int, float, float]] = []

    def _count_from(self, p: int) -> None:
        """The running sums from member `p` on, added in the same order as
        `QuotaTree.borrowed` adds them, so they are the same to the last bit."""
        within, members, g = self.within, self.members, self.guarantee
        del within[p:]
        gpus, cpu, mem = within[p - 1] if p else (0, 0.0, 0.0)
        for i in range(p, len(members)):
            a = members[i][2]
            gpus += a.gpus
            cpu += a.cpu_cores
            mem += a.memory_gb
            if not (
                gpus <= g.gpus
                and cpu <= g.cpu_cores + quota.EPSILON
                and mem <= g.memory_gb + quota.EPSILON
            ):
                return
            within.append((gpus, cpu, mem))

    def add(self, age: tuple[datetime, str, quota.Amount]) -> tuple[bool, list[str]]:
        """Count a new member: whether it is past here, and the members it pushed past."""
        members = self.members
        p = bisect_left(members, age)
        members.insert(p, age)
        k = len(self.within)
        if p > k:
            # After the first one past: the sums before it do not move.
            return True, []
        self._count_from(p)
        # Before, those past were from k on; they are from k + 1 on now, and the
        # boundary can only come nearer.
        k2 = len(self.within)
        return p >= k2, [members[i][1] for i in range(k2, k + 1) if i != p]

    def remove(self, age: tuple[datetime, str, quota.Amount]) -> list[str]:
        """Stop counting a member: the members no longer past here."""
        members = self.members
        p = bisect_left(members, age)
        assert members[p] is age  # invariant: a member's key is kept as it was added
        del members[p]
        k = len(self.within)
        if p > k:
            return []
        self._count_from(p)
        # Before, those past were from k on (from k - 1 on now, when the one gone was
        # within); the boundary can only go further.
        start = k - 1 if p < k else k
        return [members[i][1] for i in range(start, len(self.within))]


class Index:
    """The plain walk's answers (see the module's docstring) from groups kept current as
    the view folds. Follows one view: asked about another, it starts again."""

    __slots__ = (
        "_amounts",
        "_borrowed",
        "_by_state",
        "_catalog_version",
        "_changes",
        "_frozen",
        "_gang_nodes",
        "_groups",
        "_held",
        "_levels",
        "_live",
        "_models",
        "_nodes",
        "_past",
        "_shapes",
        "_sums_of",
        "_tops",
        "_tree",
        "_unknown",
        "_uses",
        "_view",
        "_walks",
        "lazy",
        "lazy_gangs",
    )

    def __init__(self, lazy: bool = True, lazy_gangs: bool = True) -> None:
        # lazy: node-aware's search reads the nodes level by level (`node_levels`); off,
        # the spec's search reads every node that could make room (`by_node`).
        self.lazy = lazy
        # lazy_gangs: the gang search reads the candidates of a tier and those of the
        # groups it weighs (`gang_levels`); off, the spec's reads every candidate.
        self.lazy_gangs = lazy_gangs
        # _gang_nodes: the gangs per node, as the lazy gang search last read them.
        self._gang_nodes: _GangNodes | None = None
        self._view: View | None = None
        self._tree: quota.QuotaTree | None = None
        self._reset()

    def _reset(self) -> None:
        self._catalog_version = -1
        self._changes = self._uses = -1
        self._models: dict[str, _Model] = {}
        self._held: dict[str, tuple[_Model, _Held]] = {}
        self._live: dict[str, _Rep] = {}
        self._groups: dict[tuple[str, str, bool, bool, bool], _Group] = {}
        self._by_state: list[tuple[str, Exclusion]] = []
        self._unknown: list[tuple[str, ReplicaRecord]] = []
        self._nodes: dict[str, dict[str, _Rep]] = {}
        # _tops: per node, the GPUs of its replicas' largest first, summed (entry i: the
        # i largest): what at most i of them could free there.
        self._tops: dict[str, tuple[int, ...]] = {}
        # _shapes: the nodes of each `_tops` value, so that a call passes over every node
        # of a shape whose bound falls short at once (`_Found._passing`).
        self._shapes: dict[tuple[int, ...], dict[str, None]] = {}
        self._walks = _Walks()
        # _amounts: per owner, how many of its replicas hold each amount; _sums_of: what
        # they sum to, None while a change has not been summed.
        self._amounts: dict[str, dict[quota.Amount, int]] = {}
        self._sums_of: dict[str, quota.Amount] | None = {}
        # _levels: per guaranteed quota level (by name), its members; _past: per replica,
        # at how many of its levels it is past the guarantee; _borrowed: those past one.
        self._levels: dict[str, _Level] = {}
        self._past: dict[str, int] = {}
        self._borrowed: set[str] = set()
        self._frozen: frozenset[str] | None = frozenset()

    # Keeping current.

    def follow(self, view: View) -> None:
        """Bring the groups up to date with `view`: the replicas it journaled since the
        last call, the replicas of the models a declaration changed, everything when the
        quota tree changed, a new view from the start."""
        if view is not self._view or view.quota is not self._tree:
            self._view = view
            self._tree = view.quota
            self._catalog_version = -1
        if view.catalog.version != self._catalog_version:
            if self._catalog_version < 0:
                self._rebuild(view)
                return
            self._redeclared(view)
        journal, uses = view.journal, view.uses
        if journal.count == self._changes and uses.count == self._uses:
            return
        changed, used = journal.since(self._changes), uses.since(self._uses)
        if changed is None or used is None:
            self._rebuild(view)
            return
        self._changes, self._uses = journal.count, uses.count
        # Each replica once, at its last use in the journal: those used in the order of
        # their uses are most often each the most recent so far, and go to the end.
        again = dict.fromkeys(reversed(used))
        if changed:
            replicas = view.state.replicas
            for rid in dict.fromkeys(changed):
                again.pop(rid, None)
                self._update(view, replicas[rid])
        # Used, and changed in nothing else (`View.note_use`): only the order moves.
        for x in filter(None, map(self._live.get, reversed(again))):
            lu = x.r.last_used_at
            if x.lu is lu:
                continue
            g = x.group
            assert g is not None and lu is not None
            if not x.used or (g.pending and x in g.pending):
                g.used_again(x)
                continue
            # `used_again`, written out for the most frequent case, once per event of a
            # serving log: taken out of the order, and in again at the end when it is
            # now the most recently used (it is, if it was last; `_before` written out).
            order, last = g.order, g.last
            del order[x]
            x.lu = lu
            if x is last or last is None or last.lu < lu or (last.lu == lu and last.tie < x.tie):  # type: ignore[operator]
                order[x] = None
                g.last = x
            else:
                g.pending[x] = None
            g.listed = None
        for g in self._groups.values():
            g.settle()

    def _redeclared(self, view: View) -> None:
        """A declaration changed: the models whose name now resolves otherwise (declared
        again, renamed, removed, an alias moved) have their replicas entered again; the
        rest stay as they are. A model declared for the first time has no replica yet."""
        resolve = view.catalog.resolve
        for name, e in list(self._models.items()):
            if resolve(name) == e.other:
                continue
            held = [h.r for h in e.held.values()]
            for h in list(e.held.values()):
                self._let_go(e, h)
            del self._models[name]
            for r in held:
                self._hold(view, r)
        self._catalog_version = view.catalog.version
        for g in self._groups.values():
            g.settle()

    def _rebuild(self, view: View) -> None:
        self._reset()
        self._catalog_version = view.catalog.version
        self._changes, self._uses = view.journal.count, view.uses.count
        for r in view.current():
            self._hold(view, r)
        for g in self._groups.values():
            g.settle()

    def _update(self, view: View, r: ReplicaRecord) -> None:
        """Bring one journaled replica's entries up to date."""
        got = self._held.get(r.id)
        if got is not None:
            e, h = got
            if r.holds_capacity and h.sig == _signature(r):
                x = h.rep
                lu = r.last_used_at
                if x is not None and lu is not None and x.lu is not lu:
                    assert x.group is not None
                    x.group.used_again(x)
                return
            self._let_go(e, h)
        if r.holds_capacity:
            self._hold(view, r)

    def _hold(self, view: View, r: ReplicaRecord) -> None:
        """Enter a replica that holds capacity: what it holds, then its entry."""
        name = r.model
        e = self._models.get(name)
        if e is None:
            e = self._models[name] = _Model(name, view.catalog.resolve(name))
        h = _Held(r, size_of(view, r))
        rid = r.id
        e.held[rid] = h
        self._held[rid] = (e, h)
        self._count(e.owner, h.size, 1)
        tree = self._tree
        assert tree is not None
        for q in tree.guaranteed_levels(e.owner):
            level = self._levels.get(q.name)
            if level is None:
                level = self._levels[q.name] = _Level(q.guarantee)
            past, pushed = level.add(h.age)
            if past:
                self._pass(rid, 1)
            for other in pushed:
                self._pass(other, 1)
        code = rules.excluded_by_state(r, ())
        if code is not None:
            h.excluded = (rid, Exclusion(replica=rid, model=name, why=code[0], detail=code[1]))
            insort(self._by_state, h.excluded)
            return
        if e.other is None:
            h.unknown = (rid, r)
            insort(self._unknown, h.unknown)
            return
        # Above the minimum: its place among the live, oldest first, from the minimum's
        # count on. One entering among the minimum's pushes the last of them above it.
        live, least = e.live, e.min
        age = (r.created_at, rid)
        p = bisect_left(live, age)
        live.insert(p, age)
        if p < least < len(live):
            self._regroup(e, e.reps[live[least][1]], True)
        rep = h.rep = e.reps[rid] = self._live[rid] = _Rep(r, p >= least, h.size)
        self._group_of(e.other, rep).add(rep)
        self._place(rep)

    def _let_go(self, e: _Model, h: _Held) -> None:
        """Take out a replica's entries: it stopped holding capacity, or changed in what
        it is entered by (`_hold` enters it again)."""
        r = h.r
        rid = r.id
        del e.held[rid], self._held[rid]
        rep = h.rep
        if h.excluded is not None:
            _drop(self._by_state, h.excluded)
        elif h.unknown is not None:
            _drop(self._unknown, h.unknown)
        elif rep is not None:
            assert rep.group is not None
            rep.group.remove(rep)
            self._unplace(rep)
            del e.reps[rid], self._live[rid]
            live, least = e.live, e.min
            p = bisect_left(live, (r.created_at, rid))
            del live[p]
            # One leaving the minimum's pulls the oldest above it into the minimum.
            if p < least <= len(live):
                self._regroup(e, e.reps[live[least - 1][1]], False)
        self._count(e.owner, h.size, -1)
        tree = self._tree
        assert tree is not None
        levels = tree.guaranteed_levels(e.owner)
        if levels:
            if rid in self._past:
                self._pass(rid, -self._past[rid])
            for q in levels:
                for other in self._levels[q.name].remove(h.age):
                    self._pass(other, -1)

    def _pass(self, rid: str, n: int) -> None:
        """Count `rid` past (n > 0) or back within (n < 0) the guarantee at n levels; a
        live replica whose being borrowed moved goes to the group of its new flag."""
        past = self._past
        was = past.get(rid, 0)
        now = was + n
        if now:
            past[rid] = now
        else:
            del past[rid]
        if (was > 0) == (now > 0):
            return
        if now:
            self._borrowed.add(rid)
        else:
            self._borrowed.discard(rid)
        self._frozen = None
        got = self._held.get(rid)
        if got is not None and got[1].rep is not None:
            e, h = got
            assert h.rep is not None
            self._regroup(e, h.rep, h.rep.above)

    def _regroup(self, e: _Model, rep: _Rep, above: bool) -> None:
        assert rep.group is not None and e.other is not None
        rep.group.remove(rep)
        rep.above = above
        self._group_of(e.other, rep).add(rep)

    def _group_of(self, other: catalog.Model, rep: _Rep) -> _Group:
        tree = self._tree
        assert tree is not None
        # Borrowed only matters across owners with a guarantee in play; an owner under
        # none is borrowed whatever it holds (`rules.is_borrowed`).
        if not tree.any_guarantee():
            flag = False
        elif tree.has_guarantee(other.owner):
            flag = rep.r.id in self._borrowed
        else:
            flag = True
        key = (rules.effective_class(other), other.owner, other.on_demand, rep.above, flag)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(key)
        return g

    def _place(self, rep: _Rep) -> None:
        node = rep.first_node
        if node is not None:
            on = self._nodes.setdefault(node, {})
            on[rep.r.id] = rep
            self._top(node, _summed(on))
            self._walks.moved.add(node)

    def _unplace(self, rep: _Rep) -> None:
        node = rep.first_node
        if node is not None:
            on = self._nodes.get(node)
            if on is not None:
                on.pop(rep.r.id, None)
                self._walks.moved.add(node)
                if on:
                    self._top(node, _summed(on))
                else:
                    del self._nodes[node]
                    self._top(node, None)

    def _top(self, node: str, top: tuple[int, ...] | None) -> None:
        """Set a node's `_tops` (None: it has no replica left), and its shape with it."""
        old = self._tops.get(node)
        if old == top:
            return
        if old is not None:
            same = self._shapes[old]
            del same[node]
            if not same:
                del self._shapes[old]
        if top is None:
            del self._tops[node]
        else:
            self._tops[node] = top
            self._shapes.setdefault(top, {})[node] = None

    # Quota.

    def _count(self, owner: str, a: quota.Amount, n: int) -> None:
        counts = self._amounts.get(owner)
        if counts is None:
            counts = self._amounts[owner] = {}
        left = counts.get(a, 0) + n
        if left:
            counts[a] = left
        else:
            del counts[a]
            if not counts:
                del self._amounts[owner]
        self._sums_of = None

    def usage(self, view: View, owner: str) -> dict[str, quota.Amount]:
        self.follow(view)
        held = [
            quota.Holding(replica="", owner=o, amount=a, created_at=_EPOCH)
            for o, a in self._sums().items()
        ]
        return view.quota.usage_of(owner, held)

    def _sums(self) -> dict[str, quota.Amount]:
        sums = self._sums_of
        if sums is None:
            sums = self._sums_of = {}
            for owner, counts in self._amounts.items():
                g, cpu, mem = 0, 0.0, 0.0
                for a, n in counts.items():
                    g += a.gpus * n
                    cpu += a.cpu_cores * n
                    mem += a.memory_gb * n
                sums[owner] = quota.Amount(gpus=g, cpu_cores=cpu, memory_gb=mem)
        return sums

    def borrowed(self, view: View) -> frozenset[str]:
        self.follow(view)
        if self._frozen is None:
            self._frozen = frozenset(self._borrowed)
        return self._frozen

    # Finding.

    def find(self, view: View, a: rules.Asker) -> Found:
        self.follow(view)
        return _Found(self, view, a)


_WalkEntry = tuple[float, bool, datetime, str]


class _Walks:
    """Per number of victims k (as calls ask for them), the nodes with k replicas or
    more in the order node-aware's lazy search walks them (`node_levels`), by the GPUs
    their k largest hold: by the least work k of them throw away (their loading seconds
    times GPUs, the k smallest summed), then by the k-th oldest last use among them (the
    least idle of the k longest unused; a node with fewer than k ever used last). Kept
    by the nodes whose replicas moved (`moved`): those of every model with a replica the
    view journaled since (`View.journal`: a loading time, read by every node of its
    model), and the node of each replica only used since (`View.uses`); worked out again
    when a call reads."""

    __slots__ = ("at", "by", "models", "moved", "seen")

    def __init__(self) -> None:
        self.by: dict[int, dict[int, list[_WalkEntry]]] = {}
        self.at: dict[int, dict[str, tuple[int, _WalkEntry]]] = {}
        self.moved: set[str] = set()
        # models: per model, the nodes whose entries read its replicas; seen: the counts
        # of the view's journals (`View.journal`, `View.uses`) when they were last
        # brought up to date.
        self.models: dict[str, set[str]] = {}
        self.seen: tuple[int, int] | None = None

    def stream(self, index: Index, view: View, least: int, k: int) -> Iterator[_WalkEntry]:
        journal, uses = view.journal, view.uses
        now = (journal.count, uses.count)
        if now != self.seen:
            if self.seen is not None:
                changed = journal.since(self.seen[0])
                used = uses.since(self.seen[1])
                if changed is None or used is None:
                    self.moved |= set(index._nodes)
                else:
                    replicas = view.state.replicas
                    models = self.models
                    # A change may be a loading time, which every node of its model
                    # reads; a use alone moves only the node whose entry reads it.
                    for m in {replicas[rid].model for rid in changed}:
                        self.moved |= models.get(m, set())
                    for rid in used:
                        r = replicas.get(rid)
                        if r is not None and r.nodes:
                            self.moved.add(r.nodes[0])
            self.seen = now
        if self.moved:
            self._refresh(index, view)
        if k not in self.by:
            self._build(index, view, k)
        return heapq.merge(*[got for g, got in self.by[k].items() if g >= least])

    def _build(self, index: Index, view: View, k: int) -> None:
        by: dict[int, list[_WalkEntry]] = {}
        at: dict[str, tuple[int, _WalkEntry]] = {}
        loads: dict[str, float] = {}
        for name in index._nodes:
            got = _walk_entry(index, view, loads, name, k, self.models)
            if got is not None:
                at[name] = got
                by.setdefault(got[0], []).append(got[1])
        for entries in by.values():
            entries.sort()
        self.by[k], self.at[k] = by, at

    def _refresh(self, index: Index, view: View) -> None:
        moved, self.moved = self.moved, set()
        loads: dict[str, float] = {}
        for k, at in self.at.items():
            if len(moved) * 4 > len(at):
                del self.by[k]  # built again when asked
                continue
            by = self.by[k]
            for name in moved:
                old = at.pop(name, None)
                if old is not None:
                    _drop(by[old[0]], old[1])
                got = _walk_entry(index, view, loads, name, k, self.models)
                if got is not None:
                    at[name] = got
                    insort(by.setdefault(got[0], []), got[1])
        for k in [k for k in self.at if k not in self.by]:
            del self.at[k]


def _walk_entry(
    index: Index,
    view: View,
    loads: dict[str, float],
    name: str,
    k: int,
    models: dict[str, set[str]],
) -> tuple[int, _WalkEntry] | None:
    """A node's place in the walk for k victims, by the GPUs its k largest hold; None
    with fewer than k replicas. Each replica's model notes the node in `models`."""
    on = index._nodes.get(name)
    if on is None or len(on) < k:
        return None
    took = view.load_times()
    works, used = [], []
    for rep in on.values():
        r = rep.r
        models.setdefault(r.model, set()).add(name)
        load = loads.get(r.model)
        if load is None:
            # As `node_aware.load_costs` has it, so as `node_aware.key` sums it.
            times = took.get(r.model)
            load = loads[r.model] = 0.0 if not times else max(statistics.median(times), 0.0)
        works.append(load * rep.size.gpus)
        if r.last_used_at is not None:
            used.append(r.last_used_at)
    works.sort()
    used.sort()
    least = sum(works[:k])
    if len(used) >= k:
        return index._tops[name][k], (least, False, used[k - 1], name)
    return index._tops[name][k], (least, True, _EPOCH, name)


class _Weighed:
    """One group as one call sees it: its tiers past the grace and not (or the code
    that keeps it), where the grace cuts its order, and the replicas set apart."""

    __slots__ = ("above", "code", "cut", "g", "never_past", "p", "skip", "tier_not", "tier_past")

    def __init__(self, g: _Group, a: rules.Asker) -> None:
        self.g = g
        cls, owner, on_demand, above, borrowed = g.key
        self.above = above
        self.p = p = rules.peer_by(cls, owner, on_demand, a)
        past = rules.tier_from_facts(p, True, above, borrowed, a)
        not_past = rules.tier_from_facts(p, False, above, borrowed, a)
        self.code: str | None = None
        self.tier_past = self.tier_not = 0
        self.cut = 0
        self.never_past = False
        self.skip: dict[str, tuple[str, _Rep]] = {}
        if isinstance(past, str) or isinstance(not_past, str):
            # Invariant: the grace only moves a lower class between tiers 0 and 2.
            assert past == not_past
            self.code = str(past)
            return
        self.tier_past, self.tier_not = past, not_past
        now, grace = a.now, a.cfg.eviction_grace_s
        self.never_past = grace <= 0.0
        # The used are in order of last use, the longest unused first: those past the
        # grace are a prefix.
        used = g.used
        lo, hi = 0, len(used)
        while lo < hi:
            mid = (lo + hi) // 2
            lu = used[mid].lu
            assert lu is not None
            if (now - lu).total_seconds() >= grace:
                lo = mid + 1
            else:
                hi = mid
        self.cut = lo

    def past(self, r: ReplicaRecord, a: rules.Asker) -> bool:
        idle = rules.idle_of(r, a.now)
        return (0.0 if idle is None else idle) >= a.cfg.eviction_grace_s


class _Found:
    """The index's `Found`: counts worked out at once, candidates and exclusions merged
    lazily from the groups."""

    __slots__ = (
        "_a",
        "_cands",
        "_gangs",
        "_head",
        "_index",
        "_mine",
        "_mine_ids",
        "_stream",
        "_view",
        "_weighed",
        "by_tier",
        "considered",
        "excluded_by",
        "excluded_count",
    )

    def __init__(self, index: Index, view: View, a: rules.Asker) -> None:
        self._index, self._view, self._a = index, view, a
        self._gangs = a.cfg.policy != "reference"
        models = index._models
        mine_names = [n for n in view.catalog.names_of(a.m) if n in models]
        self._mine = [h.r for n in mine_names for h in models[n].held.values()]
        self._mine_ids = {r.id for r in self._mine}
        weighed = {id(g): _Weighed(g, a) for g in index._groups.values() if g.ids}
        self._weighed = weighed
        tiers: dict[str, int] = {}
        why: dict[str, int] = {}

        def add(d: dict[str, int], k: str, n: int) -> None:
            if n:
                d[k] = d.get(k, 0) + n

        # The model's own, whatever their state.
        add(why, "same_model", len(self._mine))
        for _rid, x in index._by_state:
            if x.replica not in self._mine_ids:
                add(why, x.why, 1)
        add(why, "unknown_model", len(index._unknown))
        # Set apart in each group: its own model's, then the young, then (the
        # reference's) the multi-node.
        for n in mine_names:
            for rep in models[n].reps.values():
                assert rep.group is not None
                weighed[id(rep.group)].skip[rep.r.id] = ("same_model", rep)
        lifetime = a.cfg.min_lifetime_s
        for w in weighed.values():
            g = w.g
            if w.code is not None:
                add(why, w.code, len(g.ids) - len(w.skip))
                continue
            for item in reversed(g.ready):
                ready_at, young = item[0], item[-1]
                assert isinstance(ready_at, datetime) and isinstance(young, _Rep)
                if (a.now - ready_at).total_seconds() >= lifetime:
                    break
                if young.r.id not in w.skip:
                    w.skip[young.r.id] = ("young", young)
            if not self._gangs:
                for rid, spread in g.multi.items():
                    if rid not in w.skip:
                        w.skip[rid] = ("multi_node", spread)
            n_past = w.cut + (len(g.never) if w.never_past else 0)
            n_not = len(g.ids) - n_past
            for code, rep in w.skip.values():
                if code != "same_model":
                    add(why, code, 1)
                if w.past(rep.r, a):
                    n_past -= 1
                else:
                    n_not -= 1
            add(tiers, str(w.tier_past), n_past)
            add(tiers, str(w.tier_not), n_not)
        self.by_tier = dict(sorted(tiers.items()))
        self.excluded_by = dict(sorted(why.items()))
        self.considered = sum(tiers.values())
        self.excluded_count = sum(why.values())
        self._cands: list[Candidate] = []
        self._stream: Iterator[Candidate] | None = None
        self._head = 0

    @property
    def has_gangs(self) -> bool:
        if not self._gangs:
            return False
        return any(
            rid not in w.skip for w in self._weighed.values() if w.code is None for rid in w.g.multi
        )

    # Candidates.

    def _candidate(self, w: _Weighed, rep: _Rep, tier: int) -> Candidate:
        a, r, p, size = self._a, rep.r, w.p, rep.size
        if rep.node is None:
            nodes = tuple(r.nodes)
            return Candidate(
                r.id, r.model, p.cls, p.owner, tier, rep.above, rules.idle_of(r, a.now),
                size.gpus, size.cpu_cores, size.memory_gb, nodes[0], w.g.borrowed, nodes,
            )  # fmt: skip
        return Candidate(
            r.id, r.model, p.cls, p.owner, tier, rep.above, rules.idle_of(r, a.now),
            size.gpus, size.cpu_cores, size.memory_gb, rep.node, w.g.borrowed,
        )  # fmt: skip

    def _part(
        self, w: _Weighed, tier: int, lo: int, hi: int, never: bool
    ) -> Iterator[tuple[tuple[int, float, int, float, str], _Weighed, _Rep, int]]:
        """One group's candidates of one tier, in order: its used from `lo` to `hi` (in
        order of last use), merged with those never reported used when `never`."""
        now, skip, used = self._a.now, w.skip, w.g.used

        def of_used() -> Iterator[tuple[tuple[int, float, int, float, str], _Weighed, _Rep, int]]:
            for i in range(lo, hi):
                rep = used[i]
                r = rep.r
                if r.id in skip:
                    continue
                assert r.last_used_at is not None
                idle = (now - r.last_used_at).total_seconds()
                yield (tier, -(idle or 0.0), rep.size.gpus, rep.size.memory_gb, r.id), w, rep, tier

        def of_never() -> Iterator[tuple[tuple[int, float, int, float, str], _Weighed, _Rep, int]]:
            for rep in w.g.never:
                if rep.r.id in skip:
                    continue
                yield (tier, -0.0, rep.size.gpus, rep.size.memory_gb, rep.r.id), w, rep, tier

        if not never or not w.g.never:
            return of_used()
        if lo >= hi:
            return of_never()
        return heapq.merge(of_used(), of_never(), key=_first)

    def _ordered(self) -> Iterator[Candidate]:
        parts = []
        for w in self._weighed.values():
            if w.code is not None:
                continue
            n = len(w.g.used)
            if w.tier_past == w.tier_not:
                parts.append(self._part(w, w.tier_past, 0, n, True))
                continue
            parts.append(self._part(w, w.tier_past, 0, w.cut, w.never_past))
            parts.append(self._part(w, w.tier_not, w.cut, n, not w.never_past))
        for _key, w, rep, tier in heapq.merge(*parts, key=_first):
            yield self._candidate(w, rep, tier)

    def first(self, n: int) -> tuple[Candidate, ...]:
        if self._stream is None:
            self._stream = self._ordered()
        while len(self._cands) < n:
            got = next(self._stream, None)
            if got is None:
                break
            self._cands.append(got)
        return tuple(self._cands[:n])

    def every(self) -> tuple[Candidate, ...]:
        return self.first(self.considered)

    def _passing(self, view: View, least: int, max_victims: int) -> list[tuple[str, NodeUsage]]:
        """The schedulable nodes with replicas where at most `max_victims` of them could
        leave `least` GPUs free, in no set order: a bound on what its candidates could
        free, since no `max_victims` of them free more than as many of its replicas,
        largest first (`_tops`)."""
        inv, index = view.inventory, self._index
        usage_of, tops = inv.usage, index._tops
        out = []
        for top, names in index._shapes.items():
            if top[min(max_victims, len(top) - 1)] >= least:
                for name in names:
                    u = usage_of(name)
                    if u is not None and u.schedulable:
                        out.append((name, u))
        # A node of a shape that falls short passes only with free GPUs to make it up.
        for name in inv.with_free():
            held = tops.get(name)
            if held is None:
                continue
            bound = held[min(max_victims, len(held) - 1)]
            if bound >= least:
                continue  # listed above
            u = usage_of(name)
            if u is not None and u.schedulable and len(u.free) + bound >= least:
                out.append((name, u))
        return out

    def _on(self, name: str) -> list[tuple[_Weighed, _Rep, int]]:
        """The candidates on node `name` (a gang on its first), as (its group as weighed,
        the replica, its tier), in no set order."""
        a, weighed = self._a, self._weighed
        out = []
        for rep in self._index._nodes[name].values():
            w = weighed.get(id(rep.group))
            if w is None or w.code is not None or rep.r.id in w.skip:
                continue
            if w.tier_past == w.tier_not:
                out.append((w, rep, w.tier_past))
            else:
                out.append((w, rep, w.tier_past if w.past(rep.r, a) else w.tier_not))
        return out

    def by_node(
        self, view: View, least: int, max_victims: int
    ) -> list[tuple[str, list[Candidate]]]:
        out = []
        for name, _u in sorted(self._passing(view, least, max_victims)):
            mine = self.candidates_of(self._on(name))
            if mine:
                out.append((name, mine))
        return out

    def candidates_of(self, on: list[tuple[_Weighed, _Rep, int]]) -> list[Candidate]:
        """`_on`'s candidates as `Candidate`s, in order."""
        mine = [self._candidate(w, rep, tier) for w, rep, tier in on]
        if len(mine) > 1:
            mine.sort(key=rules.order_key)
        return mine

    def lazily(self, view: View) -> Source | None:
        return _Slots(self) if self._index.lazy else None

    def gangs_lazily(self, view: View) -> gang_levels.Source | None:
        return _GangSlots(self) if self._index.lazy_gangs and self._gangs else None

    # Exclusions.

    def excluded_first(self, n: int) -> tuple[Exclusion, ...]:
        return tuple(x for _rid, x in itertools.islice(self._exclusions(), n))

    def _exclusions(self) -> Iterator[tuple[str, Exclusion]]:
        mine_ids, index = self._mine_ids, self._index
        name = WHY["same_model"]
        own = sorted(
            (r.id, Exclusion(replica=r.id, model=r.model, why="same_model", detail=name))
            for r in self._mine
        )
        unknown = WHY["unknown_model"]
        sources: list[Iterator[tuple[str, Exclusion]]] = [
            iter(own),
            (x for x in index._by_state if x[0] not in mine_ids),
            (
                (rid, Exclusion(replica=rid, model=r.model, why="unknown_model", detail=unknown))
                for rid, r in index._unknown
            ),
        ]
        for w in self._weighed.values():
            if w.code is not None:
                sources.append(self._excluded_group(w))
            else:
                set_apart = sorted(
                    (rid, code) for rid, (code, _) in w.skip.items() if code != "same_model"
                )
                if set_apart:
                    sources.append(self._set_apart(w, set_apart))
        return heapq.merge(*sources, key=_first)

    def _excluded_group(self, w: _Weighed) -> Iterator[tuple[str, Exclusion]]:
        code, skip, a = w.code, w.skip, self._a
        assert code is not None
        for rid, rep in w.g.ids:
            if rid in skip:
                continue
            why = rules.detail(code, rep.r, w.p, a, w.above)
            yield rid, Exclusion(replica=rid, model=rep.r.model, why=code, detail=why)

    def _set_apart(
        self, w: _Weighed, items: list[tuple[str, str]]
    ) -> Iterator[tuple[str, Exclusion]]:
        a = self._a
        for rid, code in items:
            rep = w.skip[rid][1]
            why = rules.detail(code, rep.r, w.p, a, w.above)
            yield rid, Exclusion(replica=rid, model=rep.r.model, why=code, detail=why)


class _Slots:
    """The index's candidates per node for node-aware's lazy search: a node's tiers and
    GPUs from its replicas' groups, its `Candidate`s made only when a level reaches it."""

    __slots__ = ("_found", "_view")
    spec = None

    def __init__(self, found: _Found) -> None:
        self._found = found
        self._view = found._view

    def tiers(self) -> list[int]:
        return sorted(int(t) for t in self._found.by_tier)

    def loose(self) -> list[Slot]:
        nodes = self._found._index._nodes
        out = []
        for name in self._view.inventory.with_free():
            if name in nodes:
                got = self.slot(name)
                if got is not None:
                    out.append(got)
        return out

    def walk(self, least: int, k: int) -> Iterator[tuple[float, float, str]]:
        found = self._found
        now = found._a.now
        for work, never, last, name in found._index._walks.stream(
            found._index, self._view, least, k
        ):
            yield work, 0.0 if never else max((now - last).total_seconds(), 0.0), name

    def slot(self, name: str) -> Slot | None:
        found = self._found
        u = self._view.inventory.usage(name)
        reps = found._index._nodes.get(name)
        if u is None or not u.schedulable or reps is None:
            return None
        weighed = found._weighed
        now, grace = found._a.now, found._a.cfg.eviction_grace_s
        # `_on`, with each candidate's tier and GPUs listed as it is found.
        on: list[tuple[_Weighed, _Rep, int]] = []
        tiers, gpus = [], []
        for rep in reps.values():
            w = weighed.get(id(rep.group))
            if w is None or w.code is not None or rep.r.id in w.skip:
                continue
            tier = w.tier_past
            if tier != w.tier_not:
                lu = rep.r.last_used_at
                if (0.0 if lu is None else (now - lu).total_seconds()) < grace:
                    tier = w.tier_not
            on.append((w, rep, tier))
            tiers.append(tier)
            gpus.append(rep.size.gpus)
        return Slot(name, u, tiers, gpus, on) if on else None

    def candidates(self, slot: Slot) -> list[Candidate]:
        return self._found.candidates_of(slot.data)  # type: ignore[arg-type]


class _GangSlots:
    """The index's candidates for the lazy gang search: those of one tier from the
    groups' orders cut at the grace, those on given nodes from the replicas per node and
    the gangs per node (read once a call needs them)."""

    __slots__ = ("_found", "_spread")
    spec = None

    def __init__(self, found: _Found) -> None:
        self._found = found
        self._spread: dict[str, list[tuple[_Weighed, _Rep]]] | None = None

    def tiers(self) -> list[int]:
        return sorted(int(t) for t in self._found.by_tier)

    def of_tier(self, t: int) -> list[tuple[gang_levels.Order, str, object]]:
        found = self._found
        parts = []
        for w in found._weighed.values():
            if w.code is not None:
                continue
            n = len(w.g.used)
            if w.tier_past == w.tier_not:
                if w.tier_past == t:
                    parts.append(found._part(w, t, 0, n, True))
                continue
            if w.tier_past == t:
                parts.append(found._part(w, t, 0, w.cut, w.never_past))
            if w.tier_not == t:
                parts.append(found._part(w, t, w.cut, n, not w.never_past))
        return [(key, rep.r.model, (w, rep, tier)) for part in parts for key, w, rep, tier in part]

    def candidate(self, made_from: object) -> Candidate:
        item: tuple[_Weighed, _Rep, int] = made_from  # type: ignore[assignment]
        return self._found._candidate(*item)

    def on(self, names: Sequence[str]) -> list[Candidate]:
        found = self._found
        spread = self._spread
        if spread is None:
            spread = self._spread = {}
        a, nodes = found._a, found._index._nodes
        on: dict[str, tuple[_Weighed, _Rep, int]] = {}
        for name in names:
            if name in nodes:
                for item in found._on(name):
                    on[item[1].r.id] = item
            gangs = spread.get(name)
            if gangs is None:
                gangs = spread[name] = self._gangs_on(name)
            for w, rep in gangs:
                if rep.r.id not in on:
                    tier = w.tier_past
                    if tier != w.tier_not and not w.past(rep.r, a):
                        tier = w.tier_not
                    on[rep.r.id] = (w, rep, tier)
        return found.candidates_of(list(on.values()))

    def _gangs_on(self, name: str) -> list[tuple[_Weighed, _Rep]]:
        """The candidates that are gangs with a shard on node `name`, with their groups
        as weighed (`_on` has a gang on its first node only)."""
        found = self._found
        weighed = found._weighed
        out = []
        for rep in _GangNodes.of(found._index, found._view).get(name, ()):
            w = weighed.get(id(rep.group))
            if w is not None and w.code is None and rep.r.id not in w.skip:
                out.append((w, rep))
        return out

    def every(self) -> Sequence[Candidate]:
        return self._found.every()


class _GangNodes:
    """Per node, the index's live multi-node replicas with a shard on it, whatever the
    model asking: kept while what `Index.follow` brings the groups up to date from
    stays (the view, its quota tree, the catalog's version, the count of the view's
    journal) and the groups are those it was read from (built again from the start,
    `_reset`, they are a new dict). A later use alone (`View.uses`) moves no replica
    between nodes or in or out of the groups."""

    __slots__ = ("by_node", "count", "groups", "tree", "version", "view")

    def __init__(self, index: Index, view: View, by_node: dict[str, list[_Rep]]) -> None:
        self.view, self.tree, self.groups = view, view.quota, index._groups
        self.version, self.count = view.catalog.version, view.journal.count
        self.by_node = by_node

    @staticmethod
    def of(index: Index, view: View) -> dict[str, list[_Rep]]:
        got = index._gang_nodes
        if (
            got is not None
            and got.view is view
            and got.tree is view.quota
            and got.groups is index._groups
            and got.version == view.catalog.version
            and got.count == view.journal.count
        ):
            return got.by_node
        by_node: dict[str, list[_Rep]] = {}
        for g in index._groups.values():
            for rep in g.multi.values():
                for n in rep.r.nodes:
                    by_node.setdefault(n, []).append(rep)
        index._gang_nodes = _GangNodes(index, view, by_node)
        return by_node


def _first(item: tuple[Any, ...]) -> Any:
    return item[0]


class Checked:
    """An engine that asks both the plain walk and `fast` on every call and raises
    `PolicyMismatch` with one line on the first difference."""

    __slots__ = ("fast",)

    def __init__(self, fast: Candidates) -> None:
        self.fast = fast

    def follow(self, view: View) -> None:
        self.fast.follow(view)

    def usage(self, view: View, owner: str) -> dict[str, quota.Amount]:
        got, want = self.fast.usage(view, owner), PLAIN.usage(view, owner)
        if not _same_usage(got, want):
            raise PolicyMismatch(
                f"policy check: usage of {owner} is {got!r} by the index, {want!r} by the plain walk"
            )
        return want

    def borrowed(self, view: View) -> frozenset[str]:
        got, want = self.fast.borrowed(view), PLAIN.borrowed(view)
        if got != want:
            raise PolicyMismatch(
                f"policy check: borrowed differ by {sorted(got ^ want)[:5]} between the index "
                "and the plain walk"
            )
        return want

    def find(self, view: View, a: rules.Asker) -> Found:
        got = self.fast.find(view, a)
        want = PLAIN.find(view, a)
        assert isinstance(want, Listing)
        g_c, g_x = got.every(), got.excluded_first(got.excluded_count)
        problem = _difference(a, (g_c, g_x), (want.cands, want.excluded))
        if problem is None:
            for what, x, y in (
                ("by_tier", got.by_tier, want.by_tier),
                ("excluded_by", got.excluded_by, want.excluded_by),
                ("considered", got.considered, want.considered),
                ("excluded_count", got.excluded_count, want.excluded_count),
                ("has_gangs", got.has_gangs, want.has_gangs),
            ):
                if x != y:
                    problem = f"policy check: for {a.m.name}, {what} is {x!r} by the index, {y!r} by the plain walk"
                    break
        if problem is not None:
            raise PolicyMismatch(problem)
        return _CheckedFound(got, want, a)


class _CheckedFound:
    """The plain walk's `Found`, its nodes compared with the index's on every call."""

    __slots__ = ("_a", "_fast", "_want")

    def __init__(self, fast: Found, want: Listing, a: rules.Asker) -> None:
        self._fast, self._want, self._a = fast, want, a

    considered = property(lambda self: self._want.considered)
    by_tier = property(lambda self: self._want.by_tier)
    excluded_count = property(lambda self: self._want.excluded_count)
    excluded_by = property(lambda self: self._want.excluded_by)
    has_gangs = property(lambda self: self._want.has_gangs)

    def first(self, n: int) -> tuple[Candidate, ...]:
        return self._want.first(n)

    def excluded_first(self, n: int) -> tuple[Exclusion, ...]:
        return self._want.excluded_first(n)

    def every(self) -> tuple[Candidate, ...]:
        return self._want.every()

    def by_node(
        self, view: View, least: int, max_victims: int
    ) -> list[tuple[str, list[Candidate]]]:
        def kept(per: list[tuple[str, list[Candidate]]]) -> list[tuple[str, list[Candidate]]]:
            out = []
            for name, cs in per:
                u = view.inventory.usage(name)
                if u is None or not u.schedulable:
                    continue
                if could_free(len(u.free), [c.gpus for c in cs], least, max_victims):
                    out.append((name, cs))
            return out

        want = self._want.by_node(view, least, max_victims)
        got = self._fast.by_node(view, least, max_victims)
        if kept(got) != kept(want):
            raise PolicyMismatch(
                f"policy check: for {self._a.m.name}, the nodes that could make room differ "
                "between the index and the plain walk"
            )
        return want

    def lazily(self, view: View) -> Source | None:
        got = self._fast.lazily(view)
        if got is None:
            return None
        # The lazy search over the index's nodes, the spec's over the plain walk's beside it.
        return _SpecBeside(got, lambda least, mv: self.by_node(view, least, mv))

    def gangs_lazily(self, view: View) -> gang_levels.Source | None:
        got = self._fast.gangs_lazily(view)
        if got is None:
            return None
        # The lazy gang search over the index's candidates, the spec's over the plain
        # walk's every candidate beside it.
        return _GangsBeside(got, self._want.every)


class _SpecBeside:
    """A `Source` whose search is checked against the spec's over `by_node`'s nodes."""

    __slots__ = ("_fast", "spec")

    def __init__(
        self, fast: Source, by_node: Callable[[int, int], list[tuple[str, list[Candidate]]]]
    ) -> None:
        self._fast, self.spec = fast, by_node

    def tiers(self) -> list[int]:
        return self._fast.tiers()

    def loose(self) -> list[Slot]:
        return self._fast.loose()

    def walk(self, least: int, k: int) -> Iterator[tuple[float, float, str]]:
        return self._fast.walk(least, k)

    def slot(self, name: str) -> Slot | None:
        return self._fast.slot(name)

    def candidates(self, slot: Slot) -> list[Candidate]:
        return self._fast.candidates(slot)


class _GangsBeside:
    """A gang `Source` whose search is checked against the spec's over `every`."""

    __slots__ = ("_fast", "spec")

    def __init__(self, fast: gang_levels.Source, every: Callable[[], Sequence[Candidate]]) -> None:
        self._fast, self.spec = fast, every

    def tiers(self) -> list[int]:
        return self._fast.tiers()

    def of_tier(self, t: int) -> list[tuple[gang_levels.Order, str, object]]:
        return self._fast.of_tier(t)

    def candidate(self, made_from: object) -> Candidate:
        return self._fast.candidate(made_from)

    def on(self, names: Sequence[str]) -> list[Candidate]:
        return self._fast.on(names)

    def every(self) -> Sequence[Candidate]:
        return self._fast.every()


def _same_usage(got: Mapping[str, quota.Amount], want: Mapping[str, quota.Amount]) -> bool:
    if got.keys() != want.keys():
        return False
    for k, x in got.items():
        y = want[k]
        if (
            x.gpus != y.gpus
            or abs(x.cpu_cores - y.cpu_cores) > quota.EPSILON
            or abs(x.memory_gb - y.memory_gb) > quota.EPSILON
        ):
            return False
    return True


def _difference(
    a: rules.Asker,
    got: tuple[tuple[Candidate, ...], tuple[Exclusion, ...]],
    want: tuple[tuple[Candidate, ...], tuple[Exclusion, ...]],
) -> str | None:
    for what, g, w in (("candidate", got[0], want[0]), ("exclusion", got[1], want[1])):
        for i, (x, y) in enumerate(zip(g, w, strict=False)):
            if x != y:
                return f"policy check: for {a.m.name} at {a.now.isoformat()}, {what} {i} is {x!r} by the index, {y!r} by the plain walk"
        if len(g) != len(w):
            return f"policy check: for {a.m.name} at {a.now.isoformat()}, {len(g)} {what}s by the index, {len(w)} by the plain walk"
    return None


def from_env(env: Mapping[str, str]) -> Candidates:
    """The engine the switches in `env` (the shell's environment) ask for."""
    return engine(
        enabled=env.get(INDEX_ENV, "1") != "0",
        check=env.get(CHECK_ENV, "") == "1",
        lazy=env.get(LAZY_ENV, "1") != "0",
        lazy_gangs=env.get(LAZY_GANGS_ENV, "1") != "0",
    )


def engine(
    enabled: bool = True, check: bool = False, lazy: bool = True, lazy_gangs: bool = True
) -> Candidates:
    """The engine a caller owns: a new `Index`, or the plain walk when not `enabled` (the
    switch); wrapped in `Checked` when `check` (the shells pass `LLMGW_POLICY_CHECK=1`).
    `lazy` is the index's node-aware search (`Index.lazy`), `lazy_gangs` its gang
    search (`Index.lazy_gangs`)."""
    got: Candidates = Index(lazy=lazy, lazy_gangs=lazy_gangs) if enabled else PLAIN
    return Checked(got) if check else got


__all__ = [
    "CHECK_ENV",
    "INDEX_ENV",
    "LAZY_ENV",
    "LAZY_GANGS_ENV",
    "Checked",
    "Index",
    "PolicyMismatch",
    "engine",
]
