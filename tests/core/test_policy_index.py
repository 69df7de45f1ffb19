"""The index against the plain walk: random logs folded one event at a time, and after
each, random models asked about under both policies and random settings, at times that
move on. The decisions must be the same, field for field (`Decision` compares every
field, the candidates, exclusions, trials and placements with it). Derandomised, so a
failure shows its seed and comes back the same."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from services.core import fold, placement
from services.core import view as view_module
from services.core.policy import (
    PLAIN,
    Checked,
    Config,
    Decision,
    Fast,
    Plain,
    PolicyMismatch,
    plan,
)
from services.core.policy.engine import Listing
from services.core.view import View
from tests.core.test_policy_fast import CLASSES, build, filled
from tests.scenario import Scenario


def either_policy(rng: random.Random) -> Config:
    """Settings for one question: either policy, grace and lifetime on or off, a cap."""
    return Config(
        policy=rng.choice(["reference", "node-aware"]),  # type: ignore[arg-type]
        eviction_grace_s=rng.choice([0.0, 600.0]),
        min_lifetime_s=rng.choice([0.0, 120.0]),
        max_victims=rng.randint(1, 3),
    )


def seeds(examples: int) -> Callable[[Callable[[int], None]], Callable[[], None]]:
    """A test of one seed, run over `examples` seeds, the same ones every run."""

    def wrap(test: Callable[[int], None]) -> Callable[[], None]:
        return settings(  # type: ignore[no-any-return]
            max_examples=examples,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        )(given(st.integers(0, 2**32 - 1))(test))

    return wrap


def _later(rng: random.Random, s_models: list[str]) -> list[ev.Data]:
    """Events after the cluster is built: a model renamed (declared again under a new
    name with the old one as its alias), one removed, one declared again with another
    minimum or class."""
    out: list[ev.Data] = []
    for name in rng.sample(s_models, min(len(s_models), 3)):
        roll = rng.random()
        if roll < 0.3:
            out.append(
                ev.ModelDeclared(
                    name=f"{name}-v2",
                    cls=rng.choice(["opportunistic", "standard", "critical"]),
                    min=rng.choice([0, 1, 2]),
                    max=12,
                    aliases=(name,),
                    profiles=(ev.ProfileSpec(name="p1", gpus=1),),
                )
            )
        elif roll < 0.5:
            out.append(ev.ModelRemoved(name=name))
        else:
            out.append(
                ev.ModelDeclared(
                    name=name,
                    cls=rng.choice(["opportunistic", "standard", "critical"]),
                    min=rng.choice([0, 1, 3]),
                    max=12,
                    profiles=(ev.ProfileSpec(name="p1", gpus=1),),
                )
            )
    return out


@seeds(100)
def test_the_index_decides_as_the_plain_walk_event_by_event(seed: int) -> None:
    rng = random.Random(seed)
    s, models = build(rng)
    for data in _later(rng, models):
        s.emit(data)
    view = View()
    # Checked compares every candidate, exclusion, count and node, not only what a
    # decision lists; it raises on the first difference.
    index = Checked(Fast())
    quick = Fast()
    asked = 0
    now = s.now
    for seq, subject, e in s.events():
        fold.apply(view, e, seq=seq, subject=subject)
        if rng.random() < 0.5:
            continue
        now += timedelta(seconds=rng.choice([0, 1, 30, 700]))
        names = sorted({m.name for m in view.catalog.models()} | set(models)) or ["nothing"]
        for name in rng.sample(names, min(2, len(names))):
            cfg = either_policy(rng)
            # The spec whole: the plain walk, every set tried on a clone of the cluster.
            plain = plan(view, name, now, cfg, engine=PLAIN)
            assert plan(view, name, now, cfg) == plain, (seed, seq, name)
            assert plan(view, name, now, cfg, engine=index) == plain, (seed, seq, name)
            # Each engine as a service runs it, its config naming it: the same bytes,
            # published and printed, but for the field that names the engine.
            want = as_bytes(plan(view, name, now, replace(cfg, engine="plain"), engine=PLAIN))
            for eng in (quick, index):
                got = plan(view, name, now, replace(cfg, engine=eng.name), engine=eng)
                assert as_bytes(got) == want, (seed, seq, name, eng.name)
            asked += 1
    assert asked > 0


def as_bytes(d: Decision) -> bytes:
    """A decision as it is published (`preemption.decided`), printed (`llmgw preemption
    plan --json`) and kept whole (every field, its config's included), the engine it
    names set to the plain one's."""
    engine = d.config.engine.encode()
    out = b"\n".join(
        (
            msgspec.json.encode(d.to_event_data("trigger")),
            json.dumps(d.to_json()).encode(),
            msgspec.json.encode(d),
        )
    )
    assert out.count(b'"engine":"%s"' % engine) + out.count(b'"engine": "%s"' % engine) == 3
    return out.replace(b'"engine":"%s"' % engine, b'"engine":"plain"').replace(
        b'"engine": "%s"' % engine, b'"engine": "plain"'
    )


def _life(rng: random.Random, s: Scenario, models: list[str]) -> None:
    """A cluster's life after it is built, for the index's incremental paths: uses that
    move a replica's order (later, earlier than the last one, at the same time),
    replicas stopping, failing and drained (pulling a sibling below its model's
    minimum, moving who is borrowed), new ones created older than others (pushing a
    sibling above the minimum, moving a guarantee's boundary from the middle), now and
    then a nested quota tree, a model declared again with another minimum, a rename
    with its alias, a removal; the clock moving on."""
    view = s.view(strict=False)
    reps = [r.id for r in view.state.replicas.values()]
    nodes = sorted(n.name for n in view.inventory.nodes())
    gpus = {m.name: m.profiles[0] for m in view.catalog.models()}
    if rng.random() < 0.5:
        # Guarantees on two levels: the owners' parent has one too, so a replica counts
        # at both, and may be past either.
        top = {"gpus": rng.choice([2, 4, 8])}
        s.quota(
            {
                "org": {"guarantee": top},
                **{
                    o: {"guarantee": {"gpus": rng.choice([0, 1, 2, 4])}, "parent": "org"}
                    for o in ("o0", "o1")
                },
            }
        )
    made = 0
    for _ in range(rng.randint(10, 60)):
        roll = rng.random()
        if roll < 0.45 and reps:
            rid = rng.choice(reps)
            s.used(rid, at=rng.choice([None, None, "-1s", "-3h", "+1s"]))
        elif roll < 0.6 and reps:
            rid = rng.choice(reps)
            s.state(rid, rng.choice(["stopped", "failed", "draining"]))
        elif roll < 0.68 and reps:
            s.drain(rng.choice(reps), rng.choice(["scale_down", "preempted", "node_drain"]))
        elif roll < 0.85 and nodes and gpus:
            name = rng.choice(sorted(gpus))
            p = gpus[name]
            if p.shards != 1:
                continue
            made += 1
            rid = f"new-{made}"
            node = rng.choice(nodes)
            taken = rng.sample(range(8), p.gpus)
            s.replica(
                rid,
                name,
                on=(node, taken),
                profile=p.name,
                created=rng.choice(["-6h", "-2h", "-1s", None]),
                ready=rng.choice(["-1h", None]),
                used=rng.choice([None, "-1m"]),
            )
            reps.append(rid)
        elif roll < 0.9 and models:
            name = rng.choice(models)
            s.emit(
                ev.ModelDeclared(
                    name=name,
                    owner=rng.choice(["o0", "o1", "o2"]),
                    cls=rng.choice(["opportunistic", "standard", "critical"]),
                    min=rng.choice([0, 1, 2, 4]),
                    max=12,
                    profiles=(ev.ProfileSpec(name="p1", gpus=1),),
                )
            )
        elif roll < 0.93:
            s.emit(ev.QuotaSet(owners=(ev.OwnerQuota(name="o2", guarantee=ev.Resources(gpus=2)),)))
        else:
            s.at("+10m")  # nothing but the clock
        s.at(rng.choice(["+0s", "+1s", "+1m"]))


@seeds(100)
def test_the_index_follows_a_cluster_replica_by_replica(seed: int) -> None:
    """The same, through a cluster's life (`_life`), asked now after every event and
    now after many (the preemption service follows at each decision): the quota
    figures and who is borrowed as well as the decisions."""
    rng = random.Random(seed)
    s, models = build(rng)
    for data in _later(rng, models):
        s.emit(data)
    _life(rng, s, models)
    view = View()
    index = Checked(Fast())
    now = s.now
    every = rng.choice([1, 1, 3, 20])
    for i, (seq, subject, e) in enumerate(s.events()):
        fold.apply(view, e, seq=seq, subject=subject)
        if i % every and rng.random() < 0.8:
            continue
        now += timedelta(seconds=rng.choice([0, 1, 30, 700]))
        index.borrowed(view)
        for owner in ("o0", "o1", "o2", "org", "default"):
            index.usage(view, owner)
        names = sorted({m.name for m in view.catalog.models()} | set(models)) or ["nothing"]
        for name in rng.sample(names, min(2, len(names))):
            cfg = either_policy(rng)
            assert plan(view, name, now, cfg, engine=index) == plan(view, name, now, cfg), (
                seed,
                seq,
                name,
            )


def test_a_follower_behind_the_journal_starts_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A view keeps only its latest changes (`view.Journal`); an index further
    behind builds itself again, and answers the same."""
    monkeypatch.setattr(view_module, "JOURNAL_KEPT", 4)
    s, models = filled(random.Random(5), 0.5)
    view = View()
    index = Checked(Fast())
    events = s.events()
    for seq, subject, e in events[: len(events) // 2]:
        fold.apply(view, e, seq=seq, subject=subject)
    for name in models:
        plan(view, name, s.now, Config(), engine=index)
    for seq, subject, e in events[len(events) // 2 :]:
        fold.apply(view, e, seq=seq, subject=subject)
    assert view.journal.since(0) is None
    for name in models:
        assert plan(view, name, s.now, Config(), engine=index) == plan(view, name, s.now)


def test_the_check_stops_on_a_difference() -> None:
    """`Checked` (`--policy-engine checked`) raises with one line when the engines differ."""
    s, models = filled(random.Random(3), 1.0)
    view = s.view()

    class Wrong(Plain):
        def find(self, view: View, a: object) -> Listing:
            return Listing((), ())

    checked = Checked(Wrong())
    outcomes = []
    for name in models:
        try:
            plan(view, name, s.now, Config(), engine=checked)
        except PolicyMismatch as e:
            assert "\n" not in str(e) and str(e).startswith("policy check: for ")
            outcomes.append("stopped")
    assert "stopped" in outcomes
    assert plan(view, models[0], s.now, engine=Checked(Fast())) == plan(view, models[0], s.now)


def test_the_config_names_the_engine() -> None:
    """`engine_of` makes the engine `--policy-engine` names: fast (the index and its
    walks), plain (the spec, `PLAIN`), checked (both); nothing else."""
    from services.core.policy import engine_of

    assert isinstance(engine_of("fast"), Fast)
    assert engine_of("plain") is PLAIN
    checked = engine_of("checked")
    assert isinstance(checked, Checked) and isinstance(checked.engine, Fast)
    assert [engine_of(n).name for n in ("plain", "fast", "checked")] == ["plain", "fast", "checked"]
    with pytest.raises(ValueError, match="unknown policy engine 'index'"):
        engine_of("index")
    with pytest.raises(ValueError, match="unknown policy engine"):
        Config(engine="index")  # type: ignore[arg-type]


def _nodes_cluster(rng: random.Random) -> tuple[Scenario, list[str]]:
    """A cluster for node-aware's search: up to 16 nodes of H100s and L4s, some with a
    sick GPU, little CPU or memory, cordoned, or without the rack label; models of
    several one-shard profiles (a GPU model or memory asked, CPU and memory sized, a
    rack required), some with two shards; full or nearly, replicas loaded for a while
    (so the work thrown away differs), some idle, some never used."""
    s = Scenario()
    nodes = []
    for i in range(rng.randint(2, 16)):
        name = f"n{i:02d}"
        nodes.append(name)
        gpus = rng.choice(["8xH100-80GB", "8xH100-80GB", "4xH100-80GB", "4xL4-24GB"])
        labels = {"rack": f"r{i % 3}"} if rng.random() < 0.8 else {}
        s.node(
            name,
            gpus,
            cpu=rng.choice([16, 64, 96]),
            memory=rng.choice([256, 1024]),
            unhealthy=[0] if rng.random() < 0.1 else [],
            labels=labels,
        )
    models = []
    for i in range(rng.randint(2, 7)):
        name = f"m{i}"
        models.append(name)
        profiles = []
        for j in range(rng.randint(1, 2)):
            gpus = rng.choice([1, 2, 2, 4, 4, 8])
            profiles.append(
                ev.ProfileSpec(
                    name=f"p{j}",
                    gpus=gpus,
                    shards=2 if rng.random() < 0.1 else 1,
                    gpu_model=rng.choice(["", "", "H100", "L4"]),
                    gpu_memory_gb=rng.choice([0.0, 0.0, 40.0]),
                    cpu_cores=rng.choice([0.0, 4.0, 8.0 * gpus]),
                    memory_gb=rng.choice([0.0, 32.0 * gpus]),
                    topology=ev.TopologySpec(level="rack") if rng.random() < 0.15 else None,
                )
            )
        s.model(
            name,
            cls=rng.choice(CLASSES),
            min=rng.randint(0, 2),
            max=40,
            profiles=profiles,
            owner=rng.choice(["o0", "o1", "o2"]),
        )
    if rng.random() < 0.3:
        s.quota({"o0": {"gpus": rng.choice([0, 8, 16])}, "o1": {"gpus": 8}})
    v = s.view()
    for r in range(rng.randint(4, 60)):
        model = rng.choice(models)
        found = placement.place(v.inventory, v.catalog[model].profiles)
        if not isinstance(found, placement.Placement):
            continue
        before = len(s.events())
        t = 60 * (r + 1)
        s.replica(
            f"r{r:02d}",
            model,
            on=[(sh.node, list(sh.gpus)) for sh in found.shards],
            profile=found.profile.name,
            # Now and then no loading time (placed when ready): no work thrown away.
            created=f"-{t + rng.choice([0, 0, 1, 2, 5, 30])}m",
            ready=f"-{t}m" if rng.random() < 0.9 else "-1m",
            used=rng.choice([None, "-3h", "-20m", "-1m", f"-{t // 2}m"]),
        )
        for seq, subject, e in s.events()[before:]:
            fold.apply(v, e, seq=seq, subject=subject)
    for name in rng.sample(nodes, rng.randint(0, 2)):
        s.emit(ev.NodeCordoned(node=name))
    return s, models


@seeds(300)
def test_the_lazy_node_search_decides_as_the_spec(seed: int) -> None:
    """Node-aware's lazy search (`fast.node_levels`, the fast engine's) against the
    spec's (`node_aware.search`, the plain engine's): the same decision, field for
    field, so the same sets tried in the same order, as the spec's trials on clones of
    the whole cluster give it; and the checked engine, which runs both on every call,
    finds no difference. The
    same engines are asked again after uses, drains and time moving on, so what the
    index keeps for the walk is kept current."""
    rng = random.Random(seed)
    s, models = _nodes_cluster(rng)
    view = s.view()
    seen = len(s.events())
    lazy, checked = Fast(), Checked(Fast())
    now = s.now
    for _round in range(3):
        for name in rng.sample(models, min(3, len(models))):
            cfg = Config(
                policy="node-aware",
                eviction_grace_s=rng.choice([0.0, 600.0]),
                min_lifetime_s=rng.choice([0.0, 120.0]),
                max_victims=rng.randint(1, 4),
            )
            avoid = rng.sample(sorted(view.inventory.names()), rng.randint(0, 2))
            want = plan(view, name, now, cfg, avoid=avoid, engine=PLAIN)
            assert plan(view, name, now, cfg, avoid=avoid) == want, (seed, name)
            for engine in (lazy, checked):
                got = plan(view, name, now, cfg, avoid=avoid, engine=engine)
                assert got == want, (seed, name)
        seen = life_goes_on(rng, s, view, now, seen)
        now += timedelta(seconds=rng.choice([0, 30, 700]))


def life_goes_on(rng: random.Random, s: Scenario, view: View, now: datetime, seen: int) -> int:
    """Three live replicas each used, drained or stopped at `now`, and the events since
    `seen` folded into `view`; returns how many events are folded now."""
    live = sorted(r.id for r in view.replicas.values() if r.live)
    for rid in rng.sample(live, min(3, len(live))):
        roll = rng.random()
        if roll < 0.6:
            s.used(rid, at=now)
        elif roll < 0.8:
            s.drain(rid, "scale_down")
        else:
            s.state(rid, "stopped", at=now)
    for seq, subject, e in s.events()[seen:]:
        fold.apply(view, e, seq=seq, subject=subject)
    return len(s.events())
