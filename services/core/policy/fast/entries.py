"""What the fast engine's index keeps per replica, per model, per group and per
guaranteed quota level (`index.Index` keeps them current as the view folds; see its
docstring for why they are what a decision needs).

`Rep` is a live replica as its group keeps it, `Group` the live replicas of one (class,
owner, on-demand, above minimum, borrowed) in the order key's order, `Held` a replica
holding capacity, `ModelEntry` a model name's replicas holding capacity, `Level` one
guaranteed quota level's members and running sums. No I/O, no clock.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Mapping
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

from services.core import catalog, quota
from services.core.policy import rules
from services.core.policy.decision import Exclusion
from services.core.view import ReplicaRecord

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Rep:
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
        self.group: Group | None = None
        # Where it comes in its group's `used` (by `lu`, its last use as the order was
        # made, then `tie`: `_USED`) or `never` (by `tie`: `_NEVER`), the order key after
        # the tier.
        self.tie = (size.gpus, size.memory_gb, r.id)
        self.lu = r.last_used_at
        self.key_ready = None if r.ready_at is None else (r.ready_at, r.id, self)
        self.key_ids = (r.id, self)


_USED = attrgetter("lu", "tie")
_NEVER = attrgetter("tie")


class Group:
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
        self.order: dict[Rep, None] = {}
        self.last: Rep | None = None
        # pending: used ones whose place is before `last`, merged in by `settle`.
        self.pending: dict[Rep, None] = {}
        self.listed: list[Rep] | None = []
        self.never: list[Rep] = []
        self.ready: list[tuple[object, ...]] = []
        self.ids: list[tuple[str, Rep]] = []
        self.multi: dict[str, Rep] = {}

    @property
    def used(self) -> list[Rep]:
        got = self.listed
        if got is None:
            self.settle()
            got = self.listed = list(self.order)
        return got

    def add(self, x: Rep) -> None:
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

    def remove(self, x: Rep) -> None:
        if x.used:
            self._take(x)
        else:
            _unsort(self.never, x)
        if x.key_ready is not None:
            drop(self.ready, x.key_ready)
        drop(self.ids, x.key_ids)
        self.multi.pop(x.r.id, None)
        x.group = None

    def used_again(self, x: Rep) -> None:
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

    def _put(self, x: Rep) -> None:
        last = self.last
        if last is None or _before(last, x):
            self.order[x] = None
            self.last = x
        else:
            self.pending[x] = None
        self.listed = None

    def _take(self, x: Rep) -> None:
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


def _before(x: Rep, y: Rep) -> bool:
    """Whether `x` comes before `y` in a `used` order (`_USED`)."""
    a, b = x.lu, y.lu
    assert a is not None and b is not None
    return a < b or (a == b and x.tie < y.tie)


def _unsort(items: list[Rep], x: Rep) -> None:
    """Take `x` out of a `never` list (in `_NEVER` order)."""
    i = bisect_left(items, x.tie, key=_NEVER)
    assert items[i] is x  # invariant: kept in its list at its key
    del items[i]


def summed(on: Mapping[str, Rep]) -> tuple[int, ...]:
    sizes = sorted((rep.size.gpus for rep in on.values()), reverse=True)
    return (0, *itertools.accumulate(sizes))


def drop(items: list[Any], key: Any) -> None:
    i = bisect_left(items, key)
    assert items[i] is key or items[i] == key  # invariant: kept keys are in their list
    del items[i]


def signature(r: ReplicaRecord) -> tuple[object, ...]:
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


class Held:
    """One replica holding capacity, as its model's entry keeps it: what it holds, and
    its entry in one of the lists (excluded by its state, of a model not in the catalog,
    or live in a group)."""

    __slots__ = ("age", "excluded", "r", "rep", "sig", "size", "unknown")

    def __init__(self, r: ReplicaRecord, size: quota.Amount) -> None:
        self.r, self.size, self.sig = r, size, signature(r)
        # age: the order quota counts holdings in (`QuotaTree.borrowed`), with the amount.
        self.age = (r.created_at, r.id, size)
        self.excluded: tuple[str, Exclusion] | None = None
        self.unknown: tuple[str, ReplicaRecord] | None = None
        self.rep: Rep | None = None


class ModelEntry:
    """One model name's replicas holding capacity (`View.current_of`), as kept: each
    one's entry, and its live ones oldest first (by creation, then id), the minimum's
    first (`rules.above_minimum`: the newest are the ones above it)."""

    __slots__ = ("held", "live", "min", "name", "other", "owner", "reps")

    def __init__(self, name: str, other: catalog.Model | None) -> None:
        self.name, self.other = name, other
        self.owner = other.owner if other is not None else "default"
        self.min = other.min if other is not None else 0
        self.held: dict[str, Held] = {}
        self.reps: dict[str, Rep] = {}
        self.live: list[tuple[datetime, str]] = []


class Level:
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
