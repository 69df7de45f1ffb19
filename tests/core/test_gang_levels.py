"""The lazy gang search (`fast.gang_levels`, the fast engine's) against the spec's
(`gangs.search`): random clusters with domains at two levels and multi-node replicas
(hypothesis, derandomised). Asked directly, with a dry run that answers at random (so
that many levels and sets are tried, not only the first), over the plain walk's list and
over the index's candidates: the same sets tried in the same order and the same set
taken. Asked through `plan`: the same decision, field for field, with the fast engine,
the plain one and the checked one, after uses, drains and time moving on."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from services.core import fold
from services.core.policy import Candidate, Checked, Config, gangs, plan, rules
from services.core.policy.engine import PLAIN
from services.core.policy.fast import Fast, gang_levels
from services.core.policy.fast.narrow import Narrow
from services.core.policy.fast.slots import GangSlots
from services.core.view import View
from tests.core.policy_helpers import Listed
from tests.core.test_policy_index import life_goes_on
from tests.scenario import Scenario

CLASSES = ("opportunistic", "standard", "critical")


def _topology(rng: random.Random) -> ev.TopologySpec | None:
    roll = rng.random()
    if roll < 0.3:
        return None
    level = "nvlink_domain" if roll < 0.75 else "rack"
    return ev.TopologySpec(level=level, mode="required" if rng.random() < 0.8 else "preferred")


def cluster(rng: random.Random) -> tuple[Scenario, list[str]]:
    """Racks of NVLink domains of a few nodes (now and then one without labels, one
    cordoned), models of one to three shards, replicas of one GPU to eight spread over
    them, some young, some never used, loading times that differ; the models asked for
    have one to three profiles, with or without a topology."""
    s = Scenario()
    nodes: list[str] = []
    for r in range(rng.randint(1, 2)):
        for d in range(rng.randint(1, 3)):
            for i in range(rng.randint(1, 4)):
                name = f"n{r}{d}{i}"
                labels = {"rack": f"r{r}", "nvlink_domain": f"d{r}{d}"}
                if rng.random() < 0.05:
                    labels = {}
                s.node(name, 8, labels=labels)
                nodes.append(name)
    free = {n: list(range(8)) for n in nodes}
    for j in range(rng.randint(3, 12)):
        shards = rng.choice([1, 1, 2, 2, 3])
        gpus = rng.choice([1, 1, 2, 4, 8])
        s.model(
            f"m{j}", cls=rng.choice(CLASSES), min=rng.choice([0, 0, 1]), max=20,
            profiles=[ev.ProfileSpec(name="p", gpus=gpus, shards=shards)],
        )  # fmt: skip
        for k in range(rng.randint(1, 6)):
            at = [n for n in nodes if len(free[n]) >= gpus]
            if len(at) < shards:
                break
            on = []
            for n in rng.sample(at, shards):
                on.append((n, free[n][:gpus]))
                free[n] = free[n][gpus:]
            ready = rng.randint(2, 300)
            s.replica(
                f"r{j}-{k}", f"m{j}", on=on if shards > 1 else on[0],
                created=f"-{ready + rng.choice([1, 2, 5, 10])}m", ready=f"-{ready}m",
                used=rng.choice([None, "-3h", "-40m", "-20m", "-1m"]),
            )  # fmt: skip
    wanted = []
    for w in range(rng.randint(1, 3)):
        profiles = [
            ev.ProfileSpec(
                name=f"p{i}",
                gpus=rng.choice([2, 4, 8]),
                shards=rng.choice([1, 1, 2, 3]),
                topology=_topology(rng),
            )
            for i in range(rng.randint(1, 3))
        ]
        s.model(f"want{w}", cls=rng.choice(CLASSES[1:]), min=1, profiles=profiles)
        wanted.append(f"want{w}")
    for name in rng.sample(nodes, rng.randint(0, min(2, len(nodes) // 3))):
        s.emit(ev.NodeCordoned(node=name))
    return s, wanted


def _config(rng: random.Random) -> Config:
    return Config(
        policy="node-aware",
        eviction_grace_s=rng.choice([0.0, 600.0]),
        min_lifetime_s=rng.choice([0.0, 600.0]),
        max_victims=rng.randint(1, 3),
    )


def _answers(
    salt: int, yes: float
) -> tuple[list[tuple[str, ...]], Callable[[Sequence[Candidate]], bool]]:
    """A dry run that answers at random (the same set, the same answer), and its log."""
    log: list[tuple[str, ...]] = []

    def fits(vs: Sequence[Candidate]) -> bool:
        ids = tuple(v.replica for v in vs)
        log.append(ids)
        return zlib.crc32(repr((salt, ids)).encode()) % 1000 < yes * 1000

    return log, fits


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(st.integers(0, 2**32 - 1))
def test_the_lazy_gang_search_tries_the_specs_sets_in_its_order(seed: int) -> None:
    rng = random.Random(seed)
    s, wanted = cluster(rng)
    view = s.view()
    for name in wanted:
        m = view.catalog.resolve(name)
        assert m is not None
        cfg = _config(rng)
        a = rules.asker(view, m, s.now, cfg, frozenset(), False, view.live_of(m) < m.min)
        cands = PLAIN.find(view, a).every()
        source = GangSlots(Fast().find(view, a))
        assert list(source.every()) == list(cands)
        salt = rng.randrange(1 << 30)
        yes = rng.choice([0.0, 0.2, 0.5, 1.0])
        domains = Narrow(view, m.profiles, ()).domains
        want_log, fits = _answers(salt, yes)
        want = gangs.search(view, m.profiles, cands, cfg.max_victims, fits)
        for src in (Listed(cands), source):
            got_log, fits = _answers(salt, yes)
            got = gang_levels.search(view, m.profiles, src, cfg.max_victims, fits, domains)
            assert got_log == want_log, (seed, name)
            assert list(got) == list(want), (seed, name)


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(st.integers(0, 2**32 - 1))
def test_the_lazy_gang_search_decides_as_the_spec(seed: int) -> None:
    rng = random.Random(seed)
    s, wanted = cluster(rng)
    view = s.view()
    seen = len(s.events())
    lazy, spec, checked = Fast(), PLAIN, Checked(Fast())
    now = s.now
    for _round in range(3):
        for name in wanted:
            cfg = _config(rng)
            avoid = rng.sample(sorted(view.inventory.names()), rng.randint(0, 1))
            want = plan(view, name, now, cfg, avoid=avoid)
            for engine in (lazy, spec, checked):
                assert plan(view, name, now, cfg, avoid=avoid, engine=engine) == want, seed
        seen = life_goes_on(rng, s, view, now, seen)
        _new_gangs(rng, s, view, _round)
        if _round == 1 and rng.random() < 0.5:
            # A declaration: the index builds its groups again (`Index.follow`).
            s.model(f"extra{_round}", cls="standard", min=0, profiles=["one:1"])
        for seq, subject, e in s.events()[seen:]:
            fold.apply(view, e, seq=seq, subject=subject)
        seen = len(s.events())
        now += timedelta(seconds=rng.choice([0, 30, 700]))


def _new_gangs(rng: random.Random, s: Scenario, view: View, round_: int) -> None:
    """Multi-node replicas placed on the GPUs free now, across domains or within one, and
    now and then one of them reported serving: gangs the index had not seen."""
    nodes = sorted(view.inventory.names())
    for m in view.catalog.models():
        p = m.profiles[0]
        if p.shards < 2 or not m.name.startswith("m") or rng.random() < 0.3:
            continue
        at = [n for n in nodes if len(view.inventory.free_gpus(n)) >= p.gpus]
        if len(at) < p.shards:
            continue
        on = [(n, view.inventory.free_gpus(n)[: p.gpus]) for n in rng.sample(at, p.shards)]
        rid = f"{m.name}-new{round_}"
        s.replica(rid, m.name, on=on, ready="-30m", used=rng.choice([None, "-2h"]))
        return


def test_one_index_asked_about_two_views_in_turn_decides_as_the_spec() -> None:
    """An index asked about another view starts again (`Index.follow`); what the lazy
    gang search read of the first view's gangs is not read for the second, nor for the
    first again after it."""
    index = Fast()
    cases: list[tuple[Scenario, View, list[str]]] = []
    seed = 0
    while len(cases) < 2:
        s, wanted = cluster(random.Random(seed))
        seed += 1
        v = s.view()
        if any(r.live and len(r.nodes) > 1 for r in v.replicas.values()):
            cases.append((s, v, wanted))
    for s, v, wanted in (*cases, *cases, *reversed(cases)):
        for name in wanted:
            for cfg in (NA1, NA3):
                assert plan(v, name, s.now, cfg, engine=index) == plan(v, name, s.now, cfg)


def test_a_gang_found_on_its_second_node_after_the_index_builds_again() -> None:
    """A gang whose stopping makes room only on its second node (its first holds a
    replica nobody may stop), asked about before and after declarations (one of them
    of the gang's model, whose replicas the index enters again; the view's journal
    unchanged) and after a new gang: the lazy gang search reads the gangs per node as
    they are now."""
    s = Scenario()
    for n in ("a", "b", "c", "d"):
        s.node(n, 8, labels={"nvlink_domain": "d1" if n in "ab" else "d2"})
    s.model("one", cls="critical", min=1, profiles=["one:8"])
    s.model("keep", cls="critical", min=2, profiles=["k:4"])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=["pp:4:2"])
    s.replica("g1", "batch", on=[("a", range(4)), ("b", range(4))], ready="-2h", used="-1h")
    s.replica("k1", "keep", on=("a", range(4, 8)), ready="-2h")
    s.replica("k2", "keep", on=("c", range(4)), ready="-2h")
    s.replica("k3", "keep", on=("d", range(4)), ready="-2h")
    v = s.view()
    index = Fast()
    seen = len(s.events())

    def asked() -> None:
        nonlocal seen
        for seq, subject, e in s.events()[seen:]:
            fold.apply(v, e, seq=seq, subject=subject)
        seen = len(s.events())
        want = plan(v, "one", s.now, NA1)
        assert plan(v, "one", s.now, NA1, engine=index) == want
        assert want.outcome == "preempted"

    asked()
    s.model("extra", cls="standard", min=0, profiles=["x:1"])
    asked()
    # The gangs' model declared again: its replicas are entered again (`Index.follow`).
    s.model("batch", cls="opportunistic", min=0, max=6, profiles=["pp:4:2"])
    asked()
    # k3 stops and a gang longer unused than g1 comes on c and d: it makes room on d
    # alone (c holds k2), and is the better set.
    s.state("k3", "stopped")
    s.replica("g2", "batch", on=[("c", range(4, 8)), ("d", range(4, 8))], ready="-4h", used="-3h")
    asked()
    assert [x.replica for x in plan(v, "one", s.now, NA1).victims] == ["g2"]


def test_a_candidate_past_its_groups_pool_is_no_set_of_it() -> None:
    """A domain with more candidates than the pool (`gangs.POOL`): the smallest, left
    out, would make room alone, and is still no set of the spec's; nor of the lazy
    search's."""
    s = Scenario()
    names = ["x", "y", "z1", "z2", "z3", "z4"]
    for n in names:
        s.node(n, 8, labels={"nvlink_domain": "D"})
    s.model("big", cls="critical", min=1, profiles=[ev.ProfileSpec(
        name="pp", gpus=4, shards=2, topology=ev.TopologySpec(level="nvlink_domain"))])  # fmt: skip
    s.model("small", cls="opportunistic", min=0, max=40, profiles=["s:1", "t:2"])
    s.replica("r", "small", on=("y", [0]), profile="s", ready="-4h", used="-3h")
    k = 0
    for n, gpus in (("x", [4, 5, 6, 7]), ("y", [4, 5, 6, 7])):
        for i in range(0, 4, 2):
            s.replica(f"t{k}", "small", on=(n, gpus[i : i + 2]), profile="t", ready="-4h", used="-2h")  # fmt: skip
            k += 1
    for n in names[2:]:
        for i in range(0, 8, 2):
            s.replica(f"t{k}", "small", on=(n, [i, i + 1]), profile="t", ready="-4h", used="-2h")  # fmt: skip
            k += 1
    v = s.view()
    m = v.catalog.resolve("big")
    assert m is not None
    a = rules.asker(v, m, s.now, NA1, frozenset(), False, True)
    cands = PLAIN.find(v, a).every()
    want_log, fits = _answers(0, 1.0)
    want = gangs.search(v, m.profiles, cands, 1, fits)
    assert len(want) == 1 and want[0].replica != "r" and want[0].node == "y"
    source = GangSlots(Fast().find(v, a))
    for src in (Listed(cands), source):
        got_log, fits = _answers(0, 1.0)
        got = gang_levels.search(v, m.profiles, src, 1, fits, Narrow(v, m.profiles, ()).domains)
        assert (got_log, list(got)) == (want_log, list(want))


NA1 = Config(policy="node-aware", max_victims=1)
NA3 = Config(policy="node-aware", max_victims=3)
