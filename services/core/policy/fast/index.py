"""The fast engine's index: the plain engine's candidates from groups of replicas kept
in order.

Owned by its caller (the preemption service's leader, the simulator's engine), never by
`View` or a module: one `Index` (as `fast.Fast`) follows one view, and whoever folds that
view asks with it. Behind the same protocol as the plain engine (`engine.Engine`), held to it by a
differential test (tests/core/test_policy_index.py) and, under the checked engine
(`--policy-engine checked`), on every call of the preemption service and `llmgw simulate`.

Why it can be fast: every rule that decides a replica's tier reads of it only whether it
is above its model's minimum and whether it is borrowed (both known as the view folds),
how long it has gone unused and how long it has been ready (both compared with one
threshold per call); the rest is its model's class, owner and on-demand flag. So the
live replicas are kept in groups (`entries.Group`) of one (class, owner, on-demand, above
minimum, borrowed), each kept sorted by last use (the order key after the tier) and by
readiness. A call weighs each group once (`rules.tier_from_facts`, for "past the grace" and
not), cuts it at the grace and at the minimum lifetime by bisection, and merges the
groups' streams by the order key, building only the candidates it is asked for: the
first for the decision's list and the reference's search, those on the nodes node-aware's
lazy walk reaches (`slots.Slots`). The counts by tier and by exclusion come from the
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

from bisect import bisect_left, insort

from services.core import catalog, quota
from services.core.policy import rules
from services.core.policy.decision import Exclusion
from services.core.policy.fast.entries import (
    EPOCH,
    Group,
    Held,
    Level,
    ModelEntry,
    Rep,
    drop,
    signature,
    summed,
)
from services.core.policy.fast.found import IndexFound
from services.core.policy.fast.walks import GangNodes, Walks
from services.core.view import ReplicaRecord, View, size_of


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
        "_sums_of",
        "_tops",
        "_tree",
        "_unknown",
        "_uses",
        "_view",
        "_walks",
    )

    def __init__(self) -> None:
        # _gang_nodes: the gangs per node, as the lazy gang search last read them.
        self._gang_nodes: GangNodes | None = None
        self._view: View | None = None
        self._tree: quota.QuotaTree | None = None
        self._reset()

    def _reset(self) -> None:
        self._catalog_version = -1
        self._changes = self._uses = -1
        self._models: dict[str, ModelEntry] = {}
        self._held: dict[str, tuple[ModelEntry, Held]] = {}
        self._live: dict[str, Rep] = {}
        self._groups: dict[tuple[str, str, bool, bool, bool], Group] = {}
        self._by_state: list[tuple[str, Exclusion]] = []
        self._unknown: list[tuple[str, ReplicaRecord]] = []
        self._nodes: dict[str, dict[str, Rep]] = {}
        # _tops: per node, the GPUs of its replicas' largest first, summed (entry i: the
        # i largest): what at most i of them could free there.
        self._tops: dict[str, tuple[int, ...]] = {}
        self._walks = Walks()
        # _amounts: per owner, how many of its replicas hold each amount; _sums_of: what
        # they sum to, None while a change has not been summed.
        self._amounts: dict[str, dict[quota.Amount, int]] = {}
        self._sums_of: dict[str, quota.Amount] | None = {}
        # _levels: per guaranteed quota level (by name), its members; _past: per replica,
        # at how many of its levels it is past the guarantee; _borrowed: those past one.
        self._levels: dict[str, Level] = {}
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
            if r.holds_capacity and h.sig == signature(r):
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
            e = self._models[name] = ModelEntry(name, view.catalog.resolve(name))
        h = Held(r, size_of(view, r))
        rid = r.id
        e.held[rid] = h
        self._held[rid] = (e, h)
        self._count(e.owner, h.size, 1)
        tree = self._tree
        assert tree is not None
        for q in tree.guaranteed_levels(e.owner):
            level = self._levels.get(q.name)
            if level is None:
                level = self._levels[q.name] = Level(q.guarantee)
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
        rep = h.rep = e.reps[rid] = self._live[rid] = Rep(r, p >= least, h.size)
        self._group_of(e.other, rep).add(rep)
        self._place(rep)

    def _let_go(self, e: ModelEntry, h: Held) -> None:
        """Take out a replica's entries: it stopped holding capacity, or changed in what
        it is entered by (`_hold` enters it again)."""
        r = h.r
        rid = r.id
        del e.held[rid], self._held[rid]
        rep = h.rep
        if h.excluded is not None:
            drop(self._by_state, h.excluded)
        elif h.unknown is not None:
            drop(self._unknown, h.unknown)
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

    def _regroup(self, e: ModelEntry, rep: Rep, above: bool) -> None:
        assert rep.group is not None and e.other is not None
        rep.group.remove(rep)
        rep.above = above
        self._group_of(e.other, rep).add(rep)

    def _group_of(self, other: catalog.Model, rep: Rep) -> Group:
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
            g = self._groups[key] = Group(key)
        return g

    def _place(self, rep: Rep) -> None:
        node = rep.first_node
        if node is not None:
            on = self._nodes.setdefault(node, {})
            on[rep.r.id] = rep
            self._top(node, summed(on))
            self._walks.moved.add(node)

    def _unplace(self, rep: Rep) -> None:
        node = rep.first_node
        if node is not None:
            on = self._nodes.get(node)
            if on is not None:
                on.pop(rep.r.id, None)
                self._walks.moved.add(node)
                if on:
                    self._top(node, summed(on))
                else:
                    del self._nodes[node]
                    self._top(node, None)

    def _top(self, node: str, top: tuple[int, ...] | None) -> None:
        """Set a node's `_tops` (None: it has no replica left)."""
        if top is None:
            self._tops.pop(node, None)
        else:
            self._tops[node] = top

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
            quota.Holding(replica="", owner=o, amount=a, created_at=EPOCH)
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

    def find(self, view: View, a: rules.Asker) -> IndexFound:
        self.follow(view)
        return IndexFound(self, view, a)
