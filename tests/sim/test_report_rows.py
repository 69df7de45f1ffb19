"""The report's rows about gangs and wasted evictions, worked out again from the bundle.

Each run's bundle is folded again event by event (as replay folds it), and the rows are
counted from what that view holds and what the log says, apart from the engine's own
bookkeeping: partial gangs (replicas of several shards with some but not all running,
as replica-seconds), evictions whose model was not placed within the hold, and GPUs
freed beyond the need.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from schemas import bundle, subjects
from schemas import events as ev
from services.core.ingest import Ingest
from services.core.policy import Config, plan
from services.core.view import View
from services.sim import engine
from services.sim import scenario as scn
from tests.core.test_gangs import domains, pp
from tests.scenario import Scenario
from tests.sim.test_sim import _SHARDED

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
HOURS = 3600.0


def replayed(out: bytes, tmp: Path) -> Iterator[tuple[ev.Event, View]]:
    """Each event of a bundle with the view right after it was folded (the same view
    object, read at once by the caller's step)."""
    path = tmp / "run.jsonl"
    path.write_bytes(out)
    ing = Ingest(View(), subjects.DEFAULT_ROOT)
    for seq, subject, data in bundle.records(str(path)):
        e = ing.raw(seq, subject, data)
        if e is not None:
            yield e, ing.view


def partial_now(v: View) -> int:
    n = 0
    for r in v.state.replicas.values():
        if len(r.shards) < 2 or not r.holds_capacity:
            continue
        running = 0
        for sh in r.shards:
            u = v.inventory.usage(sh.node)
            rec = v.state.nodes.get(sh.node)
            if u is not None and r.id in u.held and rec is not None and not rec.lost:
                running += 1
        n += 0 < running < len(r.shards)
    return n


def test_partial_gangs_are_the_replica_seconds_the_view_shows_them(tmp_path: Path) -> None:
    sc = scn.parse(_SHARDED)
    out = io.BytesIO()
    r = engine.simulate(sc, "reference", duration_s=24 * HOURS, out=out)
    want, last, count = 0.0, None, 0
    for e, v in replayed(out.getvalue(), tmp_path):
        t = (e.time - engine.START).total_seconds()
        if last is not None:
            want += count * (t - last)
        last, count = t, partial_now(v)
    assert last is not None
    want += count * (r.duration_s - last)
    # A node lost under a gang leaves it partial for the grace (60 s), and only then.
    assert want > 0
    assert r.metrics.partial_gang_s == pytest.approx(want)


def test_evictions_whose_model_was_not_placed_are_counted_from_the_log(tmp_path: Path) -> None:
    # Its first day holds a decision whose model was placed only hours later.
    sc = scn.load(ROOT / "deploy/examples/sim/homogeneous.yaml")
    out = io.BytesIO()
    r = engine.simulate(sc, "node-aware", duration_s=24 * HOURS, out=out)
    hold = timedelta(seconds=Config().hold_s)
    decided: list[tuple[ev.PreemptionDecidedEvent, int]] = []
    placed: dict[str, list[ev.PlacementDecidedEvent]] = {}
    for e, _ in replayed(out.getvalue(), tmp_path):
        if isinstance(e, ev.PreemptionDecidedEvent) and e.data.outcome == "preempted":
            decided.append((e, len(e.data.victims)))
        elif isinstance(e, ev.PlacementDecidedEvent):
            placed.setdefault(e.data.model, []).append(e)
    end = engine.START + timedelta(seconds=r.duration_s)
    want = 0
    for d, n in decided:
        if d.time + hold >= end:
            continue  # its hold still on at the end
        if not any(d.time <= p.time <= d.time + hold for p in placed.get(d.data.for_model, [])):
            want += n
    assert want > 0
    assert r.metrics.evictions_unplaced == want


def test_gpus_freed_beyond_the_need_are_those_the_placement_does_not_take() -> None:
    # A one-node model of 8 GPUs takes one node of a two-node gang stopped whole: the
    # other node's 8 GPUs are freed beyond its need.
    s = domains(Scenario(), {"A": ["a1", "a2"]})
    s.model("one", cls="critical", min=1, profiles=["one:8"])
    s.model("batch", cls="opportunistic", min=0, max=4, profiles=[pp(2)])
    s.replica("g1", "batch", on=[("a1", range(8)), ("a2", range(8))], ready="-2h")
    v = s.view()
    d = plan(v, "one", s.now, Config(policy="node-aware"))
    assert d.outcome == "preempted" and d.placement is not None
    assert engine._freed_beyond(v, d) == 8
    # A two-node model in its place needs all 16.
    s.model("two", cls="critical", min=1, profiles=[pp(2)])
    d = plan(s.view(), "two", s.now, Config(policy="node-aware"))
    assert d.outcome == "preempted" and engine._freed_beyond(s.view(), d) == 0
