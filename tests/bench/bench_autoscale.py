"""Benchmark: how soon a demand becomes a scale; prints figures, asserts nothing.

Run from the repository root: `python tests/bench/bench_autoscale.py [--models N]
[--wakes W]`. It starts an embedded nats-server on a temporary store, publishes a
200-node inventory and N on-demand models (min 0), runs one `Scheduler` in this
process, and:

- bus: publishes one `model.demanded` at a time for a model at zero and times the
  publish -> the autoscaler's `scale.desired` for it seen on the bus (a core
  subscription), p50 and p99 over W wake-ups (each a model of its own, woken once);
- core: `autoscale.decide` on a view of those N models, most asleep and some awake,
  with no broker at all: what it adds to each scheduler pass.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from nats.aio.msg import Msg

from schemas import codec, ids, subjects
from schemas import events as ev
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams
from services.core import autoscale, fold
from services.core.view import View
from services.scheduler import Scheduler, SchedulerConfig

NODES = 200
GPUS = 8

_n = 0


def _id() -> str:
    global _n
    _n += 1
    return ids.ulid(int(time.time() * 1000), _n.to_bytes(10, "big"))


def _make(data: ev.Data, t: datetime | None = None) -> ev.Event:
    return ev.make(data, id=_id(), time=t or datetime.now(UTC), source="bench")


def _inventory() -> list[ev.Event]:
    return [
        _make(
            ev.NodeInventory(
                node=f"gpu-{n:03d}",
                gpus=tuple(
                    ev.GpuInfo(index=i, uuid=f"GPU-{n}-{i}", model="NVIDIA H100 80GB", memory_gb=80)
                    for i in range(GPUS)
                ),
                cpu_cores=128,
                memory_gb=1024,
            )
        )
        for n in range(NODES)
    ]


def _models(n: int) -> list[ev.Event]:
    return [
        _make(
            ev.ModelDeclared(
                name=f"od-{i:04d}",
                cls=("critical", "standard", "opportunistic")[i % 3],
                min=0,
                max=4,
                profiles=(ev.ProfileSpec(name="tp1", gpus=1),),
            )
        )
        for i in range(n)
    ]


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(round(p / 100 * (len(s) - 1)), len(s) - 1)]


# ------------------------------------------------------------------ core, no broker


def bench_core(n: int, awake: int, rounds: int) -> float:
    """Median µs of one `decide` on a view of `n` on-demand models, `awake` of them
    woken and used lately (the idle rule reads their replicas), the rest asleep."""
    view = View()
    t0 = datetime.now(UTC)
    events = [*_inventory(), *_models(n)]
    for i in range(awake):
        name = f"od-{i:04d}"
        events.append(_make(ev.ScaleDesired(model=name, replicas=1, reason="demand"), t0))
        events.append(
            _make(
                ev.PlacementDecided(
                    replica=f"r-{i}",
                    model=name,
                    profile="tp1",
                    shards=(ev.ShardSpec(node=f"gpu-{i // GPUS:03d}", gpus=(i % GPUS,)),),
                    reason="bench",
                ),
                t0,
            )
        )
        events.append(_make(ev.ReplicaUsed(replica=f"r-{i}", at=t0, requests=1), t0))
    for seq, e in enumerate(events, 1):
        fold.apply(view, e, seq=seq)
    now = t0 + timedelta(seconds=60)
    took = []
    for _ in range(rounds):
        t = time.perf_counter()
        out = autoscale.decide(view, now)
        took.append((time.perf_counter() - t) * 1e6)
        assert not out.decisions and (out.next_due is None) == (awake == 0)
    return statistics.median(took)


# ------------------------------------------------------------------ through the broker


async def poll(cond, within: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.perf_counter() + within
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError("benchmark condition not met")
        await asyncio.sleep(0.01)


async def bench_bus(url: str, n: int, wakes: int) -> list[float]:
    nc = await connect(url, "bench")
    js = nc.jetstream()
    await ensure_streams(js)
    pub = Publisher(js)
    await pub.publish_many(_inventory())
    await pub.publish_many(_models(n))

    seen: dict[str, float] = {}
    got = asyncio.Event()

    async def on_scale(msg: Msg) -> None:
        e = codec.decode(msg.data)
        if isinstance(e, ev.ScaleDesiredEvent) and e.data.reason:
            seen.setdefault(e.data.model, time.perf_counter())
            got.set()

    sub = await nc.subscribe(f"{subjects.DEFAULT_ROOT}.catalog.scale.*", cb=on_scale)
    sched = Scheduler(nc, js, config=SchedulerConfig(tick_s=0.5, lease_ttl_s=5.0), holder="bench")
    stop = asyncio.Event()
    task = asyncio.create_task(sched.run(stop))
    await poll(lambda: sched.is_leader)
    await sched.follower.caught_up(30)
    out: list[float] = []
    try:
        for i in range(min(wakes, n)):
            name = f"od-{i:04d}"
            got.clear()
            now = datetime.now(UTC)
            t0 = time.perf_counter()
            await pub.publish(_make(ev.ModelDemanded(model=name, waiting=1, since=now), now))
            while name not in seen:
                await asyncio.wait_for(got.wait(), 30)
                got.clear()
            out.append((seen[name] - t0) * 1e3)
            # The placement it makes due, folded before the next demand.
            await poll(lambda: sched.follower.seq >= sched.leader.own_last())
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await sub.unsubscribe()
        await nc.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=500, help="on-demand models declared")
    p.add_argument("--wakes", type=int, default=200, help="demands, one model each")
    p.add_argument("--rounds", type=int, default=200, help="core: decide calls timed")
    args = p.parse_args()

    for awake in (0, 100, args.models):
        us = bench_core(args.models, min(awake, args.models), args.rounds)
        print(
            f"core  autoscale.decide, {args.models} on-demand models, {awake} awake: "
            f"median {us:,.0f} µs"
        )
    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp) / "broker")
        broker.start()
        try:
            ms = asyncio.run(bench_bus(broker.url, args.models, args.wakes))
        finally:
            broker.stop()
    print(
        f"bus   model.demanded published -> the autoscaler's scale.desired seen: "
        f"p50 {pct(ms, 50):.1f} ms, p99 {pct(ms, 99):.1f} ms, max {max(ms):.1f} ms "
        f"over {len(ms)} wake-ups ({args.models} models, {NODES} nodes x {GPUS} GPUs)"
    )


if __name__ == "__main__":
    main()
