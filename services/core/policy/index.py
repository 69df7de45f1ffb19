"""The fast engine: what the plain walk works out per model, kept between calls by its owner.

Owned by its caller (the preemption service's leader, the simulator's engine), never by
`View` or a module: one `Index` follows one view, and whoever folds that view asks with
it. Behind the same protocol as the plain walk (`engine.Candidates`), held to it by a
differential test (tests/core/test_policy_index.py) and, with `LLMGW_POLICY_CHECK=1`, on
every call of the preemption service and `llmgw simulate` (`checked`).

What it keeps, per model name its replicas give: the replicas holding capacity, those
excluded by their own state (retiring, already preempted, draining) as exclusions, and
the live ones newest first with whether each is above its model's minimum, the node it
is on and what stopping it frees. None of that reads the model to place, the time or the
quota usage; each model's entry is worked out again once the view says one of its
replicas changed (`View.version`) or its name resolves to another declaration. What
reads them (the tiers, idleness, youth, the guarantees) is the rules' own, on every call.
It moves the cost of a call from every replica's state, sizes and nodes to its tier
rules alone (bench_policy: "engine" against "plain").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.core import catalog, quota
from services.core.policy import rules
from services.core.policy.config import WHY
from services.core.policy.decision import Candidate, Exclusion
from services.core.policy.engine import PLAIN, Candidates
from services.core.view import ReplicaRecord, View, size_of

# CHECK_ENV names the switch that runs the plain walk beside the index on every call and
# stops on the first difference (`Checked`); the shells read it, core reads no environment.
CHECK_ENV = "LLMGW_POLICY_CHECK"
# INDEX_ENV names the switch that turns the index off (`LLMGW_POLICY_INDEX=0`): the
# shells then decide with the plain walk.
INDEX_ENV = "LLMGW_POLICY_INDEX"


@dataclass(frozen=True, slots=True)
class _Model:
    """One model name's replicas, as far as no asker and no moment decides."""

    version: int
    other: catalog.Model | None
    holding: tuple[ReplicaRecord, ...]
    by_state: tuple[Exclusion, ...]
    live: tuple[tuple[ReplicaRecord, bool, str | None, quota.Amount | None], ...]
    """Newest first: the replica, above its minimum, its node (None: several), its size."""


def _model(view: View, name: str, other: catalog.Model | None) -> _Model:
    holding = tuple([r for r in view.current_of(name) if r.holds_capacity])
    by_state: list[Exclusion] = []
    live: list[ReplicaRecord] = []
    for r in holding:
        code = rules.excluded_by_state(r, ())
        if code is None:
            live.append(r)
        else:
            by_state.append(Exclusion(replica=r.id, model=name, why=code[0], detail=code[1]))
    placed = [(r, False) for r in live] if other is None else rules.above_minimum(live, other.min)
    return _Model(
        view.version(name),
        other,
        holding,
        tuple(by_state),
        tuple([(r, above, rules.where(r), size_of(view, r)) for r, above in placed]),
    )


class Index:
    """The candidates of `rules.candidates`, from per-model entries kept current as the
    view folds (see the module's docstring). Follows one view: asked about another, it
    starts again."""

    __slots__ = ("_models", "_view")

    def __init__(self) -> None:
        self._view: View | None = None
        self._models: dict[str, _Model] = {}

    def follow(self, view: View) -> None:
        """Bring the entries up to date with `view`: those of names no longer current
        go, those whose replicas changed or whose declaration did are worked out again."""
        if view is not self._view:
            self._view, self._models = view, {}
        models = self._models
        current = view.current_models()
        for name in [n for n in models if n not in current]:
            del models[name]
        resolve, version = view.catalog.resolve, view.version
        for name in current:
            got = models.get(name)
            other = resolve(name)
            if got is None or got.version != version(name) or got.other is not other:
                models[name] = _model(view, name, other)

    def candidates(
        self, view: View, a: rules.Asker
    ) -> tuple[tuple[Candidate, ...], tuple[Exclusion, ...]]:
        self.follow(view)
        mine = view.catalog.names_of(a.m)
        out: list[Candidate] = []
        excluded: list[Exclusion] = []
        for name, e in self._models.items():
            if name in mine:
                same = WHY["same_model"]
                excluded += [
                    Exclusion(replica=r.id, model=name, why="same_model", detail=same)
                    for r in e.holding
                ]
                continue
            excluded += e.by_state
            if e.other is None:
                unknown = WHY["unknown_model"]
                excluded += [
                    Exclusion(replica=r.id, model=name, why="unknown_model", detail=unknown)
                    for r, *_ in e.live
                ]
                continue
            _weigh(e, rules.peer_of(e.other, a), a, out, excluded)
        out.sort(key=rules.order_key)
        excluded.sort(key=rules.exclusion_key)
        return tuple(out), tuple(excluded)


def _weigh(
    e: _Model, p: rules.Peer, a: rules.Asker, out: list[Candidate], excluded: list[Exclusion]
) -> None:
    """`rules.weigh_model` on a kept entry: the same rules, with the nodes and sizes kept."""
    for r, above, node, size in e.live:
        got = rules.verdict(p, r, above, a)
        if not isinstance(got, str) and node is None:
            got = "multi_node"
        if isinstance(got, str):
            why = rules.detail(got, r, p, a, above)
            excluded.append(Exclusion(replica=r.id, model=r.model, why=got, detail=why))
        else:
            # Invariant: a replica on one node has its node and size kept.
            assert node is not None and size is not None
            out.append(rules.candidate(p, r, above, a, got, node, size))


class PolicyMismatch(Exception):
    """The index and the plain walk disagreed (`LLMGW_POLICY_CHECK=1`)."""


class Checked:
    """An engine that asks both the plain walk and `fast` on every call and raises
    `PolicyMismatch` with one line on the first difference."""

    __slots__ = ("fast",)

    def __init__(self, fast: Candidates) -> None:
        self.fast = fast

    def candidates(
        self, view: View, a: rules.Asker
    ) -> tuple[tuple[Candidate, ...], tuple[Exclusion, ...]]:
        got = self.fast.candidates(view, a)
        want = rules.candidates(view, a)
        if got != want:
            raise PolicyMismatch(_difference(a, got, want))
        return got


def _difference(
    a: rules.Asker,
    got: tuple[tuple[Candidate, ...], tuple[Exclusion, ...]],
    want: tuple[tuple[Candidate, ...], tuple[Exclusion, ...]],
) -> str:
    for what, g, w in (("candidate", got[0], want[0]), ("exclusion", got[1], want[1])):
        for i, (x, y) in enumerate(zip(g, w, strict=False)):
            if x != y:
                return f"policy check: for {a.m.name} at {a.now.isoformat()}, {what} {i} is {x!r} by the index, {y!r} by the plain walk"
        if len(g) != len(w):
            return f"policy check: for {a.m.name} at {a.now.isoformat()}, {len(g)} {what}s by the index, {len(w)} by the plain walk"
    return f"policy check: for {a.m.name}, the index and the plain walk differ"


def from_env(env: Mapping[str, str]) -> Candidates:
    """The engine the switches in `env` (the shell's environment) ask for."""
    return engine(enabled=env.get(INDEX_ENV, "1") != "0", check=env.get(CHECK_ENV, "") == "1")


def engine(enabled: bool = True, check: bool = False) -> Candidates:
    """The engine a caller owns: a new `Index`, or the plain walk when not `enabled` (the
    switch); wrapped in `Checked` when `check` (the shells pass `LLMGW_POLICY_CHECK=1`)."""
    got: Candidates = Index() if enabled else PLAIN
    return Checked(got) if check else got
