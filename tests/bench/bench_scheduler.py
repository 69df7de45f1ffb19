"""Benchmark: how many placement decisions per second the scheduler sustains; prints
figures, asserts nothing.

Run from the repository root: `python tests/bench/bench_scheduler.py [--replicas N]
[--rounds R]`. It starts an embedded nats-server on a temporary store, publishes a
200-node inventory (8 H100s each) directly, runs one `Scheduler` in this process, and:

- bulk: scales a one-GPU model from 0 to N and times scale.desired -> the Nth
  placement.decided seen on the bus (a core subscription), then scales to 0, reports the
  drained replicas stopped, and goes again: decisions per second, median over rounds;
- single: scales one more replica at a time: scale.desired -> its placement.decided,
  p50 and p99 latency;
- core: the pure pass (`plan`, which places on a cloned inventory) and the fold of what
  it decided, per decision, with no broker at all, for contrast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from nats.aio.msg import Msg

from schemas import codec, ids
from schemas import events as ev
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams
from services.core import fold
from services.core import scheduling as planner
from services.core.view import View
from services.scheduler import Scheduler, SchedulerConfig

NODES = 200
GPUS = 8
MODEL = "bench/llama-8b"

_n = 0


def _id() -> str:
    global _n
    _n += 1
    return ids.ulid(int(time.time() * 1000), _n.to_bytes(10, "big"))


def _make(data: ev.Data) -> ev.Event:
    return ev.make(data, id=_id(), time=datetime.now(UTC), source="bench")


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


def _declare(max_replicas: int) -> ev.Event:
    return _make(
        ev.ModelDeclared(
            name=MODEL,
            min=0,
            max=max_replicas,
            profiles=(ev.ProfileSpec(name="tp1", gpus=1, cpu_cores=4, memory_gb=32),),
        )
    )


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(round(p / 100 * (len(s) - 1)), len(s) - 1)]


# ------------------------------------------------------------------ core, no broker


def bench_core(n: int, rounds: int) -> tuple[float, float]:
    """Median µs per decision of the pure pass, and of folding what it decided."""
    plan_us, fold_us = [], []
    for _ in range(rounds):
        view = View()
        for i, e in enumerate(
            [*_inventory(), _declare(n), _make(ev.ScaleDesired(model=MODEL, replicas=n))], 1
        ):
            fold.apply(view, e, seq=i)
        t0 = time.perf_counter()
        out = planner.plan(view, datetime.now(UTC), SchedulerConfig())
        t1 = time.perf_counter()
        assert out.placed == n, out.placed
        seq = view.seq
        for o in out.outputs:
            seq += 1
            fold.apply(view, o.event, seq=seq)
        t2 = time.perf_counter()
        assert view.live_count(MODEL) == n
        plan_us.append((t1 - t0) / n * 1e6)
        fold_us.append((t2 - t1) / n * 1e6)
    return statistics.median(plan_us), statistics.median(fold_us)


# ------------------------------------------------------------------ through the broker


async def poll(cond: Callable[[], bool], within: float = 60.0, every: float = 0.01) -> None:
    deadline = time.perf_counter() + within
    while not cond():
        if time.perf_counter() > deadline:
            raise TimeoutError("benchmark condition not met")
        await asyncio.sleep(every)


async def bench_bus(url: str, n: int, rounds: int, singles: int) -> dict[str, list[float]]:
    nc = await connect(url, "bench")
    js = nc.jetstream()
    await ensure_streams(js)
    pub = Publisher(js)
    await pub.publish_many(_inventory())
    await pub.publish(_declare(max(n, singles)))

    seen: list[tuple[float, ev.PlacementDecided]] = []
    changed = asyncio.Event()

    async def on_decided(msg: Msg) -> None:
        e = codec.decode(msg.data)
        assert isinstance(e, ev.PlacementDecidedEvent)
        seen.append((time.perf_counter(), e.data))
        changed.set()

    sub = await nc.subscribe("llmgw.placement.decided.>", cb=on_decided)
    config = SchedulerConfig(tick_s=0.5, lease_ttl_s=5.0)
    sched = Scheduler(nc, js, config=config, holder="bench")
    stop = asyncio.Event()
    task = asyncio.create_task(sched.run(stop))
    await poll(lambda: sched.is_leader)

    async def until(count: int, within: float = 60.0) -> float:
        deadline = time.perf_counter() + within
        while len(seen) < count:
            changed.clear()
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"{len(seen)} of {count} placements seen")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
        return seen[count - 1][0]

    async def stop_all() -> None:
        """Scale to 0, wait for every drain to fold, report every replica stopped."""
        await pub.publish(_make(ev.ScaleDesired(model=MODEL, replicas=0)))
        await poll(
            lambda: (
                sched.view.live_count(MODEL) == 0 and sched.follower.seq >= sched.leader.own_last()
            )
        )
        states = [
            _make(
                ev.ReplicaState(
                    replica=r.id,
                    model=r.model,
                    profile=r.profile,
                    state="stopped",
                    shards=tuple(ev.ShardSpec(node=s.node, gpus=s.gpus) for s in r.shards),
                )
            )
            for r in list(sched.view.replicas.values())
            if r.holds_capacity
        ]
        acks = await pub.publish_many(states)
        if acks:
            await sched.follower.wait_for(acks[-1].seq, 30)

    out: dict[str, list[float]] = {"bulk_rate": [], "bulk_s": [], "single_ms": []}
    try:
        for _ in range(rounds):
            base = len(seen)
            t0 = time.perf_counter()
            await pub.publish(_make(ev.ScaleDesired(model=MODEL, replicas=n)))
            t_last = await until(base + n)
            out["bulk_s"].append(t_last - t0)
            out["bulk_rate"].append(n / (t_last - t0))
            await stop_all()
        for k in range(1, singles + 1):
            base = len(seen)
            t0 = time.perf_counter()
            await pub.publish(_make(ev.ScaleDesired(model=MODEL, replicas=k)))
            t1 = await until(base + 1)
            out["single_ms"].append((t1 - t0) * 1e3)
            await poll(lambda: sched.follower.seq >= sched.leader.own_last(), every=0.001)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await sub.unsubscribe()
        await nc.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=1000, help="replicas per bulk round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--singles", type=int, default=100, help="one-at-a-time scale-ups")
    args = p.parse_args()

    plan_us, fold_us = bench_core(args.replicas, args.rounds)
    print(f"cluster: {NODES} nodes x {GPUS} GPUs; model with one-GPU replicas")
    print(
        f"core  plan (place on a cloned inventory) {plan_us:7.1f} µs/decision "
        f"({1e6 / plan_us:,.0f}/s); fold of decided+start {fold_us:6.1f} µs/decision; "
        f"together {1e6 / (plan_us + fold_us):,.0f} decisions/s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp) / "broker")
        broker.start()
        try:
            got = asyncio.run(bench_bus(broker.url, args.replicas, args.rounds, args.singles))
        finally:
            broker.stop()
    rate = statistics.median(got["bulk_rate"])
    print(
        f"bus   scale.desired 0->{args.replicas} -> last placement.decided seen: "
        f"median {statistics.median(got['bulk_s']) * 1e3:.0f} ms over {args.rounds} rounds, "
        f"{rate:,.0f} decisions/s (each decision is placement.decided + replica.start)"
    )
    singles = got["single_ms"]
    print(
        f"bus   scale.desired +1 -> its placement.decided: p50 {pct(singles, 50):.1f} ms, "
        f"p99 {pct(singles, 99):.1f} ms over {len(singles)} scale-ups"
    )


if __name__ == "__main__":
    main()
