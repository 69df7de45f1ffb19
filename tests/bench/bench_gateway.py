"""Benchmark: what the gateway adds, the same load side by side against a fast upstream
directly and through the gateway, in one run.

Run from the repository root: `python tests/bench/bench_gateway.py [--rate 500]
[--seconds 5] [--streams 300]`. Prints figures, asserts nothing (the issue's targets:
added latency p50 <= 1 ms and p99 <= 5 ms at 500 req/s non-streaming; >= 1,500 req/s
through one gateway process; streaming time-to-first-byte added p99 <= 5 ms with 300
concurrent streams).

An embedded nats-server; one simulated model server (services.agent.responder, no
delays) as its own process; `python -m services.gateway` as its own process, told of
the server by a `replica.state` with its endpoint. The load generator (aiohttp, this
process) first measures the upstream alone, then alternates direct and through-gateway
rounds of the same open-loop load: requests sent at a fixed rate whatever the answers
do, so a slow answer does not slow the offered load. Then a closed loop of 64 clients
for the most requests a second through the gateway, and a round of concurrent streams
for the time to first byte. The gateway's RSS is read from /proc before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from schemas import events as ev  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402

NODE = "bench-gw"
CHAT = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
).encode()
STREAM = json.dumps({"model": "bench", "prompt": "hi", "max_tokens": 16, "stream": True}).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else float("nan")


async def _serve_upstream(port: int, tps: float) -> None:
    from services.agent.responder import Responder, Timing

    r = Responder("bench-1", "bench", Timing(0.0, tps))
    await r.start(port)
    await asyncio.Event().wait()


async def _open_loop(
    http: aiohttp.ClientSession, url: str, rate: float, seconds: float
) -> tuple[list[float], int]:
    lat: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        t = time.perf_counter()
        try:
            async with http.post(url, data=CHAT) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    return
        except aiohttp.ClientError:
            errors += 1
            return
        lat.append(time.perf_counter() - t)

    tasks = []
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return lat, errors


async def _closed_loop(http: aiohttp.ClientSession, url: str, seconds: float) -> float:
    done = 0
    end = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < end:
            async with http.post(url, data=CHAT) as r:
                await r.read()
            done += 1

    await asyncio.gather(*(client() for _ in range(64)))
    return done / seconds


async def _streams(http: aiohttp.ClientSession, url: str, n: int) -> list[float]:
    ttfb: list[float] = []

    async def one() -> None:
        t = time.perf_counter()
        async with http.post(url, data=STREAM) as r:
            await r.content.readany()
            ttfb.append(time.perf_counter() - t)
            await r.read()

    await asyncio.gather(*(one() for _ in range(n)))
    return ttfb


def _start(a: argparse.Namespace) -> tuple[EmbeddedBroker, list[subprocess.Popen[bytes]], int, int]:
    """The broker, the upstream and the gateway, started; their ports."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    broker = EmbeddedBroker(tmp / "broker")
    broker.start()
    up_port, gw_port = _free_port(), _free_port()
    upstream = subprocess.Popen(
        [sys.executable, __file__, "--serve-upstream", str(up_port), "--tps", str(a.tps)]
    )
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.gateway",
            "--nats",
            broker.url,
            "--listen",
            f"127.0.0.1:{gw_port}",
        ],
        cwd=ROOT,
        stderr=subprocess.DEVNULL,
    )
    return broker, [gateway, upstream], up_port, gw_port


async def _bench(
    a: argparse.Namespace, broker: EmbeddedBroker, gateway_pid: int, up_port: int, gw_port: int
) -> None:
    nc = await connect(broker.url, "bench")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        pub = Publisher(js)

        def make(data: ev.Data) -> ev.Event:
            return ev.make(data, id=new_id(), time=utc_now(), source="bench")

        gpu = ev.GpuInfo(index=0, uuid="g0", model="H100", memory_gb=80)
        await pub.publish(
            make(ev.NodeInventory(node=NODE, gpus=(gpu,), cpu_cores=8, memory_gb=64)), node=NODE
        )
        await pub.publish(
            make(
                ev.ModelDeclared(name="bench", min=0, profiles=(ev.ProfileSpec(name="p", gpus=1),))
            )
        )
        await pub.publish(
            make(
                ev.ReplicaState(
                    replica="bench-1",
                    model="bench",
                    profile="p",
                    state="ready",
                    shards=(ev.ShardSpec(node=NODE, gpus=(0,)),),
                    endpoint=f"http://127.0.0.1:{up_port}",
                )
            ),
            node=NODE,
        )
        direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        through = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            deadline = time.monotonic() + 30
            while True:
                try:
                    async with http.post(through, data=CHAT) as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "the gateway never routed"
                await asyncio.sleep(0.1)
            rss0 = _rss_mb(gateway_pid)
            alone = await _closed_loop(http, direct, a.seconds)
            print(f"upstream alone: {alone:,.0f} req/s (64 clients, closed loop)")
            got: dict[str, list[float]] = {"direct": [], "through": []}
            errs = {"direct": 0, "through": 0}
            for _ in range(2):
                for name, url in (("direct", direct), ("through", through)):
                    lat, e = await _open_loop(http, url, a.rate, a.seconds / 2)
                    got[name] += lat
                    errs[name] += e
            for name in ("direct", "through"):
                print(
                    f"{name:8} at {a.rate:g} req/s: p50 {_pct(got[name], 0.5):.2f} ms, "
                    f"p99 {_pct(got[name], 0.99):.2f} ms, errors {errs[name]}"
                )
            print(
                f"added: p50 {_pct(got['through'], 0.5) - _pct(got['direct'], 0.5):.2f} ms, "
                f"p99 {_pct(got['through'], 0.99) - _pct(got['direct'], 0.99):.2f} ms"
            )
            most = await _closed_loop(http, through, a.seconds)
            print(f"through the gateway: {most:,.0f} req/s (64 clients, closed loop)")
            sd = await _streams(http, direct.replace("chat/completions", "completions"), a.streams)
            st = await _streams(http, through.replace("chat/completions", "completions"), a.streams)
            print(
                f"{a.streams} concurrent streams, time to first byte: direct p99 "
                f"{_pct(sd, 0.99):.2f} ms, through p99 {_pct(st, 0.99):.2f} ms "
                f"(added {_pct(st, 0.99) - _pct(sd, 0.99):.2f} ms)"
            )
            print(f"gateway RSS: {rss0:.0f} MiB before the load, {_rss_mb(gateway_pid):.0f} after")
    finally:
        await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--streams", type=int, default=300)
    p.add_argument("--tps", type=float, default=0.0, help="the upstream's tokens a second")
    p.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve_upstream is not None:
        asyncio.run(_serve_upstream(a.serve_upstream, a.tps))
        return
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    broker, procs, up_port, gw_port = _start(a)
    try:
        asyncio.run(_bench(a, broker, procs[0].pid, up_port, gw_port))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        broker.stop()


if __name__ == "__main__":
    main()
