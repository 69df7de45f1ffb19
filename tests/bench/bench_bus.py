"""Benchmark of the bus: codec, JetStream publish, and consume+decode against raw nats-py.

Run from the repository root: `python -m tests.bench.bench_bus` (or
`python tests/bench/bench_bus.py`); `--events N --runs R` to change the sizes. It starts
its own embedded broker on a temporary store, prints a table of medians of R runs, and
is not a pytest test (pytest does not collect `bench_*.py`). Figures are per message.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import contextlib

import nats.js.api

from schemas import codec, ids, subjects
from schemas import events as ev
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams, follow
from services.bus.consume import Delivery, read_range
from services.core.ingest import Ingest

T0 = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)


def make_events(n: int) -> list[ev.Event]:
    """A mix of the common types, 200-450 bytes each, like a busy cluster's log."""
    out: list[ev.Event] = []
    for i in range(n):
        eid = ids.ulid(1_800_000_000_000 + i, os.urandom(10))
        t = T0 + timedelta(milliseconds=i)
        data: ev.Data
        match i % 4:
            case 0:
                data = ev.ReplicaState(
                    replica=f"r-{i}",
                    model="meta/llama-3.1-70b",
                    profile="tp4",
                    state="ready",
                    shards=(ev.ShardSpec(node=f"gpu-{i % 16}", gpus=(0, 1, 2, 3)),),
                )
            case 1:
                data = ev.ReplicaUsed(replica=f"r-{i - 1}", at=t)
            case 2:
                data = ev.ScaleDesired(model=f"meta/llama-{i % 9}", replicas=i % 5)
            case _:
                data = ev.PlacementDecided(
                    replica=f"r-{i}",
                    model="mistral-7b",
                    profile="tp1",
                    shards=(ev.ShardSpec(node=f"gpu-{i % 16}", gpus=(i % 8,)),),
                    reason="fits",
                )
        out.append(ev.make(data, id=eid, time=t, source=f"agent/gpu-{i % 16}"))
    return out


def node_of(e: ev.Event) -> str | None:
    if isinstance(e, ev.ReplicaUsedEvent | ev.ReplicaStateEvent):
        return "gpu-1"
    return None


def raw_items(evs: list[ev.Event]) -> list[tuple[str, bytes, str | None]]:
    return [(subjects.subject_for(e, node=node_of(e)), codec.encode(e), e.id) for e in evs]


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


async def atimed(fn: Callable[[], Awaitable[object]]) -> float:
    t = time.perf_counter()
    await fn()
    return time.perf_counter() - t


def median_rate(n: int, seconds: list[float]) -> float:
    return n / statistics.median(seconds)


async def fresh_stream(js: nats.js.JetStreamContext) -> None:
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_stream(subjects.STREAM)
    await ensure_streams(js)


async def main(n_events: int, runs: int, n_serial: int) -> None:
    evs = make_events(n_events)
    items = raw_items(evs)
    sizes = [len(b) for _, b, _ in items]
    rows: list[tuple[str, float, str]] = []

    # -------- codec
    bodies = [b for _, b, _ in items]
    # The inputs are built once and frozen out of the collector's sight: otherwise every
    # full collection walks 100k live events and the figures measure the GC, not the code.
    gc.collect()
    gc.freeze()

    def encode_all() -> None:
        encode = codec.encode
        for e in evs:
            encode(e)

    def decode_all() -> None:
        decode = codec.decode
        for b in bodies:
            decode(b)

    enc = [timed(encode_all) for _ in range(runs)]
    dec = [timed(decode_all) for _ in range(runs)]
    both = [a + b for a, b in zip(enc, dec, strict=True)]
    rows.append(("envelope encode", median_rate(n_events, enc), "per s"))
    rows.append(("envelope decode", median_rate(n_events, dec), "per s"))
    rows.append(("envelope encode+decode", median_rate(n_events, both), "per s"))

    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(Path(tmp)) as broker:
        nc = await connect(broker.url, "bench")
        js = nc.jetstream(publish_async_max_pending=8192)
        pub = Publisher(js)

        # -------- publish
        serial: list[float] = []
        piped: list[float] = []
        for _ in range(runs):
            await fresh_stream(js)

            async def one_by_one() -> None:
                for s, b, m in items[:n_serial]:
                    await pub.publish_raw(s, b, m)

            serial.append(await atimed(one_by_one))
            await fresh_stream(js)
            piped.append(await atimed(lambda: pub.publish_many(items)))
        rows.append(("publish, awaited one by one", median_rate(n_serial, serial), "per s"))
        rows.append(("publish_many (pipelined)", median_rate(n_events, piped), "per s"))

        # -------- consume: the stream now holds n_events from the last pipelined run
        info = await js.stream_info(subjects.STREAM)
        assert info.state.messages == n_events, info.state

        async def raw_ordered(decode: bool) -> None:
            done = asyncio.Event()
            count = 0

            async def cb(msg: nats.aio.msg.Msg) -> None:
                nonlocal count
                if decode:
                    codec.decode(msg.data)
                count += 1
                if count == n_events:
                    done.set()

            sub = await js.subscribe(
                ">",
                stream=subjects.STREAM,
                cb=cb,
                ordered_consumer=True,
                config=nats.js.api.ConsumerConfig(deliver_policy=nats.js.api.DeliverPolicy.ALL),
            )
            await asyncio.wait_for(done.wait(), 120)
            await sub.unsubscribe()

        async def ours_range_decode() -> None:
            count = 0
            decode = codec.decode
            async for batch in read_range(js, 1):
                for d in batch:
                    decode(d.data)
                count += len(batch)
            assert count == n_events, count

        async def ours_follow_ingest() -> None:
            # What the projector and the followers run: the follow loop, each message
            # decoded, checked against its subject and folded by ingest.
            step = Ingest(strict=True)
            stop = asyncio.Event()
            raw = step.raw

            def on_batch(batch: list[Delivery]) -> None:
                for d in batch:
                    raw(d.seq, d.subject, d.data)
                step.touched.clear()
                if step.seq >= n_events:
                    stop.set()

            await follow.follow(js, position=lambda: step.seq, on_batch=on_batch, stop=stop)
            assert step.seq == n_events, step.seq

        raw: list[float] = []
        raw_dec: list[float] = []
        ours: list[float] = []
        ours_fold: list[float] = []
        for _ in range(runs):  # interleaved, so drift on a noisy machine hits all alike
            raw.append(await atimed(lambda: raw_ordered(False)))
            raw_dec.append(await atimed(lambda: raw_ordered(True)))
            ours.append(await atimed(ours_range_decode))
            ours_fold.append(await atimed(ours_follow_ingest))
        r_raw = median_rate(n_events, raw)
        rows.append(("raw nats-py ordered cb (no decode)", r_raw, "per s"))
        rows.append(("raw nats-py ordered cb + decode", median_rate(n_events, raw_dec), "per s"))
        r_ours = median_rate(n_events, ours)
        rows.append(("read_range + decode", r_ours, "per s"))
        r_fold = median_rate(n_events, ours_fold)
        rows.append(("follow + ingest (decode, subject check, fold)", r_fold, "per s"))
        rows.append(("ratio read_range+decode / raw", r_ours / r_raw, "x"))
        rows.append(("ratio follow + ingest / raw", r_fold / r_raw, "x"))
        await nc.close()

    print(
        f"bus benchmark: {n_events} events ({min(sizes)}-{max(sizes)} bytes, "
        f"mean {statistics.mean(sizes):.0f}), median of {runs} runs, "
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>12}")
    print(f"{'-' * width}  {'-' * 12}")
    for name, value, unit in rows:
        shown = f"{value:,.2f} {unit}" if unit == "x" else f"{value:,.0f}/s"
        print(f"{name:<{width}}  {shown:>12}")


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=100_000, help="events per run")
    p.add_argument("--runs", type=int, default=5, help="runs per measure (median shown)")
    p.add_argument("--serial", type=int, default=3_000, help="events for the one-by-one publish")
    a = p.parse_args()
    asyncio.run(main(a.events, a.runs, a.serial))


if __name__ == "__main__":
    cli()
