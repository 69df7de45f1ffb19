"""`View.off_target` splits the declared models as `desired_of` and `live_of` do, model
by model: random runs declare, re-declare (with aliases that come and go) and remove
models, scale them and start and stop their replicas under their names and aliases, and
after every event the split must be the plain one. What it keeps of a catalog (the rows
by `by_rank`) must never outlive a change of the models, on a view or a copy of it."""

from __future__ import annotations

import random
from datetime import UTC, datetime

from schemas import events as ev
from services.core import catalog, fold
from services.core.view import View
from tests.scenario import stopped

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
NAMES = ("a", "b", "c", "d", "e")


def _plain(view: View) -> tuple[list[str], list[tuple[int, catalog.Model, int, int]]]:
    on: list[str] = []
    off: list[tuple[int, catalog.Model, int, int]] = []
    for m in view.catalog.by_rank():
        live, desired = view.live_of(m), view.desired_of(m)
        if live == desired:
            on.append(m.name)
        else:
            off.append((len(on), m, live, desired))
    return on, off


class Run:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.view = View()
        self.n = 0
        gpus = tuple(
            ev.GpuInfo(index=i, uuid=f"n-{i}", model="H100", memory_gb=80) for i in range(64)
        )
        self.add(ev.NodeInventory(node="n", gpus=gpus, cpu_cores=512, memory_gb=4096))
        self.free = list(range(64))

    def add(self, data: ev.Data) -> None:
        """Fold `data`; one the fold refuses (a model removed that is not declared, a
        replica stopped that the view has seen stop) changes nothing, as intended."""
        self.n += 1
        e = ev.make(data, id=f"t{self.n:06d}", time=T0, source="test")
        fold.apply(self.view, e, seq=self.n)

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        if roll < 0.2:
            name = rng.choice(NAMES)
            aliases = tuple(rng.sample([*NAMES, "x", "y"], rng.randint(0, 3)))
            lo = rng.randint(0, 3)
            self.add(
                ev.ModelDeclared(
                    name=name,
                    owner="o",
                    min=lo,
                    max=rng.choice((max(lo, 1), lo, lo + 2)),
                    aliases=tuple(a for a in aliases if a != name),
                    profiles=(ev.ProfileSpec(name="p", gpus=1),),
                )
            )
        elif roll < 0.27:
            declared = sorted(self.view.state.models)
            if declared:
                self.add(ev.ModelRemoved(name=rng.choice(declared)))
        elif roll < 0.45:
            self.add(ev.ScaleDesired(model=rng.choice([*NAMES, "x"]), replicas=rng.randint(0, 6)))
        elif roll < 0.75 and self.free:
            gpu = self.free.pop(rng.randrange(len(self.free)))
            model = rng.choice([*NAMES, "x", "y"])
            self.add(
                ev.ReplicaState(
                    replica=f"r{self.n}",
                    model=model,
                    profile="p",
                    state=rng.choice(("starting", "ready")),
                    shards=(ev.ShardSpec(node="n", gpus=(gpu,)),),
                )
            )
        else:
            live = [r for r in self.view.replicas.values() if r.live]
            if live:
                r = rng.choice(live)
                self.add(stopped(r))
                self.free.extend(s for sh in r.shards for s in sh.gpus)


def test_off_target_splits_the_models_as_the_plain_counts_do() -> None:
    for seed in range(12):
        run = Run(seed)
        copies: list[View] = []
        for i in range(400):
            run.step()
            assert run.view.off_target() == _plain(run.view)
            # Now and then a copy made earlier, or the view's latest copy: what is kept
            # of the last call must hold for whichever view asks next.
            if i % 50 == 0:
                copies.append(run.view.copy())
            if i % 7 == 0:
                for c in copies:
                    assert c.off_target() == _plain(c)
