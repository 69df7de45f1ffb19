"""The oracle beside a plain reference: every set of 1 to `max_victims` of each group's
candidates, each placed on a fresh clone of the inventory with every node looked at.

On random clusters (H100 and L4 nodes, replicas of one shard and of two, some nodes
cordoned), for decisions of the policy itself and for made-up ones (any candidates, in
any order, profiles of one shard and of several, with and without `avoid`, some that
fit as the cluster stands), the oracle gives the reference's answer, None included.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from datetime import UTC, datetime

import msgspec
import pytest

from schemas import events as ev
from services.core import placement
from services.core.policy import Candidate, Config, Decision, plan
from services.core.view import View
from services.sim import oracle
from tests.scenario import Scenario


def reference_exists(
    view: View, d: Decision, max_victims: int, limit: int = oracle.LIMIT
) -> bool | None:
    """The oracle as first written: every set tried, each on a clone of its own."""
    m = view.catalog.resolve(d.model)
    if m is None:
        return False
    profiles = [p for p in m.profiles if p.name in d.profiles]
    groups: list[tuple[Candidate, ...]]
    if all(p.shards == 1 for p in profiles):
        per_node = Counter(c.node for c in d.candidates)
        if sum(oracle.sets(n, max_victims) for n in per_node.values()) > limit:
            return None
        groups = [tuple(c for c in d.candidates if c.node == n) for n in per_node]
    else:
        groups = [d.candidates]
        if oracle.sets(len(d.candidates), max_victims) > limit:
            return None
    least = min((p.gpus for p in profiles), default=0)
    for g in groups:
        if len(groups) > 1:
            free = len(view.inventory.free_gpus(g[0].node))
            most = sorted((c.gpus for c in g), reverse=True)[:max_victims]
            if free < least and free + sum(most) < least:
                continue
        for k in range(1, min(len(g), max_victims) + 1):
            for chosen in itertools.combinations(g, k):
                inv = view.inventory.clone()
                for c in chosen:
                    inv.release_replica(c.replica)
                if isinstance(placement.place(inv, profiles, d.avoid), placement.Placement):
                    return True
    return False


NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)


def cluster(rng: random.Random) -> tuple[Scenario, list[str]]:
    s = Scenario(NOW)
    nodes = [f"n{i}" for i in range(rng.randint(1, 7))]
    kinds = {}
    for n in nodes:
        kinds[n] = rng.choice(["8xH100-80GB", "8xH100-80GB", "4xL4-24GB"])
        s.node(n, kinds[n], cpu=rng.choice([32, 96]), memory=rng.choice([256, 1024]))
    models = []
    for i in range(rng.randint(2, 6)):
        name = f"m{i}"
        models.append(name)
        gpus = rng.choice([1, 1, 2, 4, 8])
        profiles: list[str | ev.ProfileSpec] = [
            ev.ProfileSpec(
                name=f"p{gpus}",
                gpus=gpus,
                gpu_model=rng.choice([None, None, "H100", "L4"]),
                cpu_cores=rng.choice([0.0, 4.0, 16.0]),
                memory_gb=rng.choice([0.0, 64.0, 200.0]),
            )
        ]
        if rng.random() < 0.3:
            profiles.append(f"wide:{rng.choice([1, 2])}:2")
        s.model(
            name, cls=rng.choice(["opportunistic", "standard"]), min=0, max=50, profiles=profiles
        )
    free = {n: list(range(8 if kinds[n].startswith("8") else 4)) for n in nodes}
    for r in range(rng.randint(0, 40)):
        model = rng.choice(models)
        rid = f"r{r:02d}"
        if rng.random() < 0.15 and len(nodes) > 1:
            a, b = rng.sample(nodes, 2)
            if free[a] and free[b]:
                on = [(a, [free[a].pop()]), (b, [free[b].pop()])]
                s.replica(rid, model, on=on, profile="two", ready="-2h")
            continue
        node = rng.choice(nodes)
        gpus = rng.choice([1, 1, 2, 4])
        if len(free[node]) < gpus:
            continue
        s.replica(rid, model, on=(node, [free[node].pop() for _ in range(gpus)]), ready="-2h")
    for n in nodes:
        if rng.random() < 0.1:
            s.emit(ev.NodeCordoned(node=n))
    return s, models


def made_up(rng: random.Random, v: View, models: list[str]) -> Decision:
    """A decision with any candidates: the replicas the view holds, some of them."""
    records = list(v.state.replicas.values())
    rng.shuffle(records)
    cands = tuple(
        Candidate(
            r.id,
            r.model,
            "standard",
            "default",
            2,
            True,
            None,
            sum(len(s.gpus) for s in r.shards),
            0.0,
            0.0,
            r.shards[0].node,
            False,
        )
        for r in records[: rng.randint(0, len(records))]
    )
    model = rng.choice(models)
    names = [p.name for p in v.catalog[model].profiles]
    chosen = tuple(rng.sample(names, rng.randint(1, len(names))))
    avoid = tuple(n for n in sorted(v.state.nodes) if rng.random() < 0.2)
    return Decision(
        model=model,
        outcome="no_fit",
        now=NOW,
        reason="made up",
        profiles=chosen,
        avoid=avoid,
        candidates=cands,
    )


@pytest.mark.parametrize("seed", range(300))
def test_the_oracle_answers_as_every_set_tried_does(seed: int) -> None:
    rng = random.Random(seed)
    s, models = cluster(rng)
    v = s.view(strict=False)
    decisions = [made_up(rng, v, models) for _ in range(3)]
    for model in models:
        decisions.append(plan(v, model, NOW, Config(max_victims=rng.randint(1, 4))))
    for d in decisions:
        for k in (1, 2, 3, 4):
            limit = rng.choice([oracle.LIMIT, 10**6, rng.randint(0, 40)])
            want = reference_exists(v, d, k, limit)
            assert oracle.exists(v, d, k, limit) is want, (d.model, k, limit)


def test_the_cases_it_meets_are_all_met() -> None:
    """The random clusters above give every answer, for one shard and for several."""
    seen: set[tuple[bool, bool | None]] = set()
    for seed in range(300):
        rng = random.Random(seed)
        s, models = cluster(rng)
        v = s.view(strict=False)
        for _ in range(3):
            d = made_up(rng, v, models)
            m = v.catalog[d.model]
            one = all(p.shards == 1 for p in m.profiles if p.name in d.profiles)
            seen.add((one, reference_exists(v, d, 3, 10**6)))
            seen.add((one, reference_exists(v, d, 3, 0)))
    assert seen >= {(one, answer) for one in (True, False) for answer in (True, False, None)}


@pytest.mark.parametrize("seed", range(200))
def test_what_it_keeps_between_decisions_gives_their_own_answers(seed: int) -> None:
    """The oracle keeps its last grouping on the view (`oracle._groups`): decisions one
    after another on one view, at one cap and limit, some on the very candidates of
    the one before (the same tuple, an equal one, or for a model of other profiles),
    each answered as the plain reference answers it (at times at another cap or
    limit)."""
    rng = random.Random(seed)
    s, models = cluster(rng)
    v = s.view(strict=False)
    decisions = [made_up(rng, v, models) for _ in range(4)]
    decisions += [plan(v, model, NOW, Config()) for model in models]
    for d in list(decisions):
        other = rng.choice(models)
        names = tuple(p.name for p in v.catalog[other].profiles)
        # Equal candidates, not the same tuple; and the same tuple for another model.
        decisions.append(msgspec.structs.replace(d, candidates=tuple(list(d.candidates))))
        decisions.append(msgspec.structs.replace(d, model=other, profiles=names))
    small = rng.randint(0, 40)
    for d in decisions + rng.sample(decisions, len(decisions)):
        # Mostly what the call before asked, at times another cap or limit.
        k, limit = rng.choice([(3, oracle.LIMIT)] * 3 + [(1, small), (2, small), (3, small)])
        assert oracle.exists(v, d, k, limit) is reference_exists(v, d, k, limit), d.model


NVL = ev.TopologySpec(level="nvlink_domain")


def domain_cluster(rng: random.Random) -> tuple[Scenario, list[str]]:
    """Nodes in NVLink domains (some unlabelled), models of several shards required in
    one domain beside one-shard ones, and gangs placed anywhere (across domains too)."""
    s = Scenario(NOW)
    nodes = [f"n{i}" for i in range(rng.randint(2, 8))]
    doms = rng.randint(1, 3)
    for n in nodes:
        labels = {} if rng.random() < 0.15 else {"nvlink_domain": f"d{rng.randrange(doms)}"}
        s.node(n, 8, labels=labels)
    models = []
    for i in range(rng.randint(2, 5)):
        name = f"m{i}"
        models.append(name)
        shards = rng.choice([2, 2, 3])
        gpus = rng.choice([2, 4, 8])
        topo = NVL if rng.random() < 0.8 else None
        spec = ev.ProfileSpec(name=f"pp{shards}", gpus=gpus, shards=shards, topology=topo)
        s.model(name, cls=rng.choice(["opportunistic", "standard"]), min=0, max=50,
                profiles=[spec, "one:2"] if rng.random() < 0.2 else [spec])  # fmt: skip
    free = {n: list(range(8)) for n in nodes}
    for r in range(rng.randint(0, 14)):
        model = rng.choice(models)
        rid = f"r{r:02d}"
        gpus = rng.choice([1, 2, 4])
        if rng.random() < 0.5:
            at = [n for n in nodes if len(free[n]) >= gpus]
            if len(at) < 2:
                continue
            on = [(n, [free[n].pop() for _ in range(gpus)]) for n in rng.sample(at, 2)]
            s.replica(rid, model, on=on, profile="gang", ready="-2h")
            continue
        node = rng.choice(nodes)
        if len(free[node]) >= gpus:
            s.replica(rid, model, on=(node, [free[node].pop() for _ in range(gpus)]), ready="-2h")
    return s, models


@pytest.mark.parametrize("seed", range(80))
def test_domain_groups_answer_as_every_set_tried_does(seed: int) -> None:
    """Required in one domain, the oracle tries each domain's candidates' sets: the
    answer is that of every set of the candidates (`by_domain=False`, and the plain
    reference above), None included."""
    rng = random.Random(seed)
    s, models = domain_cluster(rng)
    v = s.view(strict=False)
    decisions = [made_up(rng, v, models) for _ in range(3)]
    for model in models:
        for policy in ("reference", "node-aware"):
            decisions.append(plan(v, model, NOW, Config(policy=policy, max_victims=3)))  # type: ignore[arg-type]
    for d in decisions:
        for k in (1, 2, 3):
            limit = rng.choice([oracle.LIMIT, 10**6, rng.randint(0, 40)])
            want = reference_exists(v, d, k, limit)
            assert oracle.exists(v, d, k, limit, by_domain=False) is want, (d.model, k, limit)
            assert oracle.exists(v, d, k, limit) is want, (d.model, k, limit)


def test_domain_groups_meet_every_answer() -> None:
    seen: set[bool | None] = set()
    for seed in range(80):
        rng = random.Random(seed)
        s, models = domain_cluster(rng)
        v = s.view(strict=False)
        for _ in range(3):
            d = made_up(rng, v, models)
            if oracle._required_level(
                [p for p in v.catalog[d.model].profiles if p.name in d.profiles]
            ):
                seen.add(oracle.exists(v, d, 3, rng.choice([10**6, 0])))
    assert seen == {True, False, None}
