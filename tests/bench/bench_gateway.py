"""Benchmark: what the gateway adds, the same load side by side against a fast upstream
directly and through the gateway, in one run.

Run from the repository root:

    python tests/bench/bench_gateway.py [--rate 500] [--seconds 6] [--streams 300]
        [--stream-tps 8] [--loops asyncio,asyncio-nofreeze,uvloop] [--pin] [--nice N]
        [--closed-client raw|aiohttp] [--bench-gc tuned|default] [--soak SECONDS]
        [--keys] [--tree DIR]

Prints figures, asserts nothing. The issue's targets: added latency p50 <= 1 ms and
p99 <= 5 ms at 500 req/s non-streaming; >= 1,500 req/s through one gateway process;
streaming time-to-first-byte added p99 <= 5 ms with 300 concurrent streams; the
gateway's memory flat over 5 minutes (`--soak 300`).

An embedded nats-server; two simulated model servers (services.agent.responder) as
their own processes: `bench` answers at once (no delays), `bench-stream` streams 16
tokens at `--stream-tps` (so a stream stays open about 2 s and the streams pile up to
the concurrency asked for); one `python -m services.gateway` process per entry of
`--loops` (asyncio; asyncio with --no-gc-freeze; uvloop when it is installed, `pip
install -e '.[bench]'`; `-untuned` after a loop: with --no-gc-tune; `-plain`: with
--no-fast-path, the request path without its speed-ups; `-aiohttp`: --upstream-client
aiohttp, aiohttp's client to the replicas instead of the lean one; `-lean`: --server
lean, the lean server; `-aioserver`: --server aiohttp, aiohttp's; `-young20k`: the
collector's thresholds of the round before, --gc-thresholds 20000,10,10), each told of the
servers by `replica.state` events with their endpoints, each with a broker and a log
of its own (alone, as a user's one gateway is, not sharing with the others of the run). The load generator (aiohttp,
this process) first measures the upstream alone, then alternates rounds of the same
open-loop load (requests sent at a fixed rate whatever the answers do, so a slow answer
does not slow the offered load) directly and through each gateway, and reports the
medians over rounds and what the gateway added. The same for streams: new streams
arrive at `--streams / duration` a second, so about `--streams` are open at once, and
each one's time to first byte is measured. Then a closed loop of 64 clients for the
most requests a second through each gateway: `--closed-client raw` (the default) sends
them on 64 keep-alive connections of its own (`_RawClient`, ~0.045 ms of the load
generator's CPU a request), `aiohttp` through aiohttp's client (~0.15-0.3 ms, which on
two cores made the load generator and the server, sharing one, the bottleneck rather
than the gateway). The upstream alone is measured with both.

Each round also reports CPU time per request of each process (from /proc, user +
system): the gateway's own cost is what no load on the machine changes, and on a host
with as many cores as processes its added latency is about that plus the two hops.
`--nice -10` (as root) runs them all ahead of the machine's other work, which on a
shared host is the difference between the gateway's cost and its wait for a CPU.
`--pin` puts each gateway on the last CPU and the load generator, the servers and the
broker on the others (taskset), so the gateway's core is not shared with the load.
After each phase every process says how long the cyclic garbage collector held it, by
generation (the gateways and servers on SIGUSR1). The load generator and the servers,
the instruments, freeze their heaps and turn their collectors off (`--bench-gc tuned`:
as the gateway's process; `default`: CPython's; `_tune_collector` says what each did to
the figures).
`--keys` gives every gateway an API key file (the key's rpm and tpm set far past the
load) and sends the key with every request, so each is admitted and settled against its
limits. `--tree DIR` with a loop named `NAME@tree` (`uvloop@tree`) runs that gateway from
another checkout (the tree before a change; its own bench script serves it), in the same
run and the same interleaved rounds as this tree's.
`--soak SECONDS` instead runs a steady mix through the first gateway (half streaming)
and prints its RSS every tenth of the time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# JSON_TYPE says a body is JSON, as the gateway asks (another type is 415).
JSON_TYPE = {"Content-Type": "application/json"}
# With `--keys`: every gateway has this key file (its limits far past any load, so every
# request is admitted and settled against them, none refused), and every request sends it.
KEY = "bench-key-0123456789abcdef"
KEY_LINE = f"{KEY} default rpm=100000000 tpm=100000000000\n"

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import yarl  # noqa: E402

from schemas import events as ev  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402

NODE = "bench-gw"
CHAT = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
).encode()
STREAM = json.dumps(
    {"model": "bench-stream", "prompt": "hi", "max_tokens": 16, "stream": True}
).encode()
TICKS = os.sysconf("SC_CLK_TCK")
GC_LINE = "bench: the collector:"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _waited_s(pid: int) -> float:
    """Seconds process `pid`'s main thread has been ready to run and waiting for a CPU
    (the scheduler's run-queue delay, /proc/PID/schedstat); 0 where it is not kept."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else float("nan")


@dataclass
class Round:
    """One round of load on one path: latencies (s), errors, CPU seconds by process."""

    lat: list[float] = field(default_factory=list)
    errors: int = 0
    cpu: dict[str, float] = field(default_factory=dict)
    waited: dict[str, float] = field(default_factory=dict)
    """Seconds each process was ready to run and had no CPU, over the round."""
    seconds: float = 0.0
    peak: int = 0
    """Most requests open at once (streams)."""


def _tune_collector(how: str) -> None:
    """The bench's own processes' collector (the load generator's, the simulated
    servers'): `off` (the default: the heap frozen and the collector off, so that the
    instruments never stall; a run is minutes, and what cycles they leave is kept until
    it ends), `tuned` (as the gateway's process: frozen, young collections every
    THRESHOLDS) or `default` (CPython's). With CPython's, a full
    collection held the load generator 19 ms and a simulated server 29 ms in one run; with
    the gateway's thresholds of the round before (20,000, 10, 10), young ones of 15-27 ms
    (with 300 streams open, 20,000 young objects to walk on a shared CPU): stalls counted
    against whichever path was being measured then."""
    import gc

    from services.gateway.config import THRESHOLDS

    if how == "default":
        return
    gc.collect()
    gc.freeze()
    if how == "off":
        gc.disable()
    else:
        gc.set_threshold(*THRESHOLDS)


async def _serve_upstream(port: int, model: str, tps: float, collector: str) -> None:
    from services.agent.responder import Responder, Timing

    CollectorTimer().install().answer_signal()
    r = Responder(f"{model}-1", model, Timing(0.0, tps))
    await r.start(port)
    _tune_collector(collector)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


async def _open_loop(
    http: aiohttp.ClientSession, url: str, body: bytes, rate: float, seconds: float, stream: bool
) -> Round:
    """`rate` requests a second for `seconds`; each one's latency (to its last byte, or
    for a stream to its first body byte)."""
    out = Round()
    open_now = 0

    async def one() -> None:
        nonlocal open_now
        open_now += 1
        out.peak = max(out.peak, open_now)
        t = time.perf_counter()
        try:
            async with http.post(url, data=body, headers=JSON_TYPE) as r:
                if stream:
                    await r.content.readany()
                    first = time.perf_counter() - t
                    await r.read()
                else:
                    await r.read()
                    first = time.perf_counter() - t
                if r.status != 200:
                    out.errors += 1
                    return
        except aiohttp.ClientError:
            out.errors += 1
            return
        finally:
            open_now -= 1
        out.lat.append(first)

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return out


async def _closed_loop(
    http: aiohttp.ClientSession, url: str, seconds: float, client: str = "raw"
) -> float:
    """Requests a second of 64 clients, each sending its next request as its last
    answer ends, for `seconds`. `client`: `raw` (`_RawClient`, a few microseconds of the
    load generator's CPU a request) or `aiohttp` (about 0.2-0.3 ms a request, which on
    two cores made the load generator the bottleneck)."""
    if client == "raw":
        return await _raw_closed_loop(url, seconds)
    done = 0
    end = time.perf_counter() + seconds

    async def one() -> None:
        nonlocal done
        while time.perf_counter() < end:
            async with http.post(url, data=CHAT, headers=JSON_TYPE) as r:
                await r.read()
            done += 1

    await asyncio.gather(*(one() for _ in range(64)))
    return done / seconds


class _RawClient(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection sending `request` again as each answer ends
    (answers with a Content-Length: the gateway's and the simulated server's
    non-streamed ones); a status other than 200 is counted as an error."""

    def __init__(self, request: bytes, end: float, finished: asyncio.Future[None]) -> None:
        self.request = request
        self.end = end
        self.finished = finished
        self.buf = b""
        self.need = -1
        self.done = 0
        self.errors = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need < 0:
                head_end = self.buf.find(b"\r\n\r\n")
                if head_end < 0:
                    return
                head = self.buf[:head_end].lower()
                i = head.find(b"content-length:")
                length = int(head[i + 15 : head.find(b"\r\n", i)]) if i >= 0 else 0
                if not head.startswith(b"http/1.1 200"):
                    self.errors += 1
                self.need = head_end + 4 + length
            if len(self.buf) < self.need:
                return
            self.buf = self.buf[self.need :]
            self.need = -1
            self.done += 1
            if time.perf_counter() >= self.end:
                assert self.transport is not None
                self.transport.close()
                return
            assert self.transport is not None
            self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.finished.done():
            self.finished.set_result(None)


async def _raw_closed_loop(url: str, seconds: float) -> float:
    u = yarl.URL(url)
    request = (
        f"POST {u.path} HTTP/1.1\r\nHost: {u.host}:{u.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(CHAT)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in JSON_TYPE.items() if k != "Content-Type")
        + "\r\n"
    ).encode() + CHAT
    loop = asyncio.get_running_loop()
    end = time.perf_counter() + seconds
    clients = []
    host, port = u.host or "127.0.0.1", u.port or 80

    def client(f: asyncio.Future[None]) -> Callable[[], _RawClient]:
        return lambda: _RawClient(request, end, f)

    for _ in range(64):
        finished: asyncio.Future[None] = loop.create_future()
        _, c = await loop.create_connection(client(finished), host, port)
        clients.append(c)
    await asyncio.gather(*(c.finished for c in clients))
    errors = sum(c.errors for c in clients)
    if errors:
        print(f"  ({errors} answers other than 200)")
    return sum(c.done for c in clients) / seconds


def _pin(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


@dataclass
class Procs:
    brokers: dict[str, EmbeddedBroker]
    """Each gateway's own (`_start`), by its loop."""
    gateways: dict[str, subprocess.Popen[bytes]]
    upstreams: dict[str, subprocess.Popen[bytes]]
    ports: dict[str, int]
    logs: dict[str, Path]
    """Each gateway's and server's stderr, by its name in `pids()`."""
    said: dict[str, int] = field(default_factory=dict)

    async def collectors(self) -> dict[str, str]:
        """Each gateway's and server's collector since the last ask (SIGUSR1: it writes
        a GC_LINE to its stderr)."""
        procs = {f"gateway-{k}": p for k, p in self.gateways.items()}
        procs |= {f"upstream-{k}": p for k, p in self.upstreams.items()}
        for p in procs.values():
            p.send_signal(signal.SIGUSR1)
        out: dict[str, str] = {}
        deadline = time.monotonic() + 5
        while len(out) < len(procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            for name in procs:
                lines = [
                    x.removeprefix(GC_LINE).strip()
                    for x in self.logs[name].read_text(errors="replace").splitlines()
                    if x.startswith(GC_LINE)
                ]
                if len(lines) > self.said.get(name, 0):
                    out[name] = lines[-1]
        for name in out:
            self.said[name] = self.said.get(name, 0) + 1
        return out

    def pids(self) -> dict[str, int]:
        out = {f"gateway-{k}": p.pid for k, p in self.gateways.items()}
        out |= {f"upstream-{k}": p.pid for k, p in self.upstreams.items()}
        out["loadgen"] = os.getpid()
        return out

    def stop(self) -> None:
        for proc in [*self.gateways.values(), *self.upstreams.values()]:
            proc.terminate()
            proc.wait(10)
        for b in self.brokers.values():
            b.stop()


def _start(a: argparse.Namespace, loops: list[str]) -> Procs:
    """The two upstreams, and a gateway per loop with its broker, started; their ports."""
    n = os.cpu_count() or 1
    gw_cpu, rest_cpu = (str(n - 1), f"0-{n - 2}") if a.pin and n > 1 else ("", "")
    if rest_cpu:
        os.sched_setaffinity(0, range(n - 1))  # the load generator; the broker inherits it
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    ports = {"bench": _free_port(), "bench-stream": _free_port()}
    logs = {f"upstream-{m}": tmp / f"upstream-{m}.log" for m in ("bench", "bench-stream")}
    logs |= {f"gateway-{loop}": tmp / f"gateway-{loop}.log" for loop in loops}
    upstreams = {
        model: subprocess.Popen(
            [
                *_pin(rest_cpu),
                sys.executable,
                __file__,
                "--serve-upstream",
                str(ports[model]),
                "--model",
                model,
                "--tps",
                str(tps),
                "--bench-gc",
                a.bench_gc,
            ],
            stderr=logs[f"upstream-{model}"].open("wb"),
        )
        for model, tps in (("bench", 0.0), ("bench-stream", a.stream_tps))
    }
    keys: list[str] = []
    if a.keys:
        (tmp / "keys").write_text(KEY_LINE)
        (tmp / "keys").chmod(0o600)
        keys = ["--api-keys", str(tmp / "keys")]
    gateways = {}
    brokers = {}
    for loop in loops:
        # A broker and a log of its own: each gateway alone, as a user's one gateway is.
        # On one broker the gateways of a run would share with each other (each telling
        # the other its load and each pick's blocks), work that neither does alone.
        brokers[loop] = broker = EmbeddedBroker(tmp / f"broker-{loop}")
        broker.start()
        ports[loop] = _free_port()
        # `@tree`: the gateway of the checkout `--tree`, its own bench script serving it.
        tree = a.tree if "@tree" in loop else ROOT
        gateways[loop] = subprocess.Popen(
            [
                *_pin(gw_cpu),
                sys.executable,
                str(tree / "tests" / "bench" / "bench_gateway.py"),
                "--serve-gateway",
                loop.replace("@tree", ""),
                "--nats",
                broker.url,
                "--listen",
                f"127.0.0.1:{ports[loop]}",
                *keys,
            ],
            cwd=tree,
            stderr=logs[f"gateway-{loop}"].open("wb"),
        )
    return Procs(brokers, gateways, upstreams, ports, logs)


async def _declare(url: str, ports: dict[str, int]) -> None:
    nc = await connect(url, "bench")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        pub = Publisher(js)

        def make(data: ev.Data) -> ev.Event:
            return ev.make(data, id=new_id(), time=utc_now(), source="bench")

        gpus = tuple(ev.GpuInfo(index=i, uuid=f"g{i}", model="H100", memory_gb=80) for i in (0, 1))
        await pub.publish(
            make(ev.NodeInventory(node=NODE, gpus=gpus, cpu_cores=8, memory_gb=64)), node=NODE
        )
        for i, model in enumerate(("bench", "bench-stream")):
            profile = ev.ProfileSpec(name="p", gpus=1)
            # A target far past the load: the bench measures the pipe, not the admission
            # limit that holds what a replica cannot take (services.core.routing).
            declared = ev.ModelDeclared(
                name=model, min=0, profiles=(profile,), target_inflight=10_000
            )
            await pub.publish(make(declared))
            # Placed first: only a placement makes a replica (a report alone is refused).
            shards = (ev.ShardSpec(node=NODE, gpus=(i,)),)
            placed = ev.PlacementDecided(
                replica=f"{model}-1", model=model, profile="p", shards=shards, reason="bench"
            )
            await pub.publish(make(placed))
            state = ev.ReplicaState(
                replica=f"{model}-1",
                model=model,
                profile="p",
                state="ready",
                shards=(ev.ShardSpec(node=NODE, gpus=(i,)),),
                endpoint=f"http://127.0.0.1:{ports[model]}",
            )
            await pub.publish(make(state), node=NODE)
    finally:
        await nc.close()


async def _until_routed(http: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            async with http.post(url, data=CHAT, headers=JSON_TYPE) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, f"{url} never routed"
        await asyncio.sleep(0.1)


async def _rounds(
    http: aiohttp.ClientSession,
    paths: dict[str, str],
    pids: dict[str, int],
    body: bytes,
    rate: float,
    seconds: float,
    rounds: int,
    stream: bool,
) -> dict[str, list[Round]]:
    """`rounds` rounds of the same load on each path in turn (after a warm-up of each)."""
    got: dict[str, list[Round]] = {name: [] for name in paths}
    for url in paths.values():
        await _open_loop(http, url, body, rate, min(seconds, 1.0), stream)
    for _ in range(rounds):
        for name, url in paths.items():
            cpu0 = {k: _cpu_s(p) for k, p in pids.items()}
            wait0 = {k: _waited_s(p) for k, p in pids.items()}
            t0 = time.perf_counter()
            r = await _open_loop(http, url, body, rate, seconds, stream)
            r.seconds = time.perf_counter() - t0
            r.cpu = {k: _cpu_s(p) - cpu0[k] for k, p in pids.items()}
            r.waited = {k: _waited_s(p) - wait0[k] for k, p in pids.items()}
            got[name].append(r)
    return got


def _report(what: str, got: dict[str, list[Round]], rate: float, seconds: float) -> None:
    """Per path: the median over rounds of each round's p50 and p99; what each gateway
    added to the direct path; CPU ms per request by process."""
    med: dict[str, tuple[float, float]] = {}
    for name, rs in got.items():
        p50 = statistics.median(_pct(r.lat, 0.5) for r in rs)
        p99 = statistics.median(_pct(r.lat, 0.99) for r in rs)
        med[name] = (p50, p99)
        errors = sum(r.errors for r in rs)
        peak = max(r.peak for r in rs)
        cpu: dict[str, float] = {}
        waited: dict[str, float] = {}
        for r in rs:
            for k, v in r.cpu.items():
                cpu[k] = cpu.get(k, 0.0) + v
                waited[k] = waited.get(k, 0.0) + r.waited.get(k, 0.0)
        n = sum(len(r.lat) + r.errors for r in rs)
        wall = sum(r.seconds for r in rs)
        # The processes this path uses (an idle gateway's CPU is next to nothing).
        used = [
            k
            for k, v in sorted(cpu.items())
            if v / n > 2e-5 and (not k.startswith("gateway-") or k == name)
        ]
        costs = ", ".join(f"{k} {1e3 * cpu[k] / n:.2f}" for k in used)
        waits = ", ".join(f"{k} {waited[k] / wall:.0%}" for k in used)
        print(
            f"  {what} {name:16} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  (medians of "
            f"{len(rs)} rounds; errors {errors}; most open {peak})\n"
            f"  {'':6} {'':16} CPU ms a request: {costs}; ready but without a CPU: {waits} "
            "of the time"
        )
    d50, d99 = med["direct"]
    for name, (p50, p99) in med.items():
        if name != "direct":
            print(f"  {what} added by {name}: p50 {p50 - d50:.2f} ms, p99 {p99 - d99:.2f} ms")


async def _bench(a: argparse.Namespace, procs: Procs, loops: list[str]) -> None:
    for broker in procs.brokers.values():
        await _declare(broker.url, procs.ports)
    base = "http://127.0.0.1:{}/v1/{}"
    direct = base.format(procs.ports["bench"], "chat/completions")
    through = {loop: base.format(procs.ports[loop], "chat/completions") for loop in loops}
    pids = procs.pids()
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        for url in through.values():
            await _until_routed(http, url)
        rss0 = {loop: _rss_mb(procs.gateways[loop].pid) for loop in loops}
        _tune_collector(a.bench_gc)
        if a.soak:
            await _soak(a, http, through[loops[0]], procs.gateways[loops[0]].pid)
            said = await procs.collectors()
            print(f"soak: the gateway's collector: {said.get(f'gateway-{loops[0]}')}")
            return
        up = procs.upstreams["bench"].pid
        for client in dict.fromkeys((a.closed_client, "aiohttp")):
            cpu0, up0 = _cpu_s(os.getpid()), _cpu_s(up)
            alone = await _closed_loop(http, direct, a.seconds, client)
            done = alone * a.seconds
            gen_ms, up_ms = (
                1e3 * (_cpu_s(p) - c) / done for p, c in ((os.getpid(), cpu0), (up, up0))
            )
            print(
                f"upstream alone, {client} client: {alone:,.0f} req/s (64 clients, closed "
                f"loop); CPU ms a request: loadgen {gen_ms:.3f}, upstream {up_ms:.3f}, so on "
                f"a CPU each of its own at most {1e3 / gen_ms:,.0f} and {1e3 / up_ms:,.0f} req/s"
            )
        collectors = CollectorTimer().install()

        async def said_collectors(phase: str) -> None:
            print(f"  the collector over the {phase} (which generation held each process):")
            print(f"    loadgen: {collectors.said(collectors.since)}")
            collectors.since = collectors.mark()
            for name, line in sorted((await procs.collectors()).items()):
                if "no collections" not in line or name.startswith("gateway"):
                    print(f"    {name}: {line}")

        await said_collectors("start")
        paths = {"direct": direct} | {f"gateway-{k}": u for k, u in through.items()}
        got = await _rounds(http, paths, pids, CHAT, a.rate, a.seconds, a.rounds, False)
        print(f"non-streaming at {a.rate:g} req/s, {a.rounds} rounds of {a.seconds:g} s each:")
        _report("chat", got, a.rate, a.seconds)
        await said_collectors("non-streaming rounds")
        duration = 16 / a.stream_tps if a.stream_tps > 0 else 1.0
        srate = a.streams / duration
        spaths = {"direct": base.format(procs.ports["bench-stream"], "completions")} | {
            f"gateway-{k}": base.format(procs.ports[k], "completions") for k in loops
        }
        got = await _rounds(http, spaths, pids, STREAM, srate, a.seconds, a.rounds, True)
        print(
            f"streams: {srate:.0f} a second of ~{duration:.1f} s each (~{a.streams} open at "
            f"once), time to first byte, {a.rounds} rounds of {a.seconds:g} s each:"
        )
        _report("stream", got, srate, a.seconds)
        await said_collectors("stream rounds")
        for loop in loops:
            pid = procs.gateways[loop].pid
            cpu0, wait0 = _cpu_s(pid), _waited_s(pid)
            gen0, up0 = _cpu_s(os.getpid()), _cpu_s(up)
            most = await _closed_loop(http, through[loop], a.seconds, a.closed_client)
            busy = (_cpu_s(pid) - cpu0) / a.seconds
            waited = (_waited_s(pid) - wait0) / a.seconds
            done = most * a.seconds
            print(
                f"through gateway-{loop}: {most:,.0f} req/s (64 {a.closed_client} clients, "
                f"closed loop; the "
                f"gateway busy {busy:.0%} of a CPU, ready but without one {waited:.0%} of "
                f"the time; CPU ms a request: gateway {1e3 * busy / most:.3f}, loadgen "
                f"{1e3 * (_cpu_s(os.getpid()) - gen0) / done:.3f}, upstream "
                f"{1e3 * (_cpu_s(up) - up0) / done:.3f})"
            )
        await said_collectors("closed loops")
        for loop in loops:
            rss = _rss_mb(procs.gateways[loop].pid)
            print(f"gateway-{loop} RSS: {rss0[loop]:.0f} MiB before the load, {rss:.0f} after")


async def _soak(a: argparse.Namespace, http: aiohttp.ClientSession, url: str, pid: int) -> None:
    """A steady mix through one gateway for `a.soak` seconds: `a.rate / 2` non-streaming
    requests a second and streams to keep about `a.streams / 2` open; RSS printed ten
    times."""
    stream_url = url.replace("chat/completions", "completions")
    duration = 16 / a.stream_tps if a.stream_tps > 0 else 1.0
    step = a.soak / 10
    print(
        f"soak: {a.rate / 2:g} req/s non-streaming + {a.streams / 2 / duration:.0f} streams/s "
        f"through one gateway for {a.soak:g} s; its RSS:"
    )
    rss = [_rss_mb(pid)]
    print(f"  t={0:5.0f} s  RSS {rss[0]:.1f} MiB")
    t0 = time.perf_counter()
    served = errors = 0
    for _ in range(10):
        chat, streams = await asyncio.gather(
            _open_loop(http, url, CHAT, a.rate / 2, step, False),
            _open_loop(http, stream_url, STREAM, a.streams / 2 / duration, step, True),
        )
        served += len(chat.lat) + len(streams.lat)
        errors += chat.errors + streams.errors
        rss.append(_rss_mb(pid))
        print(
            f"  t={time.perf_counter() - t0:5.0f} s  RSS {rss[-1]:.1f} MiB  "
            f"({served:,} requests so far, {errors} errors; this step's p99 "
            f"{_pct(chat.lat, 0.99):.1f} ms, stream first byte p99 {_pct(streams.lat, 0.99):.1f} ms)"
        )
    half = rss[len(rss) // 2]
    print(
        f"soak: RSS {rss[0]:.1f} MiB at the start, {rss[1]:.1f} after the first step, "
        f"{half:.1f} half way, {rss[-1]:.1f} at the end (max {max(rss):.1f}): the second "
        f"half {rss[-1] - half:+.1f} MiB; {served:,} requests, {errors} errors"
    )


class CollectorTimer:
    """How long the cyclic garbage collector held this process, by generation (a
    `gc.callbacks` entry): what a stall of the loop in the gateway, the load generator
    or a server costs the requests then waiting."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, int]] = []
        self._began = 0.0
        self.since = 0
        """Where the next `said` on a signal starts (a `mark()`)."""

    def install(self) -> CollectorTimer:
        import gc

        gc.callbacks.append(self._timed)
        return self

    def _timed(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((time.perf_counter() - self._began, info["generation"]))

    def mark(self) -> int:
        return len(self.pauses)

    def answer_signal(self) -> CollectorTimer:
        """On SIGUSR1, a GC_LINE on stderr: the collections since the last one."""

        def said(signum: int, frame: Any) -> None:
            sys.stderr.write(f"{GC_LINE} {self.said(self.since)}\n")
            sys.stderr.flush()
            self.since = self.mark()

        signal.signal(signal.SIGUSR1, said)
        return self

    def said(self, since: int = 0) -> str:
        """Per generation: collections, ms in all, the longest (ms), since `mark()`."""
        got = self.pauses[since:]
        parts = []
        for g in (0, 1, 2):
            ts = [1e3 * t for t, gen in got if gen == g]
            if ts:
                parts.append(f"gen{g} {len(ts)} x, {sum(ts):.0f} ms in all, longest {max(ts):.1f}")
        return "; ".join(parts) or "no collections"


def _serve_gateway(loop: str, argv: list[str]) -> int:
    """A gateway process on `loop` (`asyncio` or `uvloop`, its `--event-loop`; `-nofreeze`
    after it: with --no-gc-freeze; `-untuned`: --no-gc-tune; `-plain`: --no-fast-path;
    `-aiohttp`: --upstream-client aiohttp; `-lean`: --server lean; `-aioserver`: --server
    aiohttp; `-young20k`: --gc-thresholds 20000,10,10), which says at its exit, on stderr, how long the cyclic collector held its loop (the
    collections of its start, before it serves, not counted)."""
    from services.gateway.__main__ import main as gateway

    for suffix, flag in (
        ("-nofreeze", "--no-gc-freeze"),
        ("-untuned", "--no-gc-tune"),
        ("-plain", "--no-fast-path"),
        ("-aiohttp", "--upstream-client aiohttp"),
        ("-lean", "--server lean"),
        ("-aioserver", "--server aiohttp"),
    ):
        if suffix in loop:
            argv = [*argv, *flag.split()]
    # The loop the name says, whatever the gateway's default (`--event-loop auto`).
    argv = [*argv, "--event-loop", "uvloop" if loop.startswith("uvloop") else "asyncio"]
    if "-young20k" in loop:
        argv = [*argv, "--gc-thresholds", "20000,10,10"]  # the round before's
    timer = CollectorTimer().install().answer_signal()

    import services.gateway.server as server

    # The collections of its start (the freezes) are not the load's: counted from its
    # second freeze, once it serves.
    settle = server.settle_heap

    def settled() -> bool:
        done = settle()
        timer.since = timer.mark()
        return done

    server.settle_heap = settled
    if loop.startswith("uvloop"):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return gateway(argv)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rate", type=float, default=500.0, help="non-streaming requests a second")
    p.add_argument("--seconds", type=float, default=6.0, help="length of each round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each path")
    p.add_argument("--streams", type=int, default=300, help="streams open at once")
    p.add_argument("--stream-tps", type=float, default=8.0, help="a stream's tokens a second")
    p.add_argument(
        "--loops",
        default="asyncio,asyncio-nofreeze,uvloop",
        help="a gateway per event loop (uvloop skipped when not installed; -nofreeze: "
        "with --no-gc-freeze; -untuned: with --no-gc-tune, CPython's collector "
        "thresholds and no second freeze; -lean / -aioserver: --server lean / aiohttp)",
    )
    p.add_argument(
        "--closed-client",
        choices=("raw", "aiohttp"),
        default="raw",
        help="the closed loop's client (the most req/s): raw keep-alive connections, or "
        "aiohttp's (whose CPU a request made the load generator the bottleneck)",
    )
    p.add_argument(
        "--bench-gc",
        choices=("off", "tuned", "default"),
        default="off",
        help="the load generator's and the simulated servers' collector: off once their "
        "heap is frozen (the instruments never stall), tuned as the gateway's (frozen, "
        "young collections every 20,000 objects) or CPython's defaults",
    )
    p.add_argument("--pin", action="store_true", help="the gateways on a CPU of their own")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the bench's processes at this niceness (negative, as root: ahead of "
        "the machine's other work, so what is measured is theirs and not the wait for a CPU)",
    )
    p.add_argument(
        "--rt",
        type=int,
        default=0,
        metavar="PRIORITY",
        help="run the bench's processes at this real-time priority (SCHED_FIFO, 1-99, as "
        "root): a process that wakes runs at once instead of after the slice of whatever "
        "other work holds its CPU (which --nice only makes shorter)",
    )
    p.add_argument("--soak", type=float, default=0.0, metavar="SECONDS", help="RSS over time")
    p.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default="bench", help=argparse.SUPPRESS)
    p.add_argument("--tps", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument(
        "--keys",
        action="store_true",
        help="give every gateway an API key file (rpm and tpm set far past the load, so "
        "each request is admitted and settled against them) and send its key",
    )
    p.add_argument(
        "--tree",
        type=Path,
        default=None,
        metavar="DIR",
        help="another checkout of llmgw (the tree before a change): a loop named with "
        "`@tree` (`uvloop@tree`) runs its gateway, in the same run as this tree's",
    )
    p.add_argument("--serve-gateway", default=None, help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.serve_gateway is not None:
        sys.exit(_serve_gateway(a.serve_gateway, rest))
    if a.serve_upstream is not None:
        asyncio.run(_serve_upstream(a.serve_upstream, a.model, a.tps, a.bench_gc))
        return
    loops = [x for x in a.loops.split(",") if x]
    if any("@tree" in x for x in loops):
        if a.tree is None:
            sys.exit("a loop named with @tree needs --tree DIR (the other checkout)")
        a.tree = a.tree.resolve()
    if a.keys:
        JSON_TYPE["Authorization"] = f"Bearer {KEY}"
    if importlib.util.find_spec("uvloop") is None and any(x.startswith("uvloop") for x in loops):
        print("uvloop is not installed (pip install -e '.[bench]'): asyncio gateways only")
        loops = [x for x in loops if not x.startswith("uvloop")]
    if a.soak:
        loops = loops[:1]
    group = Path("/proc/self/autogroup")
    if a.nice:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, a.nice)  # the processes started inherit it
        except PermissionError:
            sys.exit(f"--nice {a.nice}: not permitted (a negative niceness needs root)")
        # With autogroups on, a niceness counts only within this session's group, which
        # shares the CPUs with every other session's: the group's own niceness is what
        # puts it ahead of them. Set back at the end.
        with contextlib.suppress(OSError):
            group.write_text(str(a.nice))
    if a.rt:
        try:
            # The processes started inherit it; the kernel keeps 5% of each CPU for the
            # rest (sched_rt_runtime_us), so a closed loop cannot starve the machine.
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(a.rt))
        except PermissionError:
            sys.exit(f"--rt {a.rt}: not permitted (a real-time priority needs root)")
    print(
        f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}"
        + ("; gateways pinned to the last CPU" if a.pin else "")
        + (f"; niceness {a.nice}" if a.nice else "")
        + (f"; real-time priority {a.rt} (SCHED_FIFO)" if a.rt else "")
        + f"; the bench's own collectors {a.bench_gc}"
    )
    procs = _start(a, loops)
    try:
        asyncio.run(_bench(a, procs, loops))
    finally:
        procs.stop()
        if a.nice:
            with contextlib.suppress(OSError):
                group.write_text("0")


if __name__ == "__main__":
    main()
