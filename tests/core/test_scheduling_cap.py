"""One pass decides at most `max_placements_per_pass` placements; the rest follow in the
next passes. A scale-up of thousands decided at once could outlast the leader's lease,
which throws the pass away, again and again."""

from __future__ import annotations

import dataclasses

from schemas import events as ev
from tests.core.test_scheduling_backoff import CONFIG, T0, Sim


def test_a_large_scale_up_is_placed_over_several_short_passes() -> None:
    config = dataclasses.replace(CONFIG, max_placements_per_pass=40)
    sim = Sim(config)
    for i in range(20):
        sim.node(f"gpu-{i}")
    p = ev.ProfileSpec(name="p", gpus=1)
    sim.add(ev.ModelDeclared(name="m", min=0, max=150, profiles=(p,)), T0)
    sim.add(ev.ScaleDesired(model="m", replicas=150), T0)
    placed = [out.placed for _, out in sim.run(6)]
    assert placed[:5] == [40, 40, 40, 30, 0]
    assert sim.count(ev.PlacementFailedEvent) == 0
    assert sim.count(ev.ReplicaStartEvent) == 150
