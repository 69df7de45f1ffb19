"""Benchmark of the projector's paths; prints a table, asserts nothing.

Run from the repository root:
`python tests/bench/bench_projector.py [--events N] [--runs R] [--used P]`.

A mix for 1,000 nodes x 8 GPUs (tests/projector/mix.py: inventories, placements walking
through their states, replica.used, drains, failed placements, preemption decisions,
holds, cordons, lost nodes), 1,000,000 events by default.

Which mix is realistic: a serving cluster's log is mostly use reports. 4,000 replicas
each reported used at most every 30 s make ~130 replica.used a second, against a few
placements, state changes and drains a second even with every replica replaced hourly.
So the default (`--used 0.97`, ~85% replica.used) is the steady state; `--used 0.70`
(~45% replica.used, a placement every ten events) is a churn-heavy stress mix, and is
worth running too: its figures are lower.

Paths:
  (a) in-memory fold, decode included (`services.core.ingest`: decode, subject check,
      fold, dirty keys), and bare `codec.decode` + `fold.apply` for comparison;
  (b) replay from a bundle file into SQLite (the replay's bundle reader into
      `replay_records`: the projector's ingest and Committer, batches of 100,000), and for
      comparison what `llmgw replay --log B --db OUT` runs (fold all, write the view once);
  (c) replay from JetStream into SQLite (the Projector itself, from seq 1 to the end);
  (d) the raw baseline: the fastest plain nats-py read of the same stream (an ordered
      push consumer whose callback only counts), no decode, no fold.
  (e) the in-memory fold of (a) with the policy's index maintained as the preemption
      service maintains it: its engine (`policy.Fast`) follows the view when a
      decision asks it, at each `placement.failed` the service answers (reason no_fit;
      one that fits or waits asks nothing, so this is the most it follows), and on
      each of its ticks (`tick_s`, 1 s of wall time: a few times a run here), the
      replicas the view journaled since (`Index.follow`); against the fold alone,
      rounds alternating, the ratio of the medians in one run (issue 27).
Targets: (a) >= 300,000/s; (b) >= 100,000/s; (c) >= 0.5 x (d); (e) >= 0.8 x the fold alone.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas import bundle, codec
from schemas import events as ev
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams
from services.core import fold, reaction
from services.core.ingest import Ingest
from services.core.policy import Fast
from services.core.view import View
from services.preemption.config import Config as PreemptionConfig
from services.projector import store
from services.projector.service import Projector, replay_records
from services.replay import ports, rebuild
from tests.projector import mix


def median_rate(n: int, runs: list[float]) -> tuple[float, str]:
    med = statistics.median(runs)
    return n / med, ", ".join(f"{r:.2f}s" for r in runs)


def bench_fold(records: list[tuple[int, str, bytes]], runs: int) -> tuple[list[float], list[float]]:
    folder_t, bare_t = [], []
    for _ in range(runs):
        t = time.perf_counter()
        f = Ingest(strict=True)
        fr = f.raw
        for seq, subject, body in records:
            fr(seq, subject, body)
            if f.touched.count >= 5000:
                f.touched.clear()
        folder_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        v = View()
        dec, app = codec.decode, fold.apply
        for seq, subject, body in records:
            try:
                e = dec(body)
            except Exception:
                continue
            app(v, e, seq=seq, subject=subject)
        bare_t.append(time.perf_counter() - t)
    return folder_t, bare_t


def fold_following(records: list[tuple[int, str, bytes]], with_index: bool) -> tuple[float, int]:
    """(e): one fold of (a) (Ingest), with the index followed as the preemption service
    follows it when `with_index`; the seconds, and how many follows."""
    gc.collect()
    t = time.perf_counter()
    f = Ingest(strict=True)
    fr = f.raw
    eng = Fast() if with_index else None
    follows = 0
    failed = ev.PlacementFailedEvent
    tick_s = PreemptionConfig().tick_s
    tick = t + tick_s
    for i, (seq, subject, body) in enumerate(records):
        e = fr(seq, subject, body)
        if f.touched.count >= 5000:
            f.touched.clear()
        if eng is None:
            continue
        if type(e) is failed and reaction.answers(e):
            eng.follow(f.view)  # a decision asks it
            follows += 1
        elif not i & 1023 and time.perf_counter() >= tick:
            eng.follow(f.view)  # the service's tick
            follows += 1
            tick += tick_s
    return time.perf_counter() - t, follows


def bench_index(
    records: list[tuple[int, str, bytes]], runs: int
) -> tuple[list[float], list[float], int]:
    """(e): the fold alone and the fold with the index followed, rounds alternating."""
    alone, kept = [], []
    follows = 0
    for _ in range(runs):
        alone.append(fold_following(records, False)[0])
        took, follows = fold_following(records, True)
        kept.append(took)
    return alone, kept, follows


async def bench_bundle(path: Path, tmp: Path, runs: int) -> list[float]:
    """(b): the bundle's lines (the replay's reader) folded and written by `replay_records`."""
    out = []
    for i in range(runs):
        db_path = tmp / f"bundle-{i}.sqlite"
        t = time.perf_counter()
        db = await store.open_db(db_path)
        try:
            await replay_records(db, bundle.records(str(path)))
        finally:
            await db.close()
        out.append(time.perf_counter() - t)
    return out


async def bench_cli_replay(path: Path, tmp: Path, runs: int) -> list[float]:
    """What `llmgw replay --log B --db OUT` runs: the rebuild, then the whole view written."""
    out = []
    for i in range(runs):
        t = time.perf_counter()
        r = await rebuild.from_bundle(str(path))
        await ports.write_view(
            str(tmp / f"cli-{i}.sqlite"),
            r.view,
            decisions=r.decisions,
            rejections=r.rejections,
            dead=r.source.stats.dead,
        )
        out.append(time.perf_counter() - t)
    return out


async def bench_stream(url: str, tmp: Path, n: int, runs: int) -> tuple[list[float], list[float]]:
    nc = await connect(url, "bench")
    js = nc.jetstream()
    proj_t, raw_t = [], []
    try:
        for i in range(runs):
            # (d) raw: an ordered push consumer whose callback only counts.
            done = asyncio.Event()
            count = 0

            async def cb(msg: object, done: asyncio.Event = done) -> None:
                nonlocal count
                count += 1
                if count >= n:
                    done.set()

            t = time.perf_counter()
            sub = await js.subscribe(
                ">",
                stream="LLMGW",
                cb=cb,
                ordered_consumer=True,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
                pending_msgs_limit=0,
                pending_bytes_limit=0,
            )
            await asyncio.wait_for(done.wait(), 600)
            raw_t.append(time.perf_counter() - t)
            await sub.unsubscribe()
            # (c) the projector from seq 1 into a fresh SQLite file, to the stream's end as
            # of the start (the digests it publishes land after it). Snapshots off: they
            # would write into the store (c) and (d) share between runs.
            p = Projector(js, tmp / f"stream-{i}.sqlite", digest_every=0, snapshot_every=0)
            stop = asyncio.Event()
            t = time.perf_counter()
            task = asyncio.create_task(p.run(stop))
            await p.wait_for(n, timeout=600)
            proj_t.append(time.perf_counter() - t)
            stop.set()
            await task
            assert p.seq == n and p.gaps == 0, (p.seq, p.gaps)
    finally:
        await nc.close()
    return proj_t, raw_t


async def publish(url: str, items: list[mix.Item]) -> float:
    nc = await connect(url, "bench-pub")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        t = time.perf_counter()
        # No message ids: the bench's own bodies are unique, and the dedupe table for a
        # million ids would only slow the broker down.
        await Publisher(js).publish_many((s, b, None) for s, b, _ in items)
        return time.perf_counter() - t
    finally:
        await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument(
        "--index-only", action="store_true", help="only (e), the fold with the policy index"
    )
    ap.add_argument(
        "--used",
        type=float,
        default=0.97,
        help="chance a step of the mix is a replica.used (0.97, the default: ~85%% of "
        "events, a serving cluster's steady state; 0.70: ~45%%, churn-heavy)",
    )
    a = ap.parse_args()
    n = a.events
    t = time.perf_counter()
    items = mix.items(1, n, nodes=a.nodes, used=a.used)
    records = [(i, s, b) for i, (s, b, _) in enumerate(items, start=1)]
    print(f"generated {n:,} events for {a.nodes} nodes in {time.perf_counter() - t:.1f}s")
    rows: list[tuple[str, float, str]] = []
    alone_t, kept_t, follows = bench_index(records, a.runs)
    ratio = statistics.median(alone_t) / statistics.median(kept_t)
    index_rows = [
        ("(e) fold in memory (Ingest), alone", *median_rate(n, alone_t)),
        (f"    the same, index followed {follows:,} times", *median_rate(n, kept_t)),
    ]
    if a.index_only:
        print()
        print(f"{'path':<48} {'events/s':>12}  runs")
        for name, rate, runs in index_rows:
            print(f"{name:<48} {rate:>12,.0f}  {runs}")
        print(f"\n(e) {ratio:.2f}x of the fold alone (target >= 0.8x)")
        return
    folder_t, bare_t = bench_fold(records, a.runs)
    rows.append(("(a) fold in memory, decode included (Ingest)", *median_rate(n, folder_t)))
    rows.append(("    bare codec.decode + fold.apply", *median_rate(n, bare_t)))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = tmp / "log.jsonl"
        with path.open("wb") as fp:
            for seq, s, b in records:
                fp.write(bundle.line(seq, s, b) + b"\n")
        rows.append(
            (
                "(b) bundle file -> SQLite",
                *median_rate(n, asyncio.run(bench_bundle(path, tmp, a.runs))),
            )
        )
        rows.append(
            (
                "    llmgw replay --log (rebuild + write_view)",
                *median_rate(n, asyncio.run(bench_cli_replay(path, tmp, a.runs))),
            )
        )
        if not a.skip_stream:
            broker = EmbeddedBroker(tmp / "broker")
            broker.start()
            try:
                pub_s = asyncio.run(publish(broker.url, items))
                print(f"published {n:,} in {pub_s:.1f}s ({n / pub_s:,.0f}/s)")
                proj_t, raw_t = asyncio.run(bench_stream(broker.url, tmp, n, a.runs))
            finally:
                broker.stop()
            c = median_rate(n, proj_t)
            dd = median_rate(n, raw_t)
            rows.append(("(c) JetStream -> SQLite (Projector)", *c))
            rows.append(("(d) raw nats-py ordered consume, no decode", *dd))
    rows += index_rows
    print()
    print(f"{'path':<48} {'events/s':>12}  runs")
    for name, rate, runs in rows:
        print(f"{name:<48} {rate:>12,.0f}  {runs}")
    print(f"\n(e) {ratio:.2f}x of the fold alone (target >= 0.8x)")
    if not a.skip_stream:
        print(f"\n(c)/(d) = {c[0] / dd[0]:.2f}  (target >= 0.5)")


if __name__ == "__main__":
    main()
