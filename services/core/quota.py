"""Quota math: amounts of capacity, the owner tree, guarantees, borrowing and limits.

Called by the scheduler (is a placement within its owner's limits?), by the preemption
policy (which replicas are borrowed past a guarantee, and may an owner reclaim?) and by
the fold, which rebuilds the tree from each `quota.set`. Pure functions over plain
data: no I/O, no clock (a holding's age is its `created_at`, given by the caller).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import msgspec

# EPSILON absorbs float rounding in CPU and memory sums. Without it 0.1 + 0.2 cores
# would not fit within 0.3, and a replica would be called borrowed by a rounding error.
EPSILON = 1e-9


class Amount(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A quantity of capacity in GPUs, CPU cores and memory."""

    gpus: int = 0
    cpu_cores: float = 0.0
    memory_gb: float = 0.0

    def plus(self, other: Amount) -> Amount:
        return Amount(
            gpus=self.gpus + other.gpus,
            cpu_cores=self.cpu_cores + other.cpu_cores,
            memory_gb=self.memory_gb + other.memory_gb,
        )

    def minus(self, other: Amount) -> Amount:
        return Amount(
            gpus=self.gpus - other.gpus,
            cpu_cores=self.cpu_cores - other.cpu_cores,
            memory_gb=self.memory_gb - other.memory_gb,
        )

    def scaled(self, n: int) -> Amount:
        return Amount(
            gpus=self.gpus * n, cpu_cores=self.cpu_cores * n, memory_gb=self.memory_gb * n
        )

    def fits_within(self, other: Amount) -> bool:
        """Whether every dimension is at most the other's.

        A zero dimension in `other` admits nothing of that dimension: a guarantee of
        {gpus: 4} does not cover a replica that also asks for CPU cores.
        """
        return (
            self.gpus <= other.gpus
            and self.cpu_cores <= other.cpu_cores + EPSILON
            and self.memory_gb <= other.memory_gb + EPSILON
        )

    def any(self) -> bool:
        """Whether any dimension is non-zero."""
        return self.gpus != 0 or self.cpu_cores != 0 or self.memory_gb != 0


ZERO = Amount()


class Quota(msgspec.Struct, frozen=True, kw_only=True):
    """One owner's place in the tree: its parent, what it is promised, what it may not pass.

    `limit` None means no limit at this level; a zero `guarantee` means no promise.
    """

    name: str
    parent: str | None = None
    guarantee: Amount = ZERO
    limit: Amount | None = None


class Holding(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What one live replica holds, charged to its model's owner."""

    replica: str
    owner: str
    amount: Amount
    created_at: datetime


def _counted_age(item: tuple[Holding, tuple[Quota, ...]]) -> tuple[datetime, str]:
    h = item[0]
    return (h.created_at, h.replica)


class QuotaTree:
    """The owners of `quota.set`, with each owner's chain up to its root.

    Immutable once built: a new `quota.set` builds a new tree. An owner not in the tree
    stands alone, with no guarantee and no limit. A parent that is not declared is taken
    as such a standalone owner, so usage still rolls up to it.

    Invariant: every chain is finite. A parent cycle ends the chain at the first owner
    seen twice and is listed in `errors`; a cycle must never hang the fold.
    """

    __slots__ = ("_any_guarantee", "_chains", "_guaranteed", "_quotas", "errors", "limited")

    def __init__(self, quotas: Iterable[Quota] = ()) -> None:
        self._quotas: dict[str, Quota] = {}
        problems: list[str] = []
        for q in quotas:
            if q.name in self._quotas:
                problems.append(f"quota {q.name}: declared twice; the last one counts")
            self._quotas[q.name] = q
        self._chains: dict[str, tuple[Quota, ...]] = {}
        for name in self._quotas:
            self._chains[name] = self._walk(name, problems)
        # Each declared owner's guaranteed levels, nearest first: what borrowed and
        # guaranteed walk for every replica, worked out once per tree.
        self._guaranteed: dict[str, tuple[Quota, ...]] = {
            name: tuple(q for q in chain if q.guarantee.any())
            for name, chain in self._chains.items()
        }
        self._any_guarantee = any(q.guarantee.any() for q in self._quotas.values())
        # limited: whether any quota has a limit; without one, `within_limit` holds for
        # every owner and need, and nobody need sum usage to ask it.
        self.limited = any(q.limit is not None for q in self._quotas.values())
        self.errors: tuple[str, ...] = tuple(dict.fromkeys(problems))

    def _walk(self, name: str, problems: list[str]) -> tuple[Quota, ...]:
        chain: list[Quota] = []
        seen: set[str] = set()
        current: str | None = name
        while current is not None:
            if current in seen:
                cycle = sorted(seen)
                problems.append(f"quota {name}: parent cycle through {', '.join(cycle)}")
                break
            seen.add(current)
            q = self._quotas.get(current)
            if q is None:
                problems.append(f"quota {chain[-1].name}: parent {current} is not declared")
                q = Quota(name=current)
            chain.append(q)
            current = q.parent
        return tuple(chain)

    def __contains__(self, owner: object) -> bool:
        return owner in self._quotas

    def __len__(self) -> int:
        return len(self._quotas)

    def quotas(self) -> tuple[Quota, ...]:
        """The declared quotas, in the order they were given."""
        return tuple(self._quotas.values())

    def quota(self, owner: str) -> Quota | None:
        return self._quotas.get(owner)

    def governing(self, owner: str) -> list[Quota]:
        """The owner's quota and each ancestor's, nearest first."""
        chain = self._chains.get(owner)
        if chain is None:
            return [Quota(name=owner)]
        return list(chain)

    def usage(self, holdings: Iterable[Holding]) -> dict[str, Amount]:
        """Per owner, what its replicas hold plus what its descendants' hold.

        Every declared owner appears, at ZERO when it holds nothing; an undeclared owner
        appears only when it holds something.
        """
        return self._usage(holdings, None)

    def usage_of(self, owner: str, holdings: Iterable[Holding]) -> dict[str, Amount]:
        """`usage`, for the owner's chain only: all that `within_limit` and `guaranteed`
        read for that owner, the same figures without summing everyone else's."""
        return self._usage(holdings, frozenset(q.name for q in self._chain(owner)))

    def _usage(self, holdings: Iterable[Holding], only: frozenset[str] | None) -> dict[str, Amount]:
        # Plain running sums, added in the holdings' order as Amount.plus would add
        # them, so the figures are the same to the last bit.
        sums: dict[str, list[Any] | None] = {
            name: None for name in self._quotas if only is None or name in only
        }
        chains = self._chains
        for h in holdings:
            chain = chains.get(h.owner)
            if chain is None:
                chain = (Quota(name=h.owner),)
            a = h.amount
            for q in chain:
                name = q.name
                if only is not None and name not in only:
                    continue
                acc = sums.get(name)
                if acc is None:
                    acc = sums[name] = [ZERO.gpus, ZERO.cpu_cores, ZERO.memory_gb]
                acc[0] += a.gpus
                acc[1] += a.cpu_cores
                acc[2] += a.memory_gb
        return {
            name: ZERO if acc is None else Amount(gpus=acc[0], cpu_cores=acc[1], memory_gb=acc[2])
            for name, acc in sums.items()
        }

    def any_guarantee(self) -> bool:
        """Whether any declared owner has a guarantee."""
        return self._any_guarantee

    def borrowed(self, holdings: Iterable[Holding]) -> set[str]:
        """The replicas held past a guarantee.

        At each guaranteed level, the replicas of that level's subtree are counted oldest
        first (created_at, then replica id); a replica is within the level while the
        running sum through it fits within the guarantee, and past it from then on.
        A replica is covered only if it is within every guaranteed level of its chain;
        one whose chain has no guaranteed level is borrowed. Oldest first, because the
        replica that arrived last is the one that took room past the promise.
        """
        out: set[str] = set()
        # Only replicas under a guaranteed level are counted; the sort is stable, so
        # each level sees its members in the same order as in a sort of them all.
        counted: list[tuple[Holding, tuple[Quota, ...]]] = []
        guaranteed = self._guaranteed
        for h in holdings:
            levels = guaranteed.get(h.owner, ())
            if levels:
                counted.append((h, levels))
            else:
                out.add(h.replica)
        if not counted:
            return out
        counted.sort(key=_counted_age)
        running: dict[str, list[Any]] = {}
        for h, levels in counted:
            a = h.amount
            for q in levels:
                acc = running.get(q.name)
                if acc is None:
                    acc = running[q.name] = [ZERO.gpus, ZERO.cpu_cores, ZERO.memory_gb]
                acc[0] += a.gpus
                acc[1] += a.cpu_cores
                acc[2] += a.memory_gb
                g = q.guarantee
                if not (
                    acc[0] <= g.gpus
                    and acc[1] <= g.cpu_cores + EPSILON
                    and acc[2] <= g.memory_gb + EPSILON
                ):
                    out.add(h.replica)
        return out

    def guaranteed(self, owner: str, usage: Mapping[str, Amount], need: Amount) -> bool:
        """Whether `need` more for this owner stays within its guarantees.

        True only when the owner has at least one guaranteed level and usage plus need
        fits within the guarantee at every guaranteed level of its chain.
        """
        levels = self._guaranteed.get(owner, ())
        if not levels:
            return False
        return all(usage.get(q.name, ZERO).plus(need).fits_within(q.guarantee) for q in levels)

    def guaranteed_levels(self, owner: str) -> tuple[Quota, ...]:
        """The owner's guaranteed levels, nearest first: those whose running sums
        `borrowed` counts its replicas in (none for an owner not in the tree)."""
        return self._guaranteed.get(owner, ())

    def has_guarantee(self, owner: str) -> bool:
        """Whether the owner has a guarantee anywhere up its tree."""
        return bool(self._guaranteed.get(owner, ()))

    def within_limit(self, owner: str, usage: Mapping[str, Amount], need: Amount) -> bool:
        """Whether usage plus `need` fits within the limit at every limited level.

        No limit anywhere up the tree means no limit. A placement past a limit fails
        with reason quota_limit, and preemption does not run for it.
        """
        for q in self._chain(owner):
            if q.limit is not None and not usage.get(q.name, ZERO).plus(need).fits_within(q.limit):
                return False
        return True

    def _chain(self, owner: str) -> tuple[Quota, ...]:
        chain = self._chains.get(owner)
        if chain is None:
            return (Quota(name=owner),)
        return chain
