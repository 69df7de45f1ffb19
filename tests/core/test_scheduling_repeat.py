"""A pass decides the same with what the scheduler keeps between passes as without it:
random runs (nodes that come, go and refuse starts, models scaled up past what fits,
quotas that bind) are planned twice at every tick, once as the scheduler does (with its
`Memo`) and once with none, and the two plans must be equal, output
for output. The ids a pass derives are those `schemas.ids` derives."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from schemas import events as ev
from services.core import fold
from services.core import scheduling as planner
from services.core.view import View
from tests.scenario import stopped

pytestmark = pytest.mark.timeout(60)

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)


def _plain(p: planner.Plan) -> tuple[object, ...]:
    return (
        [(o.event, o.node, o.failure) for o in p.outputs],
        p.placed,
        p.failed,
        p.drained,
        p.lost,
        p.satisfied,
    )


class Run:
    def __init__(self, seed: int, quota: bool) -> None:
        self.rng = random.Random(seed)
        self.view = View()
        self.memory: dict[str, planner.Failure] = {}
        self.memo = planner.Memo()
        self.config = planner.Config(failed_backoff_s=3.0, failed_quiet_s=1.0)
        self.n = 0
        self.nodes = [f"n{i}" for i in range(5)]
        self.refusing: set[str] = set()
        for name in self.nodes:
            self.node(name, T0)
        for i in range(6):
            gpus = (1, 2, 4, 8, 16)[i % 5]
            p = ev.ProfileSpec(name=f"p{gpus}", gpus=gpus)
            small = ev.ProfileSpec(name="p1", gpus=1)
            profiles = (p, small) if i == 5 else (p,)
            self.add(
                ev.ModelDeclared(name=f"m{i}", owner=f"o{i % 2}", min=1, max=30, profiles=profiles),
                T0,
            )
        if quota:
            limit = ev.Resources(gpus=12)
            owners = (ev.OwnerQuota(name="o0", limit=limit), ev.OwnerQuota(name="o1"))
            self.add(ev.QuotaSet(owners=owners), T0)

    def add(self, data: ev.Data, at: datetime) -> None:
        self.n += 1
        e = ev.make(data, id=f"t{self.n:06d}", time=at, source="test")
        assert fold.apply(self.view, e, seq=self.n) is None

    def node(self, name: str, at: datetime) -> None:
        gpus = tuple(
            ev.GpuInfo(index=i, uuid=f"{name}-{i}", model="H100", memory_gb=80) for i in range(8)
        )
        self.add(ev.NodeInventory(node=name, gpus=gpus, cpu_cores=64, memory_gb=512), at)

    def churn(self, now: datetime) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:
            self.add(ev.ScaleDesired(model=f"m{rng.randrange(6)}", replicas=rng.randint(0, 8)), now)
        elif roll < 0.32:
            self.add(ev.NodeLost(node=rng.choice(self.nodes), reason="test"), now)
        elif roll < 0.4:
            self.node(rng.choice(self.nodes), now)
        elif roll < 0.45:
            node = rng.choice(self.nodes)
            self.refusing ^= {node}
        elif roll < 0.55:
            live = [r for r in self.view.replicas.values() if r.live]
            if live:
                r = rng.choice(live)
                self.add(
                    stopped(r),
                    now,
                )

    def tick(self, now: datetime) -> planner.Plan:
        kept = planner.plan(self.view, now, self.config, failures=self.memory, memo=self.memo)
        fresh = planner.plan(self.view, now, self.config, failures=self.memory)
        assert _plain(kept) == _plain(fresh)
        for o in kept.outputs:
            self.add_event(o.event)
            if o.failure is not None:
                self.memory[o.failure[0]] = o.failure[1]
        self.memory = planner.remember(self.memory, kept.satisfied, now, self.config)
        later = now + timedelta(seconds=0.5)
        for o in kept.outputs:
            if isinstance(o.event, ev.ReplicaStartEvent) and o.node is not None:
                d = o.event.data
                refused = o.node in self.refusing
                self.add(
                    ev.ReplicaState(
                        replica=d.replica,
                        model=d.model,
                        profile=d.profile,
                        state="failed" if refused else "ready",
                        shards=d.shards,
                        reason="simulated: start refused" if refused else None,
                    ),
                    later,
                )
        return kept

    def add_event(self, e: ev.Event) -> None:
        self.n += 1
        assert fold.apply(self.view, e, seq=self.n) is None


@pytest.mark.parametrize("seed", range(6))
def test_a_pass_decides_the_same_with_its_memos_as_without(seed: int) -> None:
    run = Run(seed, quota=seed % 2 == 1)
    failed = placed = 0
    for t in range(240):
        now = T0 + timedelta(seconds=t)
        if t % 2 == 0:
            run.churn(now)
        p = run.tick(now)
        failed += p.failed
        placed += p.placed
    assert failed > 5 and placed > 5


def test_the_failure_memory_keeps_what_the_plain_rule_keeps() -> None:
    """`remember` keeps the memory whole when its oldest failure is young enough; what it
    keeps is what working out each failure's age keeps, at the edge of the period too."""
    rng = random.Random(5)
    config = planner.Config(failed_backoff_max_s=rng.choice((1.5, 60.0)), failed_quiet_s=1.0)
    keep = 2 * max(config.failed_backoff_max_s, config.failed_quiet_s)
    now = T0 + timedelta(hours=1)
    for _ in range(2000):
        failures = {}
        for i in range(rng.randint(0, 6)):
            age = rng.choice((keep, keep - 1e-6, keep + 1e-6, rng.uniform(0, 2 * keep)))
            at = now - timedelta(seconds=age)
            failures[f"m{i}"] = planner.Failure(rng.choice(("", "d")), at, rng.randint(0, 3))
        satisfied = rng.sample(sorted(failures), rng.randint(0, len(failures)))
        want = {m: f for m, f in failures.items() if (now - f.at).total_seconds() < keep}
        for m in satisfied:
            f = want.get(m)
            if f is not None and f.digest:
                want[m] = f.cleared()
        assert planner.remember(failures, satisfied, now, config) == want
