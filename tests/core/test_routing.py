"""The gateway's routing rule on a folded view (services.core.routing), pure: what is
routable, least in flight with ties to the one picked longest ago, sessions kept, and the
session map bounded; what it keeps of a replica forgotten once the replica leaves
routing for good; the route key's prompt read only when a rule asks."""

from __future__ import annotations

import json
import tracemalloc

import msgspec
import pytest

from schemas import events as ev
from services.core import routing
from tests.core.test_fold import MODEL, Log, at, inventory

pytestmark = pytest.mark.timeout(30)


def _ready(log: Log, rid: str, gpu: int, endpoint: str | None = "http://n1:1") -> None:
    shards = (ev.ShardSpec(node="n1", gpus=(gpu,)),)
    placed = ev.PlacementDecided(replica=rid, model="m", profile="p", shards=shards, reason="fit")
    assert log.add(placed) is None
    s = ev.ReplicaState(
        replica=rid,
        model="m",
        profile="p",
        state="ready",
        shards=(ev.ShardSpec(node="n1", gpus=(gpu,)),),
        endpoint=endpoint,
    )
    assert log.add(s) is None


def _log(n: int) -> Log:
    log = Log()
    assert log.add(msgspec.structs.replace(MODEL, aliases=("mm",))) is None
    assert log.add(inventory(gpus=8)) is None
    for i in range(n):
        _ready(log, f"r{i}", i)
    return log


def test_least_in_flight_then_least_recently_picked() -> None:
    log = _log(3)
    m = log.view.catalog.resolve("mm")
    assert m is not None
    router = routing.LeastInflight()
    picks = [router.pick(log.view, m) for _ in range(3)]
    assert [p.id for p in picks if p] == ["r0", "r1", "r2"]
    assert router.inflight == {"r0": 1, "r1": 1, "r2": 1}
    router.done("r1")
    assert (p := router.pick(log.view, m)) is not None and p.id == "r1"
    for r in ("r0", "r1", "r1", "r2"):
        router.done(r)
    assert router.inflight == {}
    # Ties go to the one picked longest ago: r0, then r2, then r1.
    order = []
    for _ in range(3):
        p = router.pick(log.view, m)
        assert p is not None
        order.append(p.id)
        router.done(p.id)
    assert order == ["r0", "r2", "r1"]


def test_only_ready_replicas_with_an_endpoint_and_no_drain_are_routable() -> None:
    log = _log(2)
    _ready(log, "r-noend", 2, endpoint=None)
    m = log.view.catalog.resolve("m")
    assert m is not None
    assert sorted(r.id for r in routing.candidates(log.view, m)) == ["r0", "r1"]
    assert log.add(ev.ReplicaDrain(replica="r0", model="m", reason="node_drain")) is None
    assert [r.id for r in routing.candidates(log.view, m)] == ["r1"]
    router = routing.LeastInflight()
    assert router.pick(log.view, m, avoid=("r1",)) is None


def test_a_session_stays_while_routable_and_the_map_is_bounded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    log = _log(2)
    m = log.view.catalog.resolve("m")
    assert m is not None
    router = routing.LeastInflight()
    first = router.pick(log.view, m, routing.Route("m", session="s"))
    assert first is not None
    router.done(first.id)
    for _ in range(3):
        p = router.pick(log.view, m, routing.Route("m", session="s"))
        assert p is not None and p.id == first.id
        router.done(p.id)
    assert log.add(ev.ReplicaDrain(replica=first.id, model="m", reason="scale_down")) is None
    moved = router.pick(log.view, m, routing.Route("m", session="s"))
    assert moved is not None and moved.id != first.id
    monkeypatch.setattr(routing, "SESSIONS", 10)
    for i in range(50):
        router.pick(log.view, m, routing.Route("m", session=f"u{i}"))
    assert len(router._sessions) == 10


def test_a_replica_at_its_admission_limit_is_not_picked() -> None:
    log = _log(2)
    m = log.view.catalog.resolve("m")
    assert m is not None
    # No target_inflight declared: the contract's default, times the factor.
    assert routing.admit_limit(log.view, m) == ev.DEFAULT_TARGET_INFLIGHT * routing.INFLIGHT_FACTOR
    assert log.add(msgspec.structs.replace(MODEL, aliases=("mm",), target_inflight=1)) is None
    m = log.view.catalog.resolve("m")
    assert m is not None
    limit = routing.admit_limit(log.view, m)
    assert limit == 2
    router = routing.LeastInflight()
    picks = [
        router.pick(log.view, m, routing.Route("m", session="s"), limit=limit) for _ in range(4)
    ]
    assert sorted(p.id for p in picks if p) == ["r0", "r0", "r1", "r1"]
    # Both full: none, the session's own replica included.
    assert router.pick(log.view, m, routing.Route("m", session="s"), limit=limit) is None
    router.done("r1")
    assert (
        p := router.pick(log.view, m, routing.Route("m", session="s"), limit=limit)
    ) is not None and p.id == "r1"


class _Plane:
    """A log folded event by event, with a router told what left routing after each
    event, as the gateway tells it (`Gateway._on_fold`)."""

    def __init__(self) -> None:
        self.log = Log()
        self.router = routing.LeastInflight()
        self.nodes = 0

    def say(self, data: ev.Data, node: str = "n1") -> None:
        assert self.log.add(data, node=node) is None, self.log.rejections[-1]
        e = ev.make(data, id=f"e{self.log.seq}", time=at(0), source="test")
        self.router.forget(routing.leaving(self.log.view, e, self.router.kept()))

    def cycle(self, i: int) -> None:
        """Replica `r{i}` placed, ready, picked, and gone by one of the five ways out."""
        rid, way = f"r{i}", i % 5
        node = "n1"
        if way in (2, 3):  # on a node of its own, which goes with it
            self.nodes += 1
            node = f"x{self.nodes}"
            self.say(inventory(node, gpus=2), node=node)
        shards = (ev.ShardSpec(node=node, gpus=(0, 1)),)
        placed = ev.PlacementDecided(replica=rid, model="m", profile="p", shards=shards, reason="")
        self.say(placed)
        self.say(_state(rid, "ready", shards), node=node)
        m = self.log.view.catalog.resolve("m")
        assert m is not None
        r = self.router.pick(self.log.view, m)
        assert r is not None and r.id == rid
        self.router.done(rid)
        if way == 0:  # drained, then stopped
            self.say(ev.ReplicaDrain(replica=rid, model="m", reason="scale_down"), node=node)
            self.say(_state(rid, "stopped", shards), node=node)
        elif way == 1:  # failed
            self.say(_state(rid, "failed", shards), node=node)
        elif way == 2:  # its node lost, past any grace
            self.say(ev.NodeLost(node=node, reason="no heartbeat"))
        elif way == 3:  # its node removed
            self.say(ev.NodeRemoved(node=node, reason="decommissioned"))
        else:  # its model removed (the plane drains what it had), and declared again
            self.say(ev.ModelRemoved(name="m"))
            self.say(ev.ReplicaDrain(replica=rid, model="m", reason="model_removed"), node=node)
            self.say(_state(rid, "stopped", shards), node=node)
            self.say(MODEL)

    def kept(self) -> int:
        """Entries in the router's own maps."""
        r = self.router
        return len(r._picked) + len(r.inflight) + len(r._sessions)


def _state(
    rid: str, state: ev.ReplicaStateName, shards: tuple[ev.ShardSpec, ...]
) -> ev.ReplicaState:
    endpoint = "http://n1:1" if state == "ready" else None
    return ev.ReplicaState(
        replica=rid,
        model="m",
        profile="p",
        state=state,
        shards=shards,
        endpoint=endpoint,
    )


def _routing_bytes() -> int:
    """What is allocated now by the lines of services.core.routing."""
    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, routing.__file__)])
    return sum(s.size for s in snap.statistics("filename"))


@pytest.mark.timeout(180)
def test_the_router_forgets_every_replica_that_leaves_routing_memory_flat_over_100k() -> None:
    """100,000 replicas come and go, each picked once and gone by one of the ways a
    replica leaves routing for good: drained and stopped, failed, its node lost, its
    node removed, its model removed (and drained). What the router keeps of them stays
    at the one replica alive; what routing's own lines hold does not grow over the last
    10,000."""
    p = _Plane()
    p.say(MODEL)
    p.say(inventory(gpus=8))
    for i in range(90_000):
        p.cycle(i)
        assert p.kept() == 0, (i, p.router)
    tracemalloc.start()
    try:
        before = _routing_bytes()
        for i in range(90_000, 100_000):
            p.cycle(i)
        grown = _routing_bytes() - before
    finally:
        tracemalloc.stop()
    assert p.kept() == 0
    # An entry a replica would be ~100 bytes a replica here: 1 MB over these 10,000.
    assert grown < 16 * 1024, grown


def test_the_router_keeps_a_replica_while_it_may_serve() -> None:
    """A node lost within its grace, or a model removed before its replicas are drained,
    takes nothing out for good: the replica is kept (it may serve again)."""
    p = _Plane()
    p.say(MODEL)
    p.say(inventory(gpus=8))
    shards = (ev.ShardSpec(node="n1", gpus=(0, 1)),)
    p.say(ev.PlacementDecided(replica="k1", model="m", profile="p", shards=shards, reason=""))
    p.say(_state("k1", "ready", shards))
    m = p.log.view.catalog.resolve("m")
    assert m is not None and p.router.pick(p.log.view, m) is not None
    p.say(ev.NodeLost(node="n1", reason="no heartbeat", grace_s=60))
    p.say(ev.ModelRemoved(name="m"))
    assert list(p.router.kept()) == ["k1"] and p.router.inflight == {"k1": 1}
    p.say(_state("k1", "failed", shards))
    assert list(p.router.kept()) == [] and p.router.inflight == {"k1": 1}
    p.router.done("k1")
    assert p.kept() == 0


def test_a_route_reads_the_prompt_only_when_asked_and_canonically() -> None:
    """The plain rule never reads a request's prompt; a rule that asks gets it once, the
    same text whatever the JSON's spacing or key order."""
    log = _log(2)
    m = log.view.catalog.resolve("m")
    assert m is not None
    body = b'{"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"content": [{"type": "text", "text": "hi"}], "role": "user"}], "cache_salt": "s1"}'
    route = routing.Route("m", body=body)
    assert routing.LeastInflight().pick(log.view, m, route) is not None
    assert route._read is False
    again = routing.Route("m", body=json.dumps(json.loads(body), indent=2).encode())
    assert route.prompt == again.prompt == "system\x1fbe brief\x1euser\x1fhi"
    assert route.salt == "s1" and route.leading(6) == "system"
    completion = routing.Route("m", body=b'{"model": "m", "prompt": ["once upon", "a time"]}')
    assert completion.prompt == "once upon\x1ea time"
    tokens = routing.Route("m", body=b'{"model": "m", "prompt": [1, 2, 3]}')
    assert tokens.prompt == "1 2 3"
    assert routing.Route("m", body=b'{"model": "m", "input": "x"}').prompt == ""


@pytest.mark.parametrize("seed", range(5))
def test_the_routable_replicas_kept_between_folds_are_always_what_the_view_says(
    seed: int,
) -> None:
    """`LeastInflight.routable_of` keeps a model's routable replicas until the view
    folds another event: after every event of a random history (replicas placed, ready,
    drained, failed; nodes cordoned and uncordoned, lost and found, their address
    changed), what it answers is `candidates` worked out afresh, a new view object is
    not taken for the old one, and no pick goes elsewhere."""
    import random

    rng = random.Random(seed)
    log = Log()
    assert log.add(msgspec.structs.replace(MODEL, aliases=("mm",))) is None
    nodes = ("n1", "n2")
    for n in nodes:
        assert log.add(inventory(n, gpus=8), node=n) is None
    router = routing.LeastInflight()
    shards: dict[str, tuple[ev.ShardSpec, ...]] = {}
    free = {n: list(range(8)) for n in nodes}
    for step in range(400):
        op = rng.randrange(6)
        n = rng.choice(nodes)
        if op == 0 and free[n]:
            rid = f"r{step}"
            shards[rid] = (ev.ShardSpec(node=n, gpus=(free[n].pop(),)),)
            placed = ev.PlacementDecided(
                replica=rid, model="m", profile="p", shards=shards[rid], reason="fit"
            )
            log.add(placed, node=n)
            ready = ev.ReplicaState(
                replica=rid,
                model="m",
                profile="p",
                state="ready",
                shards=shards[rid],
                endpoint=f"http://{n}:{step + 1000}",
            )
            log.add(ready, node=n)
        elif op == 1 and shards:
            rid = rng.choice(sorted(shards))
            log.add(ev.ReplicaDrain(replica=rid, model="m", reason="scale_down"))
        elif op == 2 and shards:
            rid = rng.choice(sorted(shards))
            node = shards[rid][0].node
            log.add(_state(rid, "failed", shards[rid]), node=node)
        elif op == 3:
            log.add(ev.NodeCordoned(node=n) if rng.random() < 0.5 else ev.NodeUncordoned(node=n))
        elif op == 4:
            if rng.random() < 0.3:
                log.add(ev.NodeLost(node=n, reason="no heartbeat"))
            else:
                log.add(ev.NodeFound(node=n), node=n)
        else:
            address = rng.choice(("", n, "elsewhere"))
            again = msgspec.structs.replace(inventory(n, gpus=8), address=address)
            log.add(again, node=n)
        m = log.view.catalog.resolve("mm")
        assert m is not None
        want = [r.id for r in routing.candidates(log.view, m)]
        assert [r.id for r in router.routable_of(log.view, m)] == want, (seed, step)
        picked = router.pick(log.view, m)
        assert (picked is None) == (not want) and (picked is None or picked.id in want)
        if picked is not None:
            router.done(picked.id)
        if step % 50 == 0:
            copy = log.view.copy()
            assert [r.id for r in router.routable_of(copy, m)] == want
