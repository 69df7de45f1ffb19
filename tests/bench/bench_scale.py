"""Benchmark: the control plane at 10,000 nodes in steady state and under churn; prints
figures, asserts nothing.

Run from the repository root: `python tests/bench/bench_scale.py [--nodes N]
[--steady S] [--churn S]`. It starts an embedded nats-server on a temporary store and
`llmgw up`'s services against it (scheduler, preemption service, projector: the code
`services.up` runs), and a fleet of N simulated nodes in this process. The fleet is one
connection, not N agents: it sends every node's inventory, every node's heartbeat each
`--heartbeat` seconds (core NATS, as agents do), answers each `replica.start` with
starting -> ready and each `replica.drain` with draining -> stopped, and reports each
ready replica's use every `--used-interval` seconds (`replica.used`, stored): the load a
real fleet puts on the control plane, without N consumers of its own.

Phases:
- fill: models at tp8 (one replica per node) scaled to `--fill` of the nodes, by
  `--fill-step` replicas at a time: how long until every replica is ready;
- steady: nothing changes but heartbeats and use reports: stored events per second, the
  projector's lag (events behind the stream's end, sampled, and the time from a probe's
  ack to the projector's commit), the scheduler's decision latency (scale one probe
  model by one: scale.desired acked -> placement.decided seen);
- churn: a model scaled up and down by `--churn-step` replicas every 5 s, same figures;
- preempt (`--preempt N`, default 20): every node left free is given a replica of an
  opportunistic filler model, then N critical models are declared and scaled to one, one
  after another: none fits, so each `placement.failed` is answered by the preemption
  service's decision and a `replica.drain` of a filler replica: the time from the
  placement.failed on the bus to that drain on the bus, p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from schemas import codec, ids, subjects
from schemas import events as ev
from services.bus import EmbeddedBroker, Publisher, connect
from services.core.policy import Config as PolicyConfig
from services.core.scheduling import Config as SchedulerConfig
from services.up import Running, UpOptions, run

GPUS = 8
MODELS = ("llama-70b", "mixtral-8x22b", "qwen-72b", "deepseek-67b")
PROBE = "probe-8b"
CHURN = "churn-70b"
FILLER = "filler-8b"

_n = 0
_json = msgspec.json.Encoder()


def _id() -> str:
    global _n
    _n += 1
    return ids.ulid(int(time.time() * 1000), _n.to_bytes(10, "big"))


def _make(data: ev.Data, causation: str | None = None, eid: str | None = None) -> ev.Event:
    return ev.make(
        data, id=eid or _id(), time=datetime.now(UTC), source="bench", causation=causation
    )


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(round(p / 100 * (len(s) - 1)), len(s) - 1)]


class Fleet:
    """N simulated nodes on one connection (see the module docstring)."""

    def __init__(self, nc, js, nodes: int, heartbeat_s: float, used_s: float) -> None:  # type: ignore[no-untyped-def]
        self.nc, self.pub = nc, Publisher(js)
        self.names = [f"gpu-{i:05d}" for i in range(nodes)]
        self.heartbeat_s, self.used_s = heartbeat_s, used_s
        self.ready: dict[str, tuple[str, str, tuple[ev.ShardSpec, ...], str]] = {}
        self.queue: asyncio.Queue[ev.Event] = asyncio.Queue()
        self.stored = 0

    def inventory(self) -> list[ev.Event]:
        return [
            _make(
                ev.NodeInventory(
                    node=n,
                    gpus=tuple(
                        ev.GpuInfo(
                            index=i, uuid=f"GPU-{n}-{i}", model="NVIDIA H100 80GB", memory_gb=80
                        )
                        for i in range(GPUS)
                    ),
                    cpu_cores=128,
                    memory_gb=2048,
                )
            )
            for n in self.names
        ]

    async def on_command(self, msg: Msg) -> None:
        e = codec.decode(msg.data)
        if isinstance(e, ev.ReplicaStartEvent):
            c = e.data
            for state in ("starting", "ready"):
                self.queue.put_nowait(
                    _make(
                        ev.ReplicaState(
                            replica=c.replica,
                            model=c.model,
                            profile=c.profile,
                            state=state,
                            shards=c.shards,
                        ),
                        causation=e.id,
                        eid=ids.derived(e.id, f"state:{state}"),
                    )
                )
        elif isinstance(e, ev.ReplicaDrainEvent):
            r = self.ready.pop(e.data.replica, None)
            if r is None:
                return
            model, profile, shards, _ = r
            for state in ("draining", "stopped"):
                self.queue.put_nowait(
                    _make(
                        ev.ReplicaState(
                            replica=e.data.replica,
                            model=model,
                            profile=profile,
                            state=state,
                            shards=shards,
                            reason=e.data.reason,
                        ),
                        causation=e.id,
                        eid=ids.derived(e.id, f"state:{state}"),
                    )
                )

    async def publisher(self, stop: asyncio.Event) -> None:
        """Publishes the fleet's replica states in order, pipelined."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                first = await asyncio.wait_for(self.queue.get(), 0.2)
                batch = [first]
                while not self.queue.empty() and len(batch) < 2000:
                    batch.append(self.queue.get_nowait())
                raw = []
                for e in batch:
                    d = e.data
                    assert isinstance(d, ev.ReplicaState)
                    node = d.shards[0].node
                    raw.append((subjects.subject_for(e, node=node), codec.encode(e), e.id))
                    if d.state == "ready":
                        self.ready[d.replica] = (d.model, d.profile, d.shards, node)
                await self.pub.publish_many(raw)
                self.stored += len(raw)

    async def heartbeats(self, stop: asyncio.Event) -> None:
        """Every node's heartbeat once per period, spread over it."""
        chunk = max(len(self.names) // 20, 1)
        while not stop.is_set():
            started = time.monotonic()
            for i in range(0, len(self.names), chunk):
                now = datetime.now(UTC).isoformat()
                for n in self.names[i : i + chunk]:
                    body = _json.encode({"node": n, "time": now, "replicas": 1})
                    await self.nc.publish(subjects.heartbeat_subject(n), body)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.heartbeat_s / 20)
            rest = self.heartbeat_s - (time.monotonic() - started)
            if rest > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), rest)

    async def usage(self, stop: asyncio.Event) -> None:
        """Each ready replica's use once per `used_s`, spread over it."""
        while not stop.is_set():
            started = time.monotonic()
            reps = list(self.ready.items())
            step = max(len(reps) // 10, 1)
            for i in range(0, len(reps), step):
                raw = []
                for rid, (_, _, _, node) in reps[i : i + step]:
                    e = _make(ev.ReplicaUsed(replica=rid, at=datetime.now(UTC)))
                    raw.append((subjects.subject_for(e, node=node), codec.encode(e), e.id))
                await self.pub.publish_many(raw)
                self.stored += len(raw)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.used_s / 10)
            rest = self.used_s - (time.monotonic() - started)
            if rest > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), rest)


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp) / "nats")
        url = await asyncio.to_thread(broker.start)
        try:
            await bench(args, url, Path(tmp) / "data")
        finally:
            await asyncio.to_thread(broker.stop)


async def bench(args: argparse.Namespace, url: str, data: Path) -> None:
    opts = UpOptions(
        data=data,
        nats_url=url,
        scheduler=SchedulerConfig(
            tick_s=1.0, node_timeout_s=max(30.0, 10 * args.heartbeat), lease_ttl_s=args.lease_ttl
        ),
        # Every replica here was placed moments ago: with the default minimum lifetime
        # (120 s) all would be young, and none a victim.
        policy=PolicyConfig(min_lifetime_s=0.0, policy=args.policy),
        # As `llmgw up` runs (services.plane.heap); --no-settle to see the collector's pauses.
        settle_heap=not args.no_settle,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    plane = asyncio.create_task(run(opts, stop, on_ready=ready.set_result))
    running = await asyncio.wait_for(ready, 60)
    projector = running.projector
    assert projector is not None
    nc = await connect(url, "bench fleet")
    js = nc.jetstream()
    fleet = Fleet(nc, js, args.nodes, args.heartbeat, args.used_interval)
    pub = fleet.pub
    decided: dict[str, int] = {}
    changed = asyncio.Event()

    async def on_decided(msg: Msg) -> None:
        e = codec.decode(msg.data)
        if isinstance(e, ev.PlacementDecidedEvent):
            decided[e.data.model] = decided.get(e.data.model, 0) + 1
            changed.set()

    subs = [
        await nc.subscribe("llmgw.cmd.>", cb=fleet.on_command),
        await nc.subscribe("llmgw.placement.decided.>", cb=on_decided),
    ]
    fstop = asyncio.Event()
    tasks = [
        asyncio.create_task(fleet.publisher(fstop)),
        asyncio.create_task(fleet.heartbeats(fstop)),
        asyncio.create_task(fleet.usage(fstop)),
    ]

    async def last_seq() -> int:
        return int((await js.stream_info(subjects.STREAM)).state.last_seq)

    async def poll(cond, within: float) -> None:  # type: ignore[no-untyped-def]
        deadline = time.perf_counter() + within
        while not await cond():
            if time.perf_counter() > deadline:
                raise TimeoutError("benchmark condition not met")
            await asyncio.sleep(0.2)

    def live(model: str) -> int:
        return sum(1 for r in running.scheduler.view.replicas_of(model) if r.state == "ready")

    try:
        await poll(lambda: _true(running.scheduler.is_leader and running.preemption.is_leader), 60)
        t0 = time.perf_counter()
        await pub.publish_many(fleet.inventory())
        for m in (*MODELS, PROBE, CHURN):
            await pub.publish(
                _make(
                    ev.ModelDeclared(
                        name=m,
                        min=0,
                        max=args.nodes,
                        profiles=(ev.ProfileSpec(name="tp8", gpus=8, cpu_cores=32),),
                    )
                )
            )
        per_model = int(args.nodes * args.fill) // len(MODELS)
        target = per_model * len(MODELS)
        # In steps: one scheduler pass plans every placement it can make, synchronously,
        # and a pass longer than the lease is thrown away (the lease lapses mid-pass).
        step = max(args.fill_step // len(MODELS), 1)
        for n in range(step, per_model + step, step):
            n = min(n, per_model)
            for m in MODELS:
                await pub.publish(_make(ev.ScaleDesired(model=m, replicas=n)))
            await poll(lambda n=n: _true(sum(live(m) for m in MODELS) >= n * len(MODELS)), 300)
        fill_s = time.perf_counter() - t0
        print(
            f"fill: {args.nodes:,} nodes, {target:,} tp8 replicas ready in {fill_s:.1f}s "
            f"(log at seq {await last_seq():,})"
        )

        async def phase(name: str, seconds: float, churn: bool) -> None:
            lag_events: list[int] = []
            lag_ms: list[float] = []
            decide_ms: list[float] = []
            seq0, t_start = await last_seq(), time.perf_counter()
            probe_n = decided.get(PROBE, 0)
            churn_up = True
            next_churn = t_start
            while time.perf_counter() - t_start < seconds:
                # The projector: how far behind the stream's end, and a probe's commit.
                lag_events.append(max(await last_seq() - projector.committed, 0))
                t = time.perf_counter()
                ack = await pub.publish(_make(ev.ScaleDesired(model=PROBE, replicas=probe_n + 1)))
                probe_n += 1
                await projector.wait_for(ack.seq, timeout=60)
                lag_ms.append((time.perf_counter() - t) * 1000)
                # The scheduler: the probe's scale.desired -> its placement.decided.
                while decided.get(PROBE, 0) < probe_n:
                    changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), 30)
                decide_ms.append((time.perf_counter() - t) * 1000)
                if churn and time.perf_counter() >= next_churn:
                    n = args.churn_step if churn_up else 0
                    await pub.publish(_make(ev.ScaleDesired(model=CHURN, replicas=n)))
                    churn_up = not churn_up
                    next_churn = time.perf_counter() + 5.0
                await asyncio.sleep(1.0)
            elapsed = time.perf_counter() - t_start
            rate = (await last_seq() - seq0) / elapsed
            per_1k = rate / (args.nodes / 1000)
            print(
                f"{name}: {elapsed:.0f}s, {rate:,.0f} events/s stored "
                f"({per_1k:,.1f} per 1,000 nodes; {rate * 86400 / 1e6:,.1f} M events/day)"
            )
            print(
                f"  projector lag: p50 {pct(lag_events, 50):,.0f} / max {max(lag_events):,} "
                f"events behind; probe ack -> committed p50 {pct(lag_ms, 50):.0f} ms, "
                f"p99 {pct(lag_ms, 99):.0f} ms"
            )
            print(
                f"  scheduler: scale.desired -> placement.decided p50 "
                f"{pct(decide_ms, 50):.0f} ms, p99 {pct(decide_ms, 99):.0f} ms "
                f"({len(decide_ms)} probes)"
            )

        await phase("steady", args.steady, churn=False)
        await phase("churn", args.churn, churn=True)
        if args.preempt:
            await preempt_phase(args, running, pub, nc, live, poll)
        info = await js.stream_info(subjects.STREAM)
        print(
            f"stream: {info.state.messages:,} events, {info.state.bytes / 1e6:,.1f} MB "
            f"({info.state.bytes / max(info.state.messages, 1):,.0f} bytes/event)"
        )
    finally:
        fstop.set()
        for t in tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 30)
        for s in subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        await nc.close()
        stop.set()
        await asyncio.wait_for(plane, 60)


async def _true(x: bool) -> bool:
    return x


async def preempt_phase(args, running, pub, nc, live, poll) -> None:  # type: ignore[no-untyped-def]
    """The preempt phase (see the module docstring)."""
    view = running.scheduler.view
    free = sum(1 for n in view.inventory.names() if len(view.inventory.free_gpus(n)) == GPUS)
    await pub.publish(
        _make(
            ev.ModelDeclared(
                name=FILLER,
                cls="opportunistic",
                min=0,
                max=args.nodes,
                profiles=(ev.ProfileSpec(name="tp8", gpus=8, cpu_cores=32),),
            )
        )
    )
    t0 = time.perf_counter()
    step = max(args.fill_step, 1)
    for n in range(step, free + step, step):
        n = min(n, free)
        await pub.publish(_make(ev.ScaleDesired(model=FILLER, replicas=n)))
        await poll(lambda n=n: _true(live(FILLER) >= n), 300)
    print(f"preempt: {free:,} filler replicas ready in {time.perf_counter() - t0:.1f}s")
    failed_at: dict[str, float] = {}
    drained_ms: list[float] = []
    got = asyncio.Event()

    async def on_failed(msg: Msg) -> None:
        e = codec.decode(msg.data)
        if isinstance(e, ev.PlacementFailedEvent) and e.data.model.startswith("urgent-"):
            failed_at.setdefault(e.data.model, time.perf_counter())

    async def on_drain(msg: Msg) -> None:
        e = codec.decode(msg.data)
        if isinstance(e, ev.ReplicaDrainEvent) and e.data.reason == "preempted":
            t = failed_at.get(e.data.for_model or "")
            if t is not None:
                drained_ms.append((time.perf_counter() - t) * 1000)
                got.set()

    pauses: list[tuple[int, float]] = []
    began: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        # The collector's pauses while timing: a full one walks every tracked object.
        if phase == "start":
            began[:] = [time.perf_counter()]
        elif began:
            pauses.append((info["generation"], (time.perf_counter() - began[0]) * 1000))

    gc.callbacks.append(on_gc)
    subs = [
        await nc.subscribe("llmgw.placement.failed.>", cb=on_failed),
        await nc.subscribe("llmgw.cmd.>", cb=on_drain),
    ]
    try:
        for i in range(args.preempt):
            name = f"urgent-{i:03d}"
            spec = ev.ProfileSpec(name="tp8", gpus=8, cpu_cores=32)
            await pub.publish(
                _make(ev.ModelDeclared(name=name, cls="critical", min=0, max=1, profiles=(spec,)))
            )
            got.clear()
            await pub.publish(_make(ev.ScaleDesired(model=name, replicas=1)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(got.wait(), 30)
            await poll(lambda name=name: _true(live(name) >= 1), 60)
    finally:
        gc.callbacks.remove(on_gc)
        for sub in subs:
            await sub.unsubscribe()
    full = [ms for g, ms in pauses if g == 2]
    print(
        f"  each, in order: {', '.join(f'{ms:.0f}' for ms in drained_ms)} ms; collector: "
        f"{len(pauses)} collections, {len(full)} full (longest {max(full, default=0):.0f} ms)"
    )
    print(
        f"  preemption: placement.failed -> replica.drain p50 {pct(drained_ms, 50):.0f} ms, "
        f"p99 {pct(drained_ms, 99):.0f} ms ({len(drained_ms)} of {args.preempt} preemptions; "
        f"{len(view.replicas):,} replicas in the view)"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--fill", type=float, default=0.5, help="share of nodes given a replica")
    ap.add_argument("--heartbeat", type=float, default=5.0, metavar="S")
    ap.add_argument("--used-interval", type=float, default=30.0, metavar="S")
    ap.add_argument("--steady", type=float, default=40.0, metavar="S")
    ap.add_argument("--churn", type=float, default=40.0, metavar="S")
    ap.add_argument("--churn-step", type=int, default=200, metavar="N")
    ap.add_argument("--fill-step", type=int, default=1000, metavar="N")
    ap.add_argument("--lease-ttl", type=float, default=15.0, metavar="S")
    ap.add_argument(
        "--policy",
        choices=("reference", "node-aware"),
        default="reference",
        help="the preemption service's policy",
    )
    ap.add_argument(
        "--no-settle",
        action="store_true",
        help="leave the heap unfrozen (services.plane.heap), to see the collector's pauses",
    )
    ap.add_argument("--preempt", type=int, default=20, metavar="N", help="preemptions to time")
    asyncio.run(main(ap.parse_args()))
