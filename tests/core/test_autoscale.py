"""Table tests for the autoscaler, one rule a case, named by the rule."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from schemas import events as ev
from schemas import ids, subjects
from services.core import autoscale, fold
from services.core.view import View

T0 = datetime(2026, 1, 1, 12, tzinfo=UTC)
SHARDS = (ev.ShardSpec(node="n1", gpus=(0,)),)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


class Log:
    def __init__(self) -> None:
        self.view = View()
        self.n = 0

    def add(self, data: ev.Data, s: float, source: str = "test", eid: str | None = None) -> str:
        self.n += 1
        eid = eid or ids.ulid(int(at(s).timestamp() * 1000), self.n.to_bytes(10, "big"))
        e = ev.make(data, id=eid, time=at(s), source=source)
        rej = fold.apply(self.view, e, seq=self.n, subject=subjects.subject_for(e, node="n1"))
        assert rej is None, rej.reason
        return eid

    def node(self) -> None:
        gpus = tuple(
            ev.GpuInfo(index=i, uuid=f"g{i}", model="H100", memory_gb=80) for i in range(8)
        )
        self.add(ev.NodeInventory(node="n1", gpus=gpus, cpu_cores=64, memory_gb=512), 0)

    def model(self, **kw: object) -> None:
        fields: dict[str, object] = {"min": 0, "max": 4, "idle_after_s": 600.0}
        fields.update(kw)
        self.add(
            ev.ModelDeclared(name="m", profiles=(ev.ProfileSpec(name="p", gpus=1),), **fields), 0
        )

    def demand(self, s: float, waiting: int, inflight: int = 0, since: float | None = None) -> str:
        d = ev.ModelDemanded(
            model="m", waiting=waiting, since=at(s if since is None else since), inflight=inflight
        )
        return self.add(d, s, "gateway")

    def scale(self, s: float, n: int, reason: str | None = None) -> str:
        src = "operator/me" if reason is None else "scheduler"
        return self.add(ev.ScaleDesired(model="m", replicas=n, reason=reason), s, src)

    def replica(self, s: float, rid: str = "r1", ready: float | None = None) -> None:
        self.add(
            ev.PlacementDecided(replica=rid, model="m", profile="p", shards=SHARDS, reason="x"), s
        )
        if ready is not None:
            self.add(
                ev.ReplicaState(replica=rid, model="m", profile="p", state="ready", shards=SHARDS),
                ready,
            )

    def used(self, s: float, rid: str = "r1") -> None:
        self.add(ev.ReplicaUsed(replica=rid, at=at(s), requests=3), s, "gateway")


def _log() -> Log:
    log = Log()
    log.node()
    log.model()
    return log


def woken(log: Log) -> None:
    """Demand at 10 s answered by the autoscaler's scale to 1, a replica ready at 60 s."""
    log.demand(10, 1)
    log.scale(11, 1, "demand: 1 waiting since 12:00:10")
    log.replica(11, ready=60)


Case = tuple[Callable[[Log], None], float, list[tuple[int, str]]]

CASES = [
    pytest.param(lambda log: None, 100, [], id="no demand: nothing"),
    pytest.param(
        lambda log: log.demand(10, 3, since=9),
        10,
        [(1, "demand: 3 waiting since 12:00:09")],
        id="demand: waiting at zero wakes it to one",
    ),
    pytest.param(
        lambda log: log.demand(10, 20, inflight=5),
        10,
        [(4, "demand: 20 waiting since 12:00:10, 5 in flight")],
        id="demand: more than target_inflight per replica wakes more, up to max",
    ),
    pytest.param(
        lambda log: (
            log.add(
                ev.ModelDeclared(
                    name="m",
                    min=0,
                    max=4,
                    target_inflight=4,
                    profiles=(ev.ProfileSpec(name="p", gpus=1),),
                ),
                0,
            ),
            log.demand(10, 9),
        ),
        10,
        [(3, "demand: 9 waiting since 12:00:10")],
        id="demand: target_inflight declared sizes it",
    ),
    pytest.param(
        lambda log: log.demand(10, 0),
        10,
        [],
        id="demand: nobody waiting wakes nothing",
    ),
    pytest.param(
        lambda log: (woken(log), log.demand(70, 30)),
        70,
        [(4, "demand: 30 waiting since 12:01:10")],
        id="demand: grows a model the autoscaler woke",
    ),
    pytest.param(
        lambda log: (woken(log), log.used(65), log.demand(70, 2)),
        70,
        [],
        id="demand: never shrinks for demand",
    ),
    pytest.param(
        lambda log: (log.demand(10, 1), log.scale(11, 1, "demand")),
        20,
        [],
        id="demand: answered by a scale, it wakes nothing again",
    ),
    pytest.param(
        lambda log: (log.scale(5, 2), log.replica(6, ready=30), log.demand(40, 50)),
        41,
        [],
        id="by hand: an operator's count is not raised for demand",
    ),
    pytest.param(
        lambda log: (log.scale(5, 0), log.demand(40, 2)),
        41,
        [(1, "demand: 2 waiting since 12:00:40")],
        id="by hand: an operator's zero is woken by demand",
    ),
    pytest.param(
        lambda log: (woken(log), log.used(100)),
        699,
        [],
        id="idle: used within idle_after_s stays",
    ),
    pytest.param(
        lambda log: (woken(log), log.used(100)),
        700,
        [(0, "idle 10m")],
        id="idle: no request for idle_after_s goes to zero",
    ),
    pytest.param(
        lambda log: woken(log),
        660,
        [(0, "idle 10m")],
        id="idle: never used counts from its first ready",
    ),
    pytest.param(
        lambda log: (log.demand(10, 1), log.scale(11, 1, "demand")),
        600,
        [],
        id="idle: a model still loading counts from its wake-up",
    ),
    pytest.param(
        lambda log: (log.scale(5, 2), log.replica(6, ready=30), log.used(50)),
        650,
        [(0, "idle 10m")],
        id="idle: an operator's count goes too once idle",
    ),
    pytest.param(
        lambda log: (log.scale(5, 2), log.replica(6, ready=30), log.used(50)),
        649,
        [],
        id="by hand: an operator's count kept until idle",
    ),
    pytest.param(
        lambda log: (woken(log), log.used(100), log.scale(700, 0, "idle 10m"), log.used(705)),
        2000,
        [],
        id="idle: at zero already, nothing",
    ),
    pytest.param(
        lambda log: (woken(log), log.used(100), log.scale(700, 0, "idle 10m")),
        701,
        [],
        id="idle: the demand that woke it does not wake it again",
    ),
    pytest.param(
        lambda log: (
            log.add(
                ev.ModelDeclared(
                    name="m", min=1, max=4, profiles=(ev.ProfileSpec(name="p", gpus=1),)
                ),
                0,
            )
            and log.demand(10, 5)
        ),
        5000,
        [],
        id="not on demand: a model with min above 0 is not the autoscaler's",
    ),
]


@pytest.mark.parametrize(("given", "now", "want"), CASES)
def test_autoscaler_rules(
    given: Callable[[Log], object], now: float, want: list[tuple[int, str]]
) -> None:
    log = _log()
    given(log)
    got = autoscale.decide(log.view, at(now))
    assert [(d.replicas, d.reason) for d in got.decisions] == want
    for d in got.decisions:
        e = d.event
        assert subjects.check(e, subjects.subject_for(e)) is None
        assert e.causation == d.trigger and e.time == at(now)


def test_a_decision_decided_twice_has_one_id() -> None:
    """A crash between deciding and publishing: decided again later, on the same log, it
    carries the same id, so the broker's duplicate window stores it once."""
    log = _log()
    q = log.demand(10, 3)
    first = autoscale.decide(log.view, at(10)).decisions[0].event
    again = autoscale.decide(log.view, at(12)).decisions[0].event
    assert first.id == again.id != q
    assert first.causation == q == first.correlation
    assert ids.kept_ms(first.id) == ids.kept_ms(q)
    woken(log)
    log.used(100)
    one = autoscale.decide(log.view, at(700)).decisions[0].event
    two = autoscale.decide(log.view, at(900)).decisions[0].event
    assert one.id == two.id


def test_next_due_is_when_the_first_awake_model_goes_idle() -> None:
    log = _log()
    assert autoscale.decide(log.view, at(5)).next_due is None
    woken(log)
    log.used(100)
    assert autoscale.decide(log.view, at(200)).next_due == at(700)


def test_an_alias_replica_counts_as_use() -> None:
    log = Log()
    log.node()
    log.add(
        ev.ModelDeclared(
            name="m",
            min=0,
            max=2,
            idle_after_s=60,
            aliases=("old",),
            profiles=(ev.ProfileSpec(name="p", gpus=1),),
        ),
        0,
    )
    log.scale(1, 1, "demand")
    log.add(
        ev.PlacementDecided(replica="r9", model="old", profile="p", shards=SHARDS, reason="x"), 2
    )
    log.used(100, "r9")
    assert autoscale.decide(log.view, at(150)).decisions == []
    assert [d.replicas for d in autoscale.decide(log.view, at(161)).decisions] == [0]


@pytest.mark.parametrize(
    ("seconds", "words"),
    [(45, "45s"), (900, "15m"), (90, "1m30s"), (3600, "1h"), (5400, "1h30m"), (86400, "1d")],
)
def test_span_words(seconds: float, words: str) -> None:
    assert autoscale.span(seconds) == words


def test_invariants_over_random_logs(rng) -> None:  # type: ignore[no-untyped-def]
    """Random demand, scales by hand and by the autoscaler, placements and uses over a few
    models: at every step `decide` stays within [0, max], never touches a model with a
    min, leaves the view as it was, decides the same twice, and what it decides, once
    folded, leaves it nothing more to decide at that time (the scheduler never loops)."""
    from services.core.view import digest

    rules: dict[str, int] = {}
    for _ in range(30):
        log = Log()
        log.node()
        for name, lo, hi in (("m", 0, 4), ("n", 0, 1), ("k", 1, 3)):
            log.add(
                ev.ModelDeclared(
                    name=name,
                    min=lo,
                    max=hi,
                    idle_after_s=float(rng.choice([5, 60, 600])),
                    target_inflight=rng.choice([None, 1, 3]),
                    profiles=(ev.ProfileSpec(name="p", gpus=1),),
                ),
                0,
            )
        t = 0.0
        placed = 0
        for _step in range(40):
            t += rng.choice([0.5, 3, 30, 400])
            name = rng.choice(["m", "n", "k"])
            what = rng.random()
            if what < 0.35:
                log.add(
                    ev.ModelDemanded(
                        model=name,
                        waiting=rng.randrange(0, 20),
                        since=at(t - 1),
                        inflight=rng.randrange(0, 5),
                    ),
                    t,
                    "gateway",
                )
            elif what < 0.45:
                log.add(ev.ScaleDesired(model=name, replicas=rng.randrange(0, 4)), t, "op")
            elif what < 0.6 and placed < 8:
                rid = f"r{placed}"
                shards = (ev.ShardSpec(node="n1", gpus=(placed,)),)
                log.add(
                    ev.PlacementDecided(
                        replica=rid, model=name, profile="p", shards=shards, reason="x"
                    ),
                    t,
                )
                placed += 1
            elif what < 0.8 and placed:
                log.add(ev.ReplicaUsed(replica=f"r{rng.randrange(placed)}", at=at(t)), t, "gw")
            now = at(t + rng.choice([0, 1, 100, 1000]))
            before = digest(log.view.state)
            got = autoscale.decide(log.view, now)
            assert digest(log.view.state) == before
            assert [d.event for d in autoscale.decide(log.view, now).decisions] == [
                d.event for d in got.decisions
            ]
            for d in got.decisions:
                rules[d.rule] = rules.get(d.rule, 0) + 1
                decl = log.view.state.models[d.model]
                assert decl.min == 0 and 0 <= d.replicas <= decl.effective_max
            for d in got.decisions:
                e = d.event
                log.n += 1
                assert fold.apply(log.view, e, seq=log.n, subject=subjects.subject_for(e)) is None
            assert autoscale.decide(log.view, now).decisions == []
    assert min(rules.get(r, 0) for r in autoscale.RULES) > 0, rules
