"""The policy's shortcuts against the plain computation, over random clusters.

`preemption._candidates` groups the live replicas by model from the view's per-model
index, weighs a model's replicas in bulk where one outcome of the tier rules covers them
all, sorts only the models whose minimum splits them, keeps what a replica frees per
profile, and collects the exclusions per replica id; `Decision.to_event_data(shown=...)`
converts only what a published event lists; the oracle counts sets before it builds any
group; the node-aware search orders a level by the work thrown away and works out the
whole key only for ties. Each is checked here against the computation it stands for,
written out replica by replica from the same rules, on views folded from random logs and
on the same views rebuilt from a snapshot (whose replicas come in another order).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from services.core import catalog, fold, node_aware, preemption, quota
from services.core.preemption import WHY, Candidate, Config, Decision, Exclusion, plan
from services.core.reaction import bounded
from services.core.view import ReplicaRecord, View, decode_state, encode_state, size_of
from services.sim import oracle
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


def plain(
    view: View,
    m: catalog.Model,
    now: datetime,
    cfg: Config,
    holdings: list[quota.Holding],
    reclaim: bool,
    below_min: bool,
) -> tuple[tuple[Candidate, ...], tuple[Exclusion, ...]]:
    """`_candidates` replica by replica: every rule read afresh for each one, every
    model's replicas sorted, every exclusion an `Exclusion` at once."""
    tree = view.quota
    any_guarantee = tree.any_guarantee()
    borrowed = tree.borrowed(holdings) if any_guarantee else set()
    out: list[Candidate] = []
    excluded: list[Exclusion] = []

    def exclude(rid: str, model: str, why: str, detail: str = "") -> None:
        excluded.append(Exclusion(replica=rid, model=model, why=why, detail=detail or WHY[why]))

    by_model: dict[str, list[ReplicaRecord]] = {}
    mine = view.catalog.names_of(m)  # m's own name, and an old one it holds alone
    for r in view.current():
        if not r.holds_capacity:
            continue
        if r.model in mine:
            exclude(r.id, r.model, "same_model")
        elif r.retiring_at is not None:
            exclude(r.id, r.model, "retiring")
        elif r.preempted_for is not None:
            exclude(r.id, r.model, "already_preempted", f"already stopped for {r.preempted_for}")
        elif not r.live:
            exclude(r.id, r.model, "draining")
        else:
            by_model.setdefault(r.model, []).append(r)
    for name, reps in by_model.items():
        other = view.catalog.resolve(name)
        if other is None:
            for r in reps:
                exclude(r.id, name, "unknown_model")
            continue
        p = preemption._Peer(other, m, any_guarantee, tree)
        reps = sorted(reps, key=lambda r: (r.created_at, r.id), reverse=True)
        above = max(len(reps) - other.min, 0)
        for i, r in enumerate(reps):
            above_min = i < above
            idle = None if r.last_used_at is None else (now - r.last_used_at).total_seconds()
            past = p.idle_decides and (0.0 if idle is None else idle) >= cfg.eviction_grace_s
            is_borrowed = r.id in borrowed if p.covered else any_guarantee
            by_class = preemption._class_tier(p, past, above_min, below_min)
            tier = preemption._owner_tier(p, by_class, above_min, is_borrowed, reclaim)
            if tier is None or tier == "guaranteed":
                code = preemption._GUARANTEED if tier else preemption._UNTIERED
                why, detail = preemption._why_not(p, m, code, above_min, below_min)
                exclude(r.id, name, why, detail)
                continue
            young = preemption._young(r, now, cfg.min_lifetime_s)
            if young:
                exclude(r.id, name, "young", young)
                continue
            where = preemption._where(r)
            if where is None:
                exclude(r.id, name, "multi_node", f"spread over {', '.join(r.nodes)}")
                continue
            size = size_of(view, r)
            assert isinstance(tier, int)
            out.append(
                Candidate(
                    replica=r.id,
                    model=name,
                    cls=p.cls,
                    owner=p.owner,
                    tier=tier,
                    above_min=above_min,
                    idle_s=idle,
                    gpus=size.gpus,
                    cpu_cores=size.cpu_cores,
                    memory_gb=size.memory_gb,
                    node=where[0],
                    borrowed=is_borrowed,
                )
            )
    out.sort(key=lambda c: (c.tier, -(c.idle_s or 0.0), c.gpus, c.memory_gb, c.replica))
    excluded.sort(key=lambda x: x.replica)
    return tuple(out), tuple(excluded)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 600.0]), st.sampled_from([0.0, 120.0]))
def test_candidates_equal_the_plain_computation(seed: int, grace: float, lifetime: float) -> None:
    s, models = build(random.Random(seed))
    cfg = Config(eviction_grace_s=grace, min_lifetime_s=lifetime)
    folded = s.view()
    rebuilt = View(decode_state(encode_state(folded.state)))
    for v in (folded, rebuilt):
        holdings = v.holdings()
        for name in models:
            m = v.catalog[name]
            for reclaim in (False, True):
                for below_min in (False, True):
                    args = (v, m, s.now, cfg, holdings, reclaim, below_min)
                    fast = preemption._candidates(*args)
                    assert fast == plain(*args)
    for name in models:
        a, b = plan(folded, name, s.now, cfg), plan(rebuilt, name, s.now, cfg)
        assert a == b
        assert msgspec.json.encode(a) == msgspec.json.encode(b)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 600.0]), st.sampled_from([0.0, 120.0]))
def test_kept_weighings_equal_the_plain_computation_as_the_log_grows(
    seed: int, grace: float, lifetime: float
) -> None:
    """What `_candidates` keeps on a view between calls (`preemption._Kept`) is used
    again only while it still holds: the log is folded one event at a time, and after
    each the kept answer is checked against the plain one, with time mostly going
    forward (replicas growing out of "young" and into idleness) and now and then back.
    Past the random cluster, the log goes on: replicas used for the first time and again,
    a model declared anew with another minimum, the quota tree replaced, drains. Each call
    is for a model and settings drawn at random, so what one model's weighing keeps is
    taken by the next only where it holds for it too (`preemption._alike`)."""
    rng = random.Random(seed)
    s, models = build(rng)
    s.at("+30s")
    reps = list(s._replicas)
    for rid in rng.sample(reps, min(4, len(reps))):
        s.used(rid, at=rng.choice(["-20m", "-1m", "+0s"]))
    if rng.random() < 0.5:
        name = rng.choice(models)
        d = s._models[name]
        s.model(
            name,
            cls=d.cls,
            min=rng.choice([0, 1, 4]),
            max=d.max,
            profiles=list(d.profiles),
            owner=d.owner,
        )
    if rng.random() < 0.5:
        s.quota({o: {"gpus": rng.choice([0, 4, 8])} for o in ("o0", "o1")})
    for rid in rng.sample(reps, min(3, len(reps))):
        s.drain(rid, rng.choice(["scale_down", "preempted"]), for_model=models[0])
    # Asked now under these settings, now under others: what is kept under one (and
    # shared between the models weighed alike) is never taken for the other.
    cfgs = [
        Config(eviction_grace_s=grace, min_lifetime_s=lifetime),
        Config(eviction_grace_s=600.0 - grace, min_lifetime_s=lifetime),
        Config(eviction_grace_s=grace, min_lifetime_s=120.0 - lifetime),
    ]
    few = preemption._FEW
    # The kept lists take entries out and put them in one by one up to _FEW of them,
    # past that in one walk and one sort: both ways are checked.
    for preemption._FEW in (0, 1_000):
        try:
            view = View()
            now = s.now - timedelta(hours=1)
            for seq, subject, e in s.events():
                fold.apply(view, e, seq=seq, subject=subject)
                now += timedelta(seconds=rng.choice([-1800.0, -90.0, 0, 1, 60, 200, 900]))
                holdings = view.holdings()
                for name in rng.sample(models, min(3, len(models))):
                    m = view.catalog.resolve(name)
                    if m is None:
                        continue
                    reclaim, below_min = rng.random() < 0.5, rng.random() < 0.5
                    args = (view, m, now, rng.choice(cfgs), holdings, reclaim, below_min)
                    assert preemption._candidates(*args) == plain(*args)
        finally:
            preemption._FEW = few


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_calls_at_one_time_read_every_change_folded_between_them(seed: int) -> None:
    """Calls at one time, with nothing folded between them, check no model's block again
    (`_Kept.walked`); anything folded between them makes them look again: a replica's
    use, a drain, its stop, a model declared anew (another minimum, class or alias, with
    no replica changing) or removed, the quota tree replaced. Every answer is the plain
    one."""
    rng = random.Random(seed)
    s, models = build(rng)
    now = s.now
    reps = list(s._replicas)
    for _ in range(12):
        roll = rng.random()
        if roll < 0.4:
            name = rng.choice(models)
            d = s._models[name]
            s.model(
                name,
                cls=rng.choice(CLASSES),
                min=rng.choice([0, 1, 4]),
                max=d.max,
                profiles=list(d.profiles),
                owner=d.owner,
                aliases=rng.choice([[], [rng.choice(models)]]),
            )
        elif roll < 0.48:
            # The replicas of a model removed are another's where it holds the name as
            # an alias, else of no model.
            s.emit(ev.ModelRemoved(name=rng.choice(models)))
        elif roll < 0.55:
            s.quota({o: {"gpus": rng.choice([0, 4, 8])} for o in ("o0", "o1", "o2")})
        elif reps and roll < 0.8:
            s.used(rng.choice(reps), at=rng.choice(["-20m", "-1m", "+0s"]))
        elif reps:
            rid = rng.choice(reps)
            s.drain(rid, rng.choice(["scale_down", "preempted"]), for_model=models[0])
            if rng.random() < 0.5:
                s.state(rid, "stopped")
    cfg = Config(eviction_grace_s=rng.choice([0.0, 600.0]))
    view = View()
    for seq, subject, e in s.events():
        fold.apply(view, e, seq=seq, subject=subject)
        holdings = view.holdings()
        for _ in range(rng.randint(0, 4)):
            m = view.catalog.resolve(rng.choice(models))
            if m is None:
                continue
            reclaim, below_min = rng.random() < 0.5, rng.random() < 0.5
            args = (view, m, now, cfg, holdings, reclaim, below_min)
            assert preemption._candidates(*args) == plain(*args)


def test_a_weighing_is_shared_only_between_models_and_settings_it_holds_for() -> None:
    """Models of every class, three standard ones of one owner and one of another (under
    a guarantee), asking under two grace periods and two minimum lifetimes, reclaiming
    or not: the replicas of the others (ready a minute ago or long since, idle, never
    used) are weighed once per kind of model asking (`preemption._kept`, `_alike`), and each
    answer is the plain one."""
    s = Scenario()
    s.node("n0", "8xH100-80GB")
    s.model("a", cls="standard", min=0, profiles=["p1:1"], owner="o0")
    s.model("b", cls="standard", min=0, profiles=["p1:1"], owner="o0")
    s.model("a2", cls="standard", min=0, profiles=["p1:1"], owner="o0")
    s.model("c", cls="standard", min=0, profiles=["p1:1"], owner="o1")
    s.model("crit", cls="critical", min=0, profiles=["p1:1"], owner="o0")
    s.model("od", cls="opportunistic", min=0, profiles=["p1:1"], owner="o0")
    s.model("batch", cls="opportunistic", min=1, profiles=["p1:1"], owner="o1")
    s.replica("od-1", "od", on=("n0", [0]), ready="-60s", used="-20m")
    s.replica("od-2", "od", on=("n0", [1]), ready="-60s")
    s.model("low", cls="opportunistic", min=0, profiles=["p1:1"], owner="o0")
    s.replica("b-1", "b", on=("n0", [2]), ready="-2h")
    s.replica("b-2", "b", on=("n0", [5]), ready="-60s")
    s.replica("low-1", "low", on=("n0", [6]), ready="-3h")
    s.replica("batch-1", "batch", on=("n0", [3]), ready="-60s")
    s.replica("batch-2", "batch", on=("n0", [4]), ready="-3h")
    s.quota({"o1": {"gpus": 1}})
    view = s.view()
    holdings = view.holdings()
    asked = [
        (name, Config(eviction_grace_s=grace, min_lifetime_s=lifetime), reclaim, below_min)
        for grace in (0.0, 600.0)
        for lifetime in (0.0, 120.0)
        for name in ("a", "a2", "b", "c", "crit", "od")
        for reclaim in (False, True)
        for below_min in (False, True)
    ]
    for _ in range(2):
        for name, cfg, reclaim, below_min in asked:
            m = view.catalog[name]
            now = s.now + timedelta(seconds=30)
            args = (view, m, now, cfg, holdings, reclaim, below_min)
            assert preemption._candidates(*args) == plain(*args)
    # A kind per class and owner asking (four), reclaiming or not, below its minimum or
    # not, under each of the four settings, the last KEPT of them kept; each model's own
    # replicas once.
    kinds = {preemption._alike(view.catalog[n], c, r, b) for n, c, r, b in asked}
    assert len(kinds) == 4 * 2 * 2 * 4
    assert len(view.memo["preemption"]) == preemption.KEPT
    assert set(view.memo["own"]) == {"od", "b"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["reference", "node-aware"]))
def test_a_published_decision_lists_what_the_cut_keeps(seed: int, policy: str) -> None:
    s, models = build(random.Random(seed))
    v = View(decode_state(encode_state(s.view().state)))
    for name in models:
        d = plan(v, name, s.now, Config(policy=policy))  # type: ignore[arg-type]
        whole = d.to_event_data("t")
        assert whole.considered == len(whole.candidates) == len(d.candidates)
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
    """`node_aware._first_fit` tries one level's sets in the order of their whole keys,
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
    fast = node_aware._first_fit(level, load_s, trying(fast_tried))
    plain_tried: list[Sequence[Candidate]] = []
    fits = trying(plain_tried)
    found = next(
        (vs for vs in sorted(level, key=lambda vs: node_aware.key(vs, load_s)) if fits(vs)), ()
    )
    assert fast == found
    assert fast_tried == plain_tried


def test_the_weighings_kept_on_a_view_are_bounded() -> None:
    """A view keeps the weighings for the last `KEPT` kinds of model (class, owner,
    flags and settings) it was asked about, not for every kind ever asked about; the
    models of one kind share theirs."""
    s = Scenario()
    s.node("n0", "8xH100-80GB")
    names = [f"m{i}" for i in range(preemption.KEPT + 10)]
    for name in names:
        s.model(name, cls="critical", min=1, profiles=["big:8"], owner=f"o-{name}")
    s.model("twin", cls="critical", min=1, profiles=["big:8"], owner=f"o-{names[-1]}")
    s.model("filler", cls="opportunistic", min=0, profiles=["one:1"])
    for i in range(8):
        s.replica(f"f{i}", "filler", on=("n0", [i]), ready="-1h")
    v = s.view()
    for name in [*names, "twin"]:
        assert plan(v, name, s.now).outcome == "no_fit"
    kept = v.memo["preemption"]
    assert len(kept) == preemption.KEPT
    assert {k[1] for k in kept} == {f"o-{n}" for n in names[-preemption.KEPT :]}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["reference", "node-aware"]), st.integers(1, 4))
def test_trials_on_the_victims_nodes_decide_as_trials_on_every_node(
    seed: int, policy: str, k: int
) -> None:
    """The dry run's shortcuts: the reference's growing sets release each victim from
    the inventory the last set left (`_Trials.fits_with_one_more`), and with every
    profile of one shard a trial looks only at the victims' nodes (`place`'s `within`).
    Decisions, trials and placements are what a fresh clone and a look at every node
    give."""
    rng = random.Random(seed)
    s, models = filled(rng, 0.8)
    v = s.view()
    cfg = Config(policy=policy, max_victims=k)  # type: ignore[arg-type]
    fast = [plan(v, name, s.now, cfg) for name in models]
    slow_trials = preemption._Trials
    v.memo.clear()

    class Plain(slow_trials):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            self.one_shard = False

        def fits_with_one_more(self, gone: list[Candidate]) -> bool:
            return bool(self.fits_without(gone, False))

    preemption._Trials = Plain  # type: ignore[misc]
    kept = preemption.placements
    preemption.placements = _never_kept  # type: ignore[assignment]
    try:
        plain_decisions = [plan(v, name, s.now, cfg) for name in models]
    finally:
        preemption._Trials = slow_trials  # type: ignore[misc]
        preemption.placements = kept
    assert fast == plain_decisions


def _never_kept(view: View) -> dict[object, object]:
    """`preemption.placements` keeping nothing: every placement worked out afresh."""
    return {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["reference", "node-aware"]))
def test_placements_kept_for_the_inventory_decide_as_placements_worked_out_afresh(
    seed: int, policy: str
) -> None:
    """The placements the policy keeps while the inventory's version stays (`placements`):
    the log is folded one event at a time, the policy asked about a few models after
    each (the same shapes of profile again and again), and every decision is what the
    policy decides with nothing kept; then the same on a view rebuilt from a snapshot,
    whose inventory is another object with other versions."""
    rng = random.Random(seed)
    s, models = filled(rng, 0.7)
    reps = list(s._replicas)
    for rid in rng.sample(reps, min(3, len(reps))):
        s.state(rid, "stopped")
    cfg = Config(policy=policy)  # type: ignore[arg-type]
    kept = preemption.placements
    view = View()
    asked = 0
    for seq, subject, e in s.events():
        fold.apply(view, e, seq=seq, subject=subject)
        for name in rng.sample(models, min(3, len(models))):
            if view.catalog.resolve(name) is None:
                continue
            a = plan(view, name, s.now, cfg)
            preemption.placements = _never_kept  # type: ignore[assignment]
            try:
                b = plan(view, name, s.now, cfg)
            finally:
                preemption.placements = kept
            assert a == b
            asked += 1
    rebuilt = View(decode_state(encode_state(view.state)))
    for name in models:
        assert plan(rebuilt, name, s.now, cfg) == plan(view, name, s.now, cfg)
    assert asked


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_the_nodes_kept_for_a_tuple_of_candidates_search_as_nodes_worked_out_afresh(
    seed: int,
) -> None:
    """The node-aware search keeps its candidates grouped by node for the very tuple it
    was given and the inventory's version (`node_aware._on_nodes`): the same tuple asked
    about again after the inventory changed (a replica stopped, a node cordoned), and a
    list changed in place between two calls, are searched as with nothing kept."""
    rng = random.Random(seed)
    s, models = filled(rng, 0.8)
    view = View()
    folded = 0

    def catch_up() -> None:
        nonlocal folded
        for seq, subject, e in list(s.events())[folded:]:
            fold.apply(view, e, seq=seq, subject=subject)
            folded += 1

    catch_up()
    cfg = Config(policy="node-aware", max_victims=rng.randint(1, 3))
    asked = [d for d in (plan(view, m, s.now, cfg) for m in models) if d.candidates]

    def search(d: Decision, cands: Sequence[Candidate], fresh: bool) -> Sequence[Candidate]:
        if fresh:
            view.memo.pop("node_aware", None)
        m = view.catalog.resolve(d.model)
        assert m is not None
        profiles = [p for p in m.profiles if p.name in d.profiles]
        tr = preemption._Trials(view, profiles, d.avoid)
        return node_aware.search(
            view, profiles, cands, cfg.max_victims, lambda gone: tr.fits_without(gone, False), list
        )

    for d in asked:
        search(d, d.candidates, False)
        for c in rng.sample(d.candidates, min(2, len(d.candidates))):
            if rng.random() < 0.6:
                s.state(c.replica, "stopped")
            else:
                s.emit(ev.NodeCordoned(node=c.node))
        catch_up()
        kept = search(d, d.candidates, False)
        assert kept == search(d, d.candidates, True)
        changing = list(d.candidates)
        search(d, changing, False)
        rng.shuffle(changing)
        del changing[: rng.randint(0, len(changing))]
        assert search(d, changing, False) == search(d, changing, True)


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


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_the_nodes_kept_per_kind_of_need_search_as_nodes_worked_out_afresh(seed: int) -> None:
    """The node-aware search keeps, per tuple of candidates, the nodes worked out for
    each kind of need and cap (`node_aware._on_nodes`): one tuple searched for profiles
    of every shape (GPUs, GPU memory and model, CPU, memory), one after another and
    again, under every cap, each as with nothing kept."""
    rng = random.Random(seed)
    view, cands = two_kinds(rng)
    if not cands:
        return
    # Two kinds of GPU asked for, each in every size: sizes of one kind share which GPUs
    # qualify, and differ in the bound.
    kinds = [
        (rng.choice([0.0, 24.0, 80.0, 100.0]), rng.choice([None, "H100", "L4"])) for _ in range(2)
    ]
    shapes = [
        catalog.Profile(
            name=f"s{i}-{gpus}",
            gpus=gpus,
            gpu_memory_gb=gb,
            gpu_model=gpu_model,
            cpu_cores=rng.choice([0.0, 8.0, 5000.0]),
            memory_gb=rng.choice([0.0, 64.0, 10.0**6]),
        )
        for i, (gb, gpu_model) in enumerate(kinds)
        for gpus in (1, 2, 4, 8)
    ]
    asks = [([p], k) for p in shapes for k in (1, 2, 3)]
    asks += [(rng.sample(shapes, 2), rng.randint(1, 3)) for _ in range(4)]
    # The most demanding first (the fewest nodes pass the bound), then the rest, then
    # all again in another order: nodes kept for one kind are never taken for another.
    asks.sort(key=lambda ask: (-min(p.gpus for p in ask[0]), ask[1]))
    for profiles, k in asks + rng.sample(asks, len(asks)):
        trials = preemption._Trials(view, profiles, ())

        def fits(vs: Sequence[Candidate], trials: preemption._Trials = trials) -> bool:
            return bool(trials.fits_without(vs, False))

        kept = node_aware.search(view, profiles, cands, k, fits, list)
        view.memo.pop("node_aware", None)
        assert kept == node_aware.search(view, profiles, cands, k, fits, list)


def eager_search(
    view: View,
    profiles: Sequence[catalog.Profile],
    cands: Sequence[Candidate],
    max_victims: int,
    fits: Callable[[Sequence[Candidate]], bool],
) -> Sequence[Candidate]:
    """`node_aware.search` of one-shard profiles as first written: each level's sets all
    made and checked on their node before any is ordered."""
    needs = [node_aware._Need(p) for p in profiles if p.shards == 1 and p.gpus >= 0]
    nodes = node_aware._on_nodes(view, cands, needs, max_victims) if needs else []
    for t in sorted({c.tier for c in cands}):
        for k in range(1, max_victims + 1):
            level_sets = [
                tuple([cands[at[i]] for i in chosen])
                for at, node in nodes
                for chosen in itertools.combinations(
                    [i for i, c in enumerate(node.cands) if c.tier <= t], k
                )
                if any(node.cands[i].tier == t for i in chosen) and node.fits(needs, chosen)
            ]
            if level_sets:
                load_s = node_aware.load_costs(view, {v.model for vs in level_sets for v in vs})
                best = node_aware._first_fit(level_sets, load_s, fits)
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
                trials = preemption._Trials(view, profiles, ())
                tried: list[tuple[str, ...]] = []

                def fits(
                    vs: Sequence[Candidate],
                    trials: preemption._Trials = trials,
                    tried: list[tuple[str, ...]] = tried,
                ) -> bool:
                    tried.append(tuple(v.replica for v in vs))
                    return bool(trials.fits_without(vs, False))

                if lazy:
                    found.append(node_aware.search(view, profiles, cands, k, fits, list))
                else:
                    found.append(eager_search(view, profiles, cands, k, fits))
                runs.append(tried)
            assert found[0] == found[1], seed
            assert runs[0] == runs[1], seed
            searched += 1
    assert searched > 100
