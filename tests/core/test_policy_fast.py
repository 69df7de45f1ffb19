"""The policy's shortcuts against the plain computation, over random clusters.

`Decision.to_event_data(shown=...)` converts only what a published event lists; the
oracle counts sets before it builds any group; the node-aware search orders a level by
the work thrown away and works out the whole key only for ties; a trial of one-shard
profiles looks only at the victims' nodes. Each is checked here against the computation
it stands for, on views folded from random logs and on the same views rebuilt from a
snapshot (whose replicas come in another order).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.core import catalog
from services.core import policy as spec
from services.core.policy import Candidate, Config, node_aware, plan
from services.core.policy.trials import Trials
from services.core.reaction import bounded
from services.core.view import View, decode_state, encode_state
from services.sim import oracle
from tests.core.policy_helpers import first_fit
from tests.scenario import Scenario

CLASSES = ("opportunistic", "standard", "critical")


def build(rng: random.Random) -> tuple[Scenario, list[str]]:
    """A random cluster: nodes of 8 GPUs, models of every class (some on several nodes),
    owners with and without guarantees, and replicas in every state the rules read:
    young, never used, used after now, retiring, preempted, draining, drained for
    placement_timeout (stopped or not), failed, equal creation times; replicas of one
    profile in two shapes."""
    s = Scenario()
    nodes = [f"n{i}" for i in range(rng.randint(1, 6))]
    for n in nodes:
        s.node(n, "8xH100-80GB")
    owners = ["o0", "o1", "o2"]
    if rng.random() < 0.7:
        s.quota({o: {"gpus": rng.choice([0, 2, 4, 8, 16])} for o in owners})
    models = []
    wide = []
    size: dict[str, int] = {}
    for i in range(rng.randint(2, 8)):
        name = f"m{i}"
        models.append(name)
        gpus = size[name] = rng.choice([1, 1, 2, 4])
        profiles = [f"p{gpus}:{gpus}"]
        if rng.random() < 0.3:
            profiles.append("wide:2:2")
            wide.append(name)
        s.model(
            name,
            cls=rng.choice(CLASSES),
            min=rng.choice([0, 0, 1, 2, 3]),
            max=12,
            profiles=profiles,
            owner=rng.choice(owners),
        )
    free = {n: list(range(8)) for n in nodes}
    for r in range(rng.randint(0, 40)):
        model = rng.choice(models)
        rid = f"r{rng.randrange(1000):03d}-{r}"
        created = f"-{rng.choice([1, 2, 2, 3, 5])}h"
        ready = rng.choice(["-4h", "-50m", "-90s", "-1s"])
        used = rng.choice([None, None, "-2h", "-20m", "-1m", "+5m"])
        if model in wide and rng.random() < 0.3 and len(nodes) > 1:
            a, b = rng.sample(nodes, 2)
            if not free[a] or not free[b]:
                continue
            on = [(a, [free[a].pop()]), (b, [free[b].pop()])]
            s.replica(rid, model, on=on, profile="wide", created=created, ready=ready)
            continue
        node = rng.choice(nodes)
        # Now and then more GPUs than the profile asks (declared again with another
        # size since): the same profile in two shapes.
        gpus = size[model] + (rng.random() < 0.1)
        if len(free[node]) < gpus:
            continue
        taken = [free[node].pop() for _ in range(gpus)]
        state = rng.choice(["ready"] * 6 + ["loading", "pending", "draining"])
        s.replica(
            rid,
            model,
            on=(node, taken),
            state=state,
            created=created,
            ready=ready,
            used=used if state in ("ready", "draining") else None,
        )
        roll = rng.random()
        if roll < 0.06:
            s.drain(rid, "scale_down")
        elif roll < 0.12:
            s.drain(rid, "preempted", for_model=rng.choice(models))
        elif roll < 0.18:
            # Given up on by the scheduler: still current, and once stopped, holding nothing.
            s.drain(rid, "placement_timeout")
            if rng.random() < 0.5:
                s.state(rid, "stopped")
        elif roll < 0.21:
            s.state(rid, "failed")
    return s, models


def filled(rng: random.Random, share: float) -> tuple[Scenario, list[str]]:
    """`build`, with about `share` of the GPUs left free taken by idle replicas of a
    filler model: most models then do not fit, and trials have victims on several nodes
    to try."""
    s, models = build(rng)
    s.model("filler", cls="opportunistic", min=0, profiles=["f1:1"], owner="o0")
    free = s.view().inventory
    for n in free.names():
        for g in free.free_gpus(n):
            if rng.random() < share:
                s.replica(f"fill-{n}-{g}", "filler", on=(n, [g]), ready="-3h", used="-1h")
    return s, models


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["reference", "node-aware"]))
def test_a_published_decision_lists_what_the_cut_keeps(seed: int, policy: str) -> None:
    s, models = build(random.Random(seed))
    v = View(decode_state(encode_state(s.view().state)))
    for name in models:
        d = plan(v, name, s.now, Config(policy=policy))  # type: ignore[arg-type]
        whole = d.to_event_data("t")
        assert whole.considered == len(whole.candidates) == len(d.candidates)
        assert sum(whole.by_tier.values()) == whole.considered
        assert whole.by_tier == {
            str(t): sum(c.tier == t for c in d.candidates)
            for t in sorted({c.tier for c in d.candidates})
        }
        assert sum(whole.excluded_by.values()) == whole.excluded_count == len(d.excluded)
        assert d.to_event_data("t", SHOWN_ALL) == whole
        victims = {v.replica for v in whole.victims}
        for shown in (0, 1, 3):
            # The first `shown`, then every victim past them (`preemption.listed`).
            listed = whole.candidates[:shown] + tuple(
                c for c in whole.candidates[shown:] if c.replica in victims
            )
            cut = msgspec.structs.replace(whole, candidates=listed, excluded=whole.excluded[:shown])
            assert d.to_event_data("t", shown) == cut
        assert bounded(whole) == bounded(d.to_event_data("t", 50))


SHOWN_ALL = 10_000


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(0, 60), st.integers(1, 3))
def test_the_oracle_answers_none_exactly_past_its_limit(seed: int, limit: int, k: int) -> None:
    s, models = build(random.Random(seed))
    v = s.view()
    for name in models:
        d = plan(v, name, s.now, Config(max_victims=k))
        m = v.catalog[name]
        profiles = [p for p in m.profiles if p.name in d.profiles]
        by_node: dict[str, int] = {}
        for c in d.candidates:
            by_node[c.node] = by_node.get(c.node, 0) + 1
        groups = list(by_node.values())
        if any(p.shards > 1 for p in profiles):
            groups = [len(d.candidates)]
        over = sum(oracle.sets(n, k) for n in groups) > limit
        assert (oracle.exists(v, d, k, limit) is None) == over


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_level_is_tried_in_key_order(seed: int) -> None:
    """`first_fit` (node-aware's `_first_of`) tries one level's sets in the order of their whole keys,
    and stops at the same set, as sorting them all by `node_aware.key` would."""
    rng = random.Random(seed)
    models = [f"m{i}" for i in range(rng.randint(1, 4))]
    # Equal loads and unknown ones (0), so that many sets tie on the work thrown away.
    load_s = {m: rng.choice([0.0, 30.0, 30.0, 90.5]) for m in models if rng.random() < 0.8}
    cands = [
        Candidate(
            f"r{i:02d}",
            rng.choice(models),
            "standard",
            "o0",
            2,
            True,
            rng.choice([None, None, 5.0, 600.0, -3.0]),
            rng.choice([1, 2]),
            8.0,
            rng.choice([40.0, 80.0]),
            "n0",
            False,
        )
        for i in range(rng.randint(1, 7))
    ]
    level = list(itertools.combinations(cands, rng.randint(1, 3)))
    rng.shuffle(level)
    fitting = {vs for vs in level if rng.random() < 0.3}

    def trying(tried: list[Sequence[Candidate]]) -> Callable[[Sequence[Candidate]], bool]:
        def fits(vs: Sequence[Candidate]) -> bool:
            tried.append(vs)
            return vs in fitting

        return fits

    fast_tried: list[Sequence[Candidate]] = []
    fast = first_fit(level, load_s, trying(fast_tried))
    plain_tried: list[Sequence[Candidate]] = []
    fits = trying(plain_tried)
    found = next(
        (vs for vs in sorted(level, key=lambda vs: node_aware.key(vs, load_s)) if fits(vs)), ()
    )
    assert fast == found
    assert fast_tried == plain_tried


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["reference", "node-aware"]), st.integers(1, 4))
def test_trials_on_the_victims_nodes_decide_as_trials_on_every_node(
    seed: int, policy: str, k: int
) -> None:
    """The dry run's shortcut: with every profile of one shard a trial looks only at the
    victims' nodes (`place`'s `within`). Decisions, trials and placements are what a
    look at every node gives."""
    rng = random.Random(seed)
    s, models = filled(rng, 0.8)
    v = s.view()
    cfg = Config(policy=policy, max_victims=k)  # type: ignore[arg-type]
    fast = [plan(v, name, s.now, cfg) for name in models]
    within = spec.Trials

    class Everywhere(within):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            self.one_shard = False

    spec.Trials = Everywhere  # type: ignore[misc]
    try:
        plain_decisions = [plan(v, name, s.now, cfg) for name in models]
    finally:
        spec.Trials = within  # type: ignore[misc]
    assert fast == plain_decisions


def _never_kept(view: View) -> dict[object, object]:
    """`preemption.placements` keeping nothing: every placement worked out afresh."""
    return {}


def two_kinds(rng: random.Random) -> tuple[View, tuple[Candidate, ...]]:
    """`filled`, with a node of L4 GPUs (other model, other memory) full of idle filler
    replicas: which GPUs qualify for a profile differs from node to node. With the
    candidates of the first node-aware decision that has any (none when none has)."""
    s, models = filled(rng, rng.choice([0.5, 0.8, 1.0]))
    s.node("l0", "4xL4-24GB")
    for g in range(4):
        s.replica(f"fill-l0-{g}", "filler", on=("l0", [g]), ready="-3h", used="-1h")
    view = s.view()
    decided = [plan(view, m, s.now, Config(policy="node-aware")) for m in models]
    return view, next((d.candidates for d in decided if d.candidates), ())


def eager_search(
    view: View,
    profiles: Sequence[catalog.Profile],
    cands: Sequence[Candidate],
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
) -> Sequence[Candidate]:
    """`node_aware.search` of one-shard profiles as first written: each level's sets all
    made and checked on their node before any is ordered."""
    needs = [node_aware.Need(p) for p in profiles if p.shards == 1 and p.gpus >= 0]
    least = min((n.gpus for n in needs), default=0)
    per_node = node_aware.grouped(cands)
    nodes = node_aware._on_nodes(view, per_node, needs, least, max_victims) if needs else []
    for t in sorted({c.tier for c in cands}):
        for k in range(1, max_victims + 1):
            level_sets = [
                tuple([node.cands[i] for i in chosen])
                for node in nodes
                for chosen in itertools.combinations(
                    [i for i, c in enumerate(node.cands) if c.tier <= t], k
                )
                if any(node.cands[i].tier == t for i in chosen) and node.fits(needs, chosen)
            ]
            if level_sets:
                load_s = node_aware.load_costs(view, {v.model for vs in level_sets for v in vs})
                best = first_fit(level_sets, load_s, fits)
                if best:
                    return best
    return ()


def test_a_level_s_sets_are_checked_on_their_node_only_as_far_as_the_one_taken() -> None:
    """The node-aware search orders a level's sets by the work they throw away before it
    asks whether they free enough on their node, and asks only up to the set taken: the
    same set, and the same dry runs in the same order, as when every set of the level is
    checked on its node first (`eager_search`). On clusters of two kinds of GPU, for
    profiles of every shape (as `..._per_kind_of_need_...`), under every cap."""
    searched = 0
    for seed in range(40):
        rng = random.Random(seed)
        view, cands = two_kinds(rng)
        if not cands:
            continue
        for _ in range(6):
            profiles = [
                catalog.Profile(
                    name=f"s{i}",
                    gpus=rng.choice([1, 2, 4, 8]),
                    gpu_memory_gb=rng.choice([0.0, 24.0, 80.0]),
                    gpu_model=rng.choice([None, "H100", "L4"]),
                    cpu_cores=rng.choice([0.0, 8.0, 5000.0]),
                    memory_gb=rng.choice([0.0, 64.0]),
                )
                for i in range(rng.randint(1, 2))
            ]
            k = rng.randint(1, 3)
            runs: list[list[tuple[str, ...]]] = []
            found = []
            for lazy in (True, False):
                trials = Trials(view, profiles, ())
                tried: list[tuple[str, ...]] = []

                def fits(
                    vs: Sequence[Candidate],
                    trials: Trials = trials,
                    tried: list[tuple[str, ...]] = tried,
                ) -> bool:
                    tried.append(tuple(v.replica for v in vs))
                    return bool(trials.fits_without(vs))

                if lazy:
                    found.append(node_aware.search(view, profiles, cands, k, fits, list))
                else:
                    found.append(eager_search(view, profiles, cands, k, fits))
                runs.append(tried)
            assert found[0] == found[1], seed
            assert runs[0] == runs[1], seed
            searched += 1
    assert searched > 100
