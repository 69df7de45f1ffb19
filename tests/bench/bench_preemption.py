"""Benchmark: `placement.failed` -> first `replica.drain` seen on the bus, per decision.

Run from the repository root: `python tests/bench/bench_preemption.py [--decisions 1000]`.
Prints figures, asserts nothing (target: p99 <= 50 ms).

Cluster: 200 nodes x 8 H100s, every GPU held by a one-GPU replica of an opportunistic,
on-demand model (1,600 replicas, idle for different times), and 1,000 (+ warm-up)
critical models of one GPU each with none placed. Each round publishes one
`placement.failed` for the next critical model and waits for the drain it causes
(matched by correlation id) on `llmgw.cmd.*.replica.drain`, a plain core-NATS
subscription. Rounds run one after another, so each figure is one decision's latency,
not a queue's. The preempted replicas keep their GPUs (no agent stops them), so every
decision is taken on a full cluster and picks a new victim.

The service runs as its own process (`python -m services.preemption`), as deployed;
`--profile FILE` runs it under cProfile and writes the profile there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as a script, the checkout's root is not on the path; `tests.scenario` lives there.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nats.aio.msg import Msg  # noqa: E402

from schemas import codec  # noqa: E402
from schemas import events as ev  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from tests.scenario import Scenario  # noqa: E402

NODES = 200
GPUS = 8
WARMUP = 20


def cluster(decisions: int) -> Scenario:
    s = Scenario(datetime.now(UTC))
    for n in range(NODES):
        s.node(f"gpu-{n:03d}", f"{GPUS}xH100-80GB", cpu=128, memory=1024)
    s.model("batch", cls="opportunistic", min=0, max=NODES * GPUS, profiles=["one:1"])
    for i in range(decisions + WARMUP):
        s.model(f"crit-{i:04d}", cls="critical", min=1, profiles=["one:1"])
    for n in range(NODES):
        for g in range(GPUS):
            r = f"b-{n:03d}-{g}"
            # Idle from 20 minutes to a few hours, all past the eviction grace.
            s.replica(
                r,
                "batch",
                on=(f"gpu-{n:03d}", [g]),
                ready="-5h",
                used=f"-{20 + (n * GPUS + g) % 157}m",
            )
    return s


def percentile(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    k = min(len(ys) - 1, max(0, round(p / 100 * (len(ys) - 1))))
    return ys[k]


async def bench(url: str, decisions: int, profile: str | None) -> None:
    nc = await connect(url, "bench")
    js = nc.jetstream()
    await ensure_streams(js)
    s = cluster(decisions)
    n_setup = len(s.events())
    t = time.perf_counter()
    await Publisher(js).publish_many([(subj, codec.encode(e), e.id) for _, subj, e in s.events()])
    print(
        f"cluster: {NODES} nodes x {GPUS} GPUs, {NODES * GPUS} opportunistic replicas, "
        f"{decisions + WARMUP} critical models; {n_setup} events published in "
        f"{time.perf_counter() - t:.1f}s"
    )

    seen: dict[str, float] = {}
    waiting: dict[str, asyncio.Future[float]] = {}

    async def on_drain(msg: Msg) -> None:
        now = time.perf_counter()
        e = codec.decode(msg.data)
        key = e.correlation or ""
        if key not in seen:
            seen[key] = now
            f = waiting.pop(key, None)
            if f is not None and not f.done():
                f.set_result(now)

    sub = await nc.subscribe("llmgw.cmd.*.replica.drain", cb=on_drain)

    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-o", profile]
    cmd += ["-m", "services.preemption", "--nats", url, "--holder", "bench", "--lease-ttl", "2"]
    log = Path(tempfile.mkdtemp(prefix="bench-preemption-")) / "service.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=ROOT, stdout=out, stderr=asyncio.subprocess.STDOUT
        )
    pub = Publisher(js)
    latencies: list[float] = []
    try:
        for i in range(decisions + WARMUP):
            trigger = s.emit(
                ev.PlacementFailed(
                    model=f"crit-{i:04d}", profiles=("one",), live=0, desired=1, reason="no_fit"
                )
            )
            fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            waiting[trigger.id] = fut
            start = time.perf_counter()
            await pub.publish(trigger)
            # The first round also waits for the service to start, lead and catch up.
            got = await asyncio.wait_for(fut, 60 if i == 0 else 10)
            if i >= WARMUP:
                latencies.append((got - start) * 1e3)
    finally:
        await sub.unsubscribe()
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
        await nc.close()

    print(
        f"placement.failed -> replica.drain over {len(latencies)} decisions "
        f"(after {WARMUP} warm-up): "
        f"p50 {statistics.median(latencies):.2f} ms, p90 {percentile(latencies, 90):.2f} ms, "
        f"p99 {percentile(latencies, 99):.2f} ms, max {max(latencies):.2f} ms "
        f"(target p99 <= 50 ms)"
    )
    print(f"service log: {log}")
    if profile:
        print(f"profile: {profile}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--decisions", type=int, default=1000)
    p.add_argument("--nats", help="an existing broker (default: an embedded one, thrown away)")
    p.add_argument("--profile", help="write the service's cProfile output here")
    args = p.parse_args()
    if args.nats:
        asyncio.run(bench(args.nats, args.decisions, args.profile))
        return
    with tempfile.TemporaryDirectory(prefix="bench-preemption-") as d:
        broker = EmbeddedBroker(Path(d))
        broker.start()
        try:
            asyncio.run(bench(broker.url, args.decisions, args.profile))
        finally:
            with contextlib.suppress(Exception):
                broker.stop()


if __name__ == "__main__":
    main()
