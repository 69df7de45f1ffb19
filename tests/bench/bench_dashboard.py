"""Benchmark: the dashboard's fan-out and its page; prints figures, asserts nothing.

Run from the repository root: `python tests/bench/bench_dashboard.py [--rate 1000]
[--clients 50] [--seconds 60] [--nodes 1000]`. It starts an embedded nats-server on a
temporary store and `llmgw dashboard` as its own process on it, then:

- fan-out: publishes `--rate` events a second for `--seconds` (scale.desired over ten
  declared models) while `--clients` SSE clients, spread over four client processes,
  read `/api/events`; one more client connects and reads nothing. Latency is from just
  before the publish to the client reading the frame with that `id:` (both clocks are
  this machine's wall clock): p50, p99, max over every client and event. The
  dashboard's resident memory is sampled every 5 s over the run;
- first paint: a fresh broker with `--nodes` nodes of 8 GPUs, most of them held by
  replicas, and a new dashboard on it; chromium (Playwright, `/usr/bin/chromium`) opens
  the page and the time from navigation to the page's `llmgw:first-paint` mark (the
  grid drawn from the listing) is read, median of 5 loads.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas import codec, ids, subjects
from schemas import events as ev
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams

REPO = Path(__file__).resolve().parents[2]
MODELS = 10
_n = 0


def _id() -> str:
    global _n
    _n += 1
    return ids.ulid(int(time.time() * 1000), _n.to_bytes(10, "big"))


def _make(data: ev.Data) -> ev.Event:
    return ev.make(data, id=_id(), time=datetime.now(UTC), source="bench")


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p))]


def start_dashboard(url: str, data: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "LLMGW_DATA": str(data)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "--nats",
            url,
            "dashboard",
            "--listen",
            "127.0.0.1:0",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        m = re.search(r"dashboard: (http://\S+)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("the dashboard did not start")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# ---------------------------------------------------------------------- clients

ID = re.compile(rb"id: (\d+)\n")


def _clients(url: str, n: int, seconds: float, out: Any) -> None:
    """A client process: `n` SSE readers; sends back {seq: [receive times]}."""

    async def one(got: dict[int, list[float]]) -> None:
        host, port = re.match(r"http://([^:/]+):(\d+)/", url).groups()  # type: ignore[union-attr]
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /api/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        end = time.monotonic() + seconds + 5
        tail = b""
        listed = False
        try:
            while time.monotonic() < end:
                try:
                    data = await asyncio.wait_for(reader.read(1 << 16), 1)
                except TimeoutError:
                    continue
                if not data:
                    break
                now = time.time()
                buf = tail + data
                if not listed:
                    listed = b"event: list" in buf
                # Whole frames only; a frame split across reads is read with the next.
                cut = buf.rfind(b"\n\n")
                if cut < 0:
                    tail = buf
                    continue
                for m in ID.finditer(buf, 0, cut + 2):
                    got.setdefault(int(m.group(1)), []).append(now)
                tail = buf[cut + 2 :]
        finally:
            writer.close()

    async def main() -> dict[int, list[float]]:
        got: dict[int, list[float]] = {}
        await asyncio.gather(*(one(got) for _ in range(n)))
        return got

    out.put(asyncio.run(main()))


async def _clients_open(web: str) -> int:
    import json
    import urllib.request

    def ask() -> int:
        with urllib.request.urlopen(web + "api/health", timeout=10) as r:
            return int(json.loads(r.read())["clients"])

    return await asyncio.to_thread(ask)


async def fanout(rate: int, clients: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp) / "broker")
        url = broker.start()
        try:
            nc = await connect(url, "bench")
            js = nc.jetstream()
            await ensure_streams(js)
            pub = Publisher(js)
            await pub.publish_many(
                [
                    _make(
                        ev.ModelDeclared(
                            name=f"m{i}",
                            min=0,
                            max=100,
                            profiles=(ev.ProfileSpec(name="tp1", gpus=1),),
                        )
                    )
                    for i in range(MODELS)
                ]
            )
            proc, web = start_dashboard(url, Path(tmp) / "data")
            try:
                procs = 4
                q: Any = mp.Queue()
                workers = [
                    mp.Process(
                        target=_clients,
                        args=(web, clients // procs + (i < clients % procs), seconds, q),
                    )
                    for i in range(procs)
                ]
                for w in workers:
                    w.start()
                # One client that reads nothing: its socket fills, and it is told to re-list.
                host, port = re.match(r"http://([^:/]+):(\d+)/", web).groups()  # type: ignore[union-attr]
                _, idle_w = await asyncio.open_connection(host, int(port))
                idle_w.write(f"GET /api/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                # Every client connected (and listed) before the first event.
                deadline = time.monotonic() + 30
                while await _clients_open(web) < clients + 1:
                    assert time.monotonic() < deadline, "the clients did not connect"
                    await asyncio.sleep(0.05)
                sent: dict[int, float] = {}
                rss = [(0.0, rss_mb(proc.pid))]
                cpu0 = cpu_s(proc.pid)
                t0 = time.monotonic()
                tick = 0.01
                per_tick = max(rate * tick, 1)
                i = 0
                next_rss = 5.0
                while (elapsed := time.monotonic() - t0) < seconds:
                    due = int(elapsed * rate) - i
                    if due > 0:
                        batch = [
                            _make(
                                ev.ScaleDesired(model=f"m{(i + k) % MODELS}", replicas=(i + k) % 7)
                            )
                            for k in range(int(min(due, per_tick * 5)))
                        ]
                        t = time.time()
                        acks = await pub.publish_many(batch)
                        for a in acks:
                            sent[a.seq] = t
                        i += len(batch)
                    if elapsed >= next_rss:
                        rss.append((elapsed, rss_mb(proc.pid)))
                        next_rss += 5
                    await asyncio.sleep(tick)
                rss.append((time.monotonic() - t0, rss_mb(proc.pid)))
                busy = (cpu_s(proc.pid) - cpu0) / (time.monotonic() - t0)
                got: dict[int, list[float]] = {}
                for _ in workers:
                    for seq, ts in q.get(timeout=seconds + 60).items():
                        got.setdefault(seq, []).extend(ts)
                for w in workers:
                    w.join(30)
                idle_w.close()
                lat = [(t - sent[s]) * 1000 for s, ts in got.items() if s in sent for t in ts]
                frames = sum(len(got.get(s, ())) for s in sent)
                print(
                    f"fan-out: {len(sent):,} events at {len(sent) / seconds:,.0f}/s to {clients} "
                    f"clients + 1 that reads nothing, {seconds:g} s: {frames:,} frames of "
                    f"{len(sent) * clients:,} expected"
                )
                if lat:
                    print(
                        f"  event -> SSE frame: p50 {statistics.median(lat):.1f} ms, "
                        f"p99 {pct(lat, 0.99):.1f} ms, max {max(lat):.1f} ms"
                    )
                print(
                    f"  dashboard CPU: {busy:.0%} of one core; load average {os.getloadavg()[0]:.1f}"
                )
                print(
                    "  dashboard RSS (MB) by second: "
                    + ", ".join(f"{t:.0f}s {m:.0f}" for t, m in rss)
                )
            finally:
                proc.terminate()
                proc.wait(30)
            await nc.close()
        finally:
            broker.stop()


# ---------------------------------------------------------------------- first paint


async def first_paint(nodes: int, loads: int = 5) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp) / "broker")
        url = broker.start()
        try:
            nc = await connect(url, "bench")
            js = nc.jetstream()
            await ensure_streams(js)
            pub = Publisher(js)
            events: list[tuple[str, bytes, str]] = []

            def add(e: ev.Event, node: str | None = None) -> None:
                events.append((subjects.subject_for(e, "llmgw", node), codec.encode(e), e.id))

            for n in range(nodes):
                name = f"gpu-{n:04d}"
                add(
                    _make(
                        ev.NodeInventory(
                            node=name,
                            gpus=tuple(
                                ev.GpuInfo(
                                    index=g, uuid=f"GPU-{n}-{g}", model="NVIDIA H100", memory_gb=80
                                )
                                for g in range(8)
                            ),
                            cpu_cores=128,
                            memory_gb=1024,
                        )
                    )
                )
            for m in range(MODELS):
                add(
                    _make(
                        ev.ModelDeclared(
                            name=f"m{m}",
                            min=0,
                            max=100_000,
                            profiles=(ev.ProfileSpec(name="tp2", gpus=2),),
                        )
                    )
                )
            # Three of each node's four pairs of GPUs are held by a ready replica.
            for n in range(nodes):
                name = f"gpu-{n:04d}"
                for pair in range(3):
                    rid = f"r-{n:04d}-{pair}"
                    model = f"m{(n + pair) % MODELS}"
                    shards = (ev.ShardSpec(node=name, gpus=(2 * pair, 2 * pair + 1)),)
                    add(
                        _make(
                            ev.PlacementDecided(
                                replica=rid,
                                model=model,
                                profile="tp2",
                                shards=shards,
                                reason="bench",
                            )
                        )
                    )
                    add(
                        _make(
                            ev.ReplicaState(
                                replica=rid,
                                model=model,
                                profile="tp2",
                                state="ready",
                                shards=shards,
                            )
                        ),
                        node=name,
                    )
            for k in range(0, len(events), 5000):
                await pub.publish_many(events[k : k + 5000])
            proc, web = start_dashboard(url, Path(tmp) / "data")
            try:
                # Playwright's sync API wants a thread with no running loop.
                times, cells = await asyncio.to_thread(_load, web, loads)
                print(
                    f"first paint: {nodes:,} nodes ({cells:,} drawn), {nodes * 8:,} GPUs, "
                    f"{nodes * 3:,} replicas: median {statistics.median(times):.0f} ms, "
                    f"max {max(times):.0f} ms over {loads} loads"
                )
            finally:
                proc.terminate()
                proc.wait(30)
            await nc.close()
        finally:
            broker.stop()


def _load(web: str, loads: int) -> tuple[list[float], int]:
    from playwright.sync_api import sync_playwright

    times = []
    cells = 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        for _ in range(loads):
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(web)
            page.wait_for_function(
                "performance.getEntriesByName('llmgw:first-paint').length > 0", timeout=30_000
            )
            cells = page.locator("#grid .node").count()
            t = page.evaluate("performance.getEntriesByName('llmgw:first-paint')[0].startTime")
            times.append(t)
            page.close()
        browser.close()
    return times, cells


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--only", choices=("fanout", "paint"))
    a = ap.parse_args()
    if a.only != "paint":
        asyncio.run(fanout(a.rate, a.clients, a.seconds))
    if a.only != "fanout":
        asyncio.run(first_paint(a.nodes))


if __name__ == "__main__":
    main()
