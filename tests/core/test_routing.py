"""The gateway's routing rule on a folded view (services.core.routing), pure: what is
routable, least in flight with ties to the one picked longest ago, sessions kept, and the
session map bounded."""

from __future__ import annotations

import msgspec

from schemas import events as ev
from services.core import routing
from tests.core.test_fold import MODEL, Log, inventory


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
