"""The checked engine: an engine and the spec side by side on every call, stopping with
one line (`PolicyMismatch`) on the first difference.

`Checked(engine)` asks both the same questions: the usage, who is borrowed, every
candidate and exclusion with their counts (`find`), each set tried on both dry runs,
the engine's and the spec's (`CheckedTrials`: the same answer, the same placement), and
the sets node-aware's and the gang search take. A search's sets are tried on the dry run
one at a time and the first that fits is taken, so two searches agree when they try the
same sets in the same order and take the same one: the engine's search runs first,
through the real dry run (`Tried.recorded`); the spec's then runs with `replayed`,
which answers each set from the record and stops on the first set out of order; `agreed`
checks both took the same. The answers given are the spec's. No I/O.

What an operator runs when a decision looks wrong (`--policy-engine checked`), and what
the differential tests hold the fast engine to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.core import catalog, quota
from services.core.errors import PolicyMismatch
from services.core.policy import rules
from services.core.policy.decision import Candidate, Exclusion
from services.core.policy.engine import PLAIN, Engine, Found, Listing
from services.core.policy.plain_sets import Fits
from services.core.policy.trials import Trials
from services.core.view import View

__all__ = ["Checked", "CheckedTrials", "PolicyMismatch", "Tried"]


class Checked:
    """An engine that asks both `engine` and the spec (`PLAIN`) on every call, answers
    with the spec's, and raises `PolicyMismatch` with one line on the first difference."""

    __slots__ = ("engine",)
    name = "checked"

    def __init__(self, engine: Engine[Any, Any]) -> None:
        self.engine = engine

    def follow(self, view: View) -> None:
        self.engine.follow(view)

    def usage(self, view: View, owner: str) -> dict[str, quota.Amount]:
        got, want = self.engine.usage(view, owner), PLAIN.usage(view, owner)
        if not _same_usage(got, want):
            raise PolicyMismatch(
                f"policy check: usage of {owner} is {got!r} by the {self.engine.name} engine, "
                f"{want!r} by the spec"
            )
        return want

    def borrowed(self, view: View) -> frozenset[str]:
        got, want = self.engine.borrowed(view), PLAIN.borrowed(view)
        if got != want:
            raise PolicyMismatch(
                f"policy check: borrowed differ by {sorted(got ^ want)[:5]} between the "
                f"{self.engine.name} engine and the spec"
            )
        return want

    def find(self, view: View, a: rules.Asker) -> Both:
        got = self.engine.find(view, a)
        want = PLAIN.find(view, a)
        problem = _difference(a, self.engine.name, got, want)
        if problem is not None:
            raise PolicyMismatch(problem)
        return Both(got, want)

    def trials(
        self, view: View, profiles: Sequence[catalog.Profile], avoid: tuple[str, ...]
    ) -> CheckedTrials:
        return CheckedTrials(
            self.engine.trials(view, profiles, avoid), PLAIN.trials(view, profiles, avoid)
        )

    def node_set(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        found: Both,
        max_victims: int,
        fits: Fits,
        fallback: Callable[[], Sequence[Candidate]],
    ) -> Sequence[Candidate]:
        check = Tried(fits, "node-aware", self.engine.name)
        mine = self.engine.node_set
        got = mine(view, profiles, found.got, max_victims, check.recorded, fallback)
        want = PLAIN.node_set(view, profiles, found.want, max_victims, check.replayed, fallback)
        check.agreed(got, want, whole=False)
        return want

    def gang_set(
        self,
        view: View,
        profiles: Sequence[catalog.Profile],
        found: Both,
        max_victims: int,
        fits: Fits,
        tr: CheckedTrials,
    ) -> Sequence[Candidate]:
        check = Tried(fits, "the gang search", self.engine.name)
        mine = self.engine.gang_set
        got = mine(view, profiles, found.got, max_victims, check.recorded, tr.engine_trials)
        want = PLAIN.gang_set(view, profiles, found.want, max_victims, check.replayed, tr.spec)
        check.agreed(got, want, whole=True)
        return want


class Both:
    """The checked engine's `Found`: the spec's answers, the engine's kept beside them
    for its searches."""

    __slots__ = ("got", "want")

    def __init__(self, got: Found, want: Listing) -> None:
        self.got, self.want = got, want

    @property
    def considered(self) -> int:
        return self.want.considered

    @property
    def by_tier(self) -> dict[str, int]:
        return self.want.by_tier

    @property
    def excluded_count(self) -> int:
        return self.want.excluded_count

    @property
    def excluded_by(self) -> dict[str, int]:
        return self.want.excluded_by

    @property
    def has_gangs(self) -> bool:
        return self.want.has_gangs

    def first(self, n: int) -> tuple[Candidate, ...]:
        return self.want.first(n)

    def excluded_first(self, n: int) -> tuple[Exclusion, ...]:
        return self.want.excluded_first(n)

    def every(self) -> tuple[Candidate, ...]:
        return self.want.every()


class CheckedTrials(Trials):
    """Each set tried on the engine's dry run and on the spec's: the same answer and
    the same placement, or `PolicyMismatch`. The spec's trials are the decision's."""

    __slots__ = ("engine_trials", "spec")

    def __init__(self, engine: Trials, spec: Trials) -> None:
        super().__init__(spec.view, spec.profiles, spec.avoid)
        self.engine_trials, self.spec = engine, spec
        self.trials = spec.trials

    def fits_without(self, gone: Sequence[Candidate], pruning: bool = False) -> bool:
        self.engine_trials.fits_without(gone, pruning)
        want = self.spec.fits_without(gone, pruning)
        if self.engine_trials.trials[-1] != self.spec.trials[-1]:
            raise PolicyMismatch(
                f"policy check: trying {[v.replica for v in gone]}, the engine's dry run "
                f"gives {self.engine_trials.trials[-1]!r}, the spec's {self.spec.trials[-1]!r}"
            )
        return want

    def beside(self) -> Trials:
        return CheckedTrials(self.engine_trials.beside(), self.spec.beside())


class Tried:
    """One check of a search: what the engine's tried (`recorded`), replayed to the
    spec's (`replayed`), and whether both took the same set (`agreed`)."""

    __slots__ = ("at", "engine", "fits", "tried", "what")

    def __init__(self, fits: Callable[[Sequence[Candidate]], bool], what: str, engine: str) -> None:
        self.fits, self.what, self.engine = fits, what, engine
        self.tried: list[tuple[tuple[str, ...], bool]] = []
        self.at = 0

    def recorded(self, vs: Sequence[Candidate]) -> bool:
        ok = self.fits(vs)
        self.tried.append((tuple([v.replica for v in vs]), ok))
        return ok

    def replayed(self, vs: Sequence[Candidate]) -> bool:
        ids, at, tried = tuple([v.replica for v in vs]), self.at, self.tried
        if at >= len(tried) or tried[at][0] != ids:
            theirs = tried[at][0] if at < len(tried) else "nothing"
            raise PolicyMismatch(
                f"policy check: {self.what}'s set {at} tried is {ids} by the spec, {theirs} by "
                f"the {self.engine} engine"
            )
        self.at += 1
        return tried[at][1]

    def agreed(self, got: Sequence[Candidate], want: Sequence[Candidate], whole: bool) -> None:
        """Raise unless the spec replayed every set and took what the engine's search took
        (`whole`: every field of each victim alike, not only the ids)."""
        same = (
            list(got) == list(want)
            if whole
            else [v.replica for v in got] == [v.replica for v in want]
        )
        if self.at != len(self.tried) or not same:
            raise PolicyMismatch(
                f"policy check: {self.what} takes {[v.replica for v in want]} after {self.at} "
                f"sets by the spec, {[v.replica for v in got]} after {len(self.tried)} by the "
                f"{self.engine} engine"
            )


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


def _difference(a: rules.Asker, name: str, got: Found, want: Listing) -> str | None:
    """The first difference between the engine's `Found` and the spec's, in one line;
    None when there is none."""
    at = f"for {a.m.name} at {a.now.isoformat()}"
    pairs: tuple[tuple[str, Sequence[object], Sequence[object]], ...] = (
        ("candidate", got.every(), want.cands),
        ("exclusion", got.excluded_first(got.excluded_count), want.excluded),
    )
    for what, g, w in pairs:
        for i, (x, y) in enumerate(zip(g, w, strict=False)):
            if x != y:
                return f"policy check: {at}, {what} {i} is {x!r} by the {name} engine, {y!r} by the spec"
        if len(g) != len(w):
            return (
                f"policy check: {at}, {len(g)} {what}s by the {name} engine, {len(w)} by the spec"
            )
    counted: tuple[tuple[str, object, object], ...] = (
        ("by_tier", got.by_tier, want.by_tier),
        ("excluded_by", got.excluded_by, want.excluded_by),
        ("considered", got.considered, want.considered),
        ("excluded_count", got.excluded_count, want.excluded_count),
        ("has_gangs", got.has_gangs, want.has_gangs),
    )
    for what, x, y in counted:
        if x != y:
            return f"policy check: {at}, {what} is {x!r} by the {name} engine, {y!r} by the spec"
    return None
