"""Benchmark: 1, 2 and 3 gateway processes on the same upstreams, sharing their load and
limits over the broker (`services.gateway.share`), and without (`--no-share`).

Run from the repository root:

    python tests/bench/bench_gateways.py [--gateways 1,2,3] [--replicas 4]
        [--clients 48] [--seconds 5] [--ttft 0.02]

Prints figures, asserts nothing. An embedded nats-server; `--replicas` simulated model
servers (services.agent.responder, one process of their own) that take `--ttft` seconds
to answer (so requests pile up on a replica and the routing's counts matter); for each
arm, fresh `python -m services.gateway` processes on the log. A closed loop of
`--clients` clients (aiohttp, this process) sends chats round robin over the arm's
gateways for `--seconds`; first the same loop straight to the replicas (round robin),
which is what the gateways' added latency is measured against. For each arm:

- req/s, and the latency p50/p99 each request added over the direct loop's;
- the gateways' CPU (user + system, from /proc) per 1,000 requests, all together;
- the in-flight requests per replica, the fleet's (each gateway's own counts, summed,
  sampled every 20 ms from /health): the most loaded replica's mean over the least
  loaded one's (max/min), and the median over samples of each sample's max/min;
- the delay of shared counts: from a gateway's message to another's reading of it (p50
  and p99 as the gateways measured them, on this host's one clock), to which a sharing
  interval (`--share-interval`, 50 ms) adds up to its own length of staleness.

Then the choice of counters on a subject over a KV bucket (`--kv-seconds`, 0 to skip):
what a limit kept in a JetStream KV bucket would cost each limited request, a
compare-and-set increment of the key's count (`kv.get` then `kv.update` with its
revision), one client alone and three clients (three gateways) on one hot key, with the
conflicts they retry.

Then (`--prefix-scale`, 0 to skip) the prefix rule's hit rate on bench_prefix.py's
shared-prefix workload (16 groups, each its 2,000-token system prompt), sent through one
gateway and round robin through three (`--routing prefix`, shared and `--no-share`), on
fresh simulated servers with a prefix cache each time (in this process, so their cached
tokens are read directly), 4 requests at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from schemas import events as ev  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402

MODEL = "bench"
NODE = "bench-node"
CHAT = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()
JSON_TYPE = {"Content-Type": "application/json"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _serve_upstreams(ports: list[int], ttft: float) -> None:
    from services.agent.responder import Responder, Timing

    servers = []
    for i, port in enumerate(ports):
        r = Responder(f"{MODEL}-r{i}", MODEL, Timing(ttft, 0.0))
        await r.start(port)
        servers.append(r)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


async def _declare(url: str, ports: list[int]) -> None:
    nc = await connect(url, "bench")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        pub = Publisher(js)

        def make(data: ev.Data) -> ev.Event:
            return ev.make(data, id=new_id(), time=utc_now(), source="bench")

        gpus = tuple(
            ev.GpuInfo(index=i, uuid=f"g{i}", model="H100", memory_gb=80) for i in range(len(ports))
        )
        await pub.publish(
            make(ev.NodeInventory(node=NODE, gpus=gpus, cpu_cores=8, memory_gb=64)), node=NODE
        )
        profile = ev.ProfileSpec(name="p", gpus=1)
        await pub.publish(
            make(ev.ModelDeclared(name=MODEL, min=0, profiles=(profile,), target_inflight=10_000))
        )
        for i, port in enumerate(ports):
            shards = (ev.ShardSpec(node=NODE, gpus=(i,)),)
            rid = f"{MODEL}-r{i}"
            await pub.publish(
                make(
                    ev.PlacementDecided(
                        replica=rid, model=MODEL, profile="p", shards=shards, reason="bench"
                    )
                )
            )
            await pub.publish(
                make(
                    ev.ReplicaState(
                        replica=rid,
                        model=MODEL,
                        profile="p",
                        state="ready",
                        shards=shards,
                        endpoint=f"http://127.0.0.1:{port}",
                    )
                ),
                node=NODE,
            )
    finally:
        await nc.close()


async def _closed(
    http: aiohttp.ClientSession, urls: list[str], clients: int, seconds: float
) -> tuple[int, list[float]]:
    end = time.monotonic() + seconds
    lat: list[float] = []
    n = 0

    async def one(c: int) -> None:
        nonlocal n
        i = c
        while time.monotonic() < end:
            url = urls[i % len(urls)]
            i += 1
            t0 = time.perf_counter()
            async with http.post(url, data=CHAT, headers=JSON_TYPE) as r:
                await r.read()
                if r.status == 200:
                    lat.append(time.perf_counter() - t0)
                    n += 1

    await asyncio.gather(*(one(c) for c in range(clients)))
    return n, lat


async def _health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/health") as r:
        got: dict[str, Any] = await r.json()
        return got


async def _arm(
    a: argparse.Namespace, http: aiohttp.ClientSession, broker: str, n: int, share: bool, tmp: Path
) -> dict[str, Any]:
    ports = [_port() for _ in range(n)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [
        subprocess.Popen(  # noqa: ASYNC220 (started before the load)
            [
                sys.executable,
                "-m",
                "services.gateway",
                "--nats",
                broker,
                "--listen",
                f"127.0.0.1:{p}",
                *([] if share else ["--no-share"]),
            ],
            cwd=ROOT,
            stderr=(tmp / f"gw-{n}-{share}-{p}.log").open("wb"),
        )
        for p in ports
    ]
    try:
        deadline = time.monotonic() + 60
        for url in urls:
            while True:
                try:
                    h = await _health(http, url)
                    shared = (h.get("share") or {}).get("gateways", n)
                    if len(h["routable"].get(MODEL, [])) == a.replicas and shared == n:
                        break
                except (aiohttp.ClientError, json.JSONDecodeError):
                    pass
                assert time.monotonic() < deadline, f"{url} never ready"
                await asyncio.sleep(0.1)
        chats = [f"{u}/v1/chat/completions" for u in urls]
        await _closed(http, chats, a.clients, 1.0)  # warm
        cpu0 = sum(_cpu_s(p.pid) for p in procs)
        samples: list[dict[str, int]] = []
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                fleet: dict[str, int] = {f"{MODEL}-r{i}": 0 for i in range(a.replicas)}
                for url in urls:
                    for rid, k in (await _health(http, url))["inflight"].items():
                        fleet[rid] = fleet.get(rid, 0) + k
                samples.append(fleet)
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        t0 = time.monotonic()
        done, lat = await _closed(http, chats, a.clients, a.seconds)
        took = time.monotonic() - t0
        stop.set()
        await sampler
        cpu = sum(_cpu_s(p.pid) for p in procs) - cpu0
        busy = [s for s in samples if sum(s.values()) >= a.clients // 2]
        means = [statistics.fmean(s[r] for s in busy) for r in busy[0]] if busy else [0.0]
        ratios = [max(s.values()) / max(1, min(s.values())) for s in busy]
        delays = [(await _health(http, u)).get("share") or {} for u in urls]
        return {
            "rps": done / took,
            "lat": lat,
            "cpu_per_1000": cpu / max(1, done) * 1000,
            "maxmin_mean": max(means) / max(1e-9, min(means)),
            "maxmin_sample_p50": statistics.median(ratios) if ratios else float("nan"),
            "delay": [d.get("delay_ms") for d in delays],
        }
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


async def _prefix(a: argparse.Namespace, broker: str, tmp: Path) -> None:
    import random

    sys.path.insert(0, str(ROOT / "tests" / "bench"))
    import bench_prefix

    from services.agent.responder import Responder, Timing

    trace = bench_prefix.shared(a.prefix_scale, random.Random(7)).trace
    timing = Timing(0.0, 0.0, prefill_tps=400_000.0, cache_tokens=200_000)
    nc = await connect(broker, "bench")
    js = nc.jetstream()
    pub = Publisher(js)
    n_arm = 0
    async with aiohttp.ClientSession() as http:
        for gateways, share in ((1, True), (3, True), (3, False)):
            n_arm += 1
            model, node = f"pfx{n_arm}", f"pfx-node{n_arm}"

            def make(data: ev.Data) -> ev.Event:
                return ev.make(data, id=new_id(), time=utc_now(), source="bench")

            gpus = tuple(
                ev.GpuInfo(index=i, uuid=f"{node}-g{i}", model="H100", memory_gb=80)
                for i in range(a.replicas)
            )
            await pub.publish(
                make(ev.NodeInventory(node=node, gpus=gpus, cpu_cores=8, memory_gb=64)), node=node
            )
            profile = ev.ProfileSpec(name="p", gpus=1)
            await pub.publish(
                make(ev.ModelDeclared(name=model, min=0, profiles=(profile,), target_inflight=1000))
            )
            servers = []
            for i in range(a.replicas):
                s = Responder(f"{model}-r{i}", model, timing)
                await s.start()
                servers.append(s)
                shards = (ev.ShardSpec(node=node, gpus=(i,)),)
                await pub.publish(
                    make(
                        ev.PlacementDecided(
                            replica=s.replica, model=model, profile="p", shards=shards, reason=""
                        )
                    )
                )
                await pub.publish(
                    make(
                        ev.ReplicaState(
                            replica=s.replica,
                            model=model,
                            profile="p",
                            state="ready",
                            shards=shards,
                            endpoint=s.endpoint,
                        )
                    ),
                    node=node,
                )
            ports = [_port() for _ in range(gateways)]
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            procs = [
                subprocess.Popen(  # noqa: ASYNC220 (started before the load)
                    [
                        sys.executable,
                        "-m",
                        "services.gateway",
                        "--nats",
                        broker,
                        "--listen",
                        f"127.0.0.1:{p}",
                        "--routing",
                        "prefix",
                        *([] if share else ["--no-share"]),
                    ],
                    cwd=ROOT,
                    stderr=(tmp / f"pfx-{n_arm}-{p}.log").open("wb"),
                )
                for p in ports
            ]
            try:
                deadline = time.monotonic() + 60
                for url in urls:
                    while True:
                        try:
                            h = await _health(http, url)
                            shared = (h.get("share") or {}).get("gateways", gateways)
                            ready = len(h["routable"].get(model, [])) == a.replicas
                            if ready and shared == gateways:
                                break
                        except (aiohttp.ClientError, json.JSONDecodeError):
                            pass
                        assert time.monotonic() < deadline, f"{url} never ready"
                        await asyncio.sleep(0.1)
                sem = asyncio.Semaphore(4)

                async def one(
                    i: int,
                    body: dict[str, Any],
                    sem: asyncio.Semaphore = sem,
                    model: str = model,
                    urls: list[str] = urls,
                ) -> None:
                    async with sem:
                        data = json.dumps({"model": model, "max_tokens": 2, **body}).encode()
                        url = f"{urls[i % len(urls)]}/v1/chat/completions"
                        async with http.post(url, data=data, headers=JSON_TYPE) as r:
                            await r.read()

                await asyncio.gather(*(one(i, r.body) for i, r in enumerate(trace)))
                hit = sum(s.cached_tokens for s in servers) / sum(s.prompt_tokens for s in servers)
                print(
                    f"prefix, shared workload ({len(trace)} requests): {gateways} "
                    f"gateway{'s' if gateways > 1 else ''} {'shared' if share else 'local-only'}: "
                    f"hit rate {hit:.3f}"
                )
            finally:
                for p in procs:
                    p.send_signal(signal.SIGTERM)
                for p in procs:
                    p.wait(15)
                for s in servers:
                    await s.close()
    await nc.close()


async def _kv(broker: str, seconds: float) -> None:
    from nats.js.errors import KeyWrongLastSequenceError

    ncs = [await connect(broker, f"bench-kv-{i}") for i in range(3)]
    try:
        kv = await ncs[0].jetstream().create_key_value(bucket="bench_share")
        await kv.put("key", b"0")
        kvs = [await nc.jetstream().key_value("bench_share") for nc in ncs]

        async def client(i: int, end: float, lat: list[float], conflicts: list[int]) -> None:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                while True:
                    e = await kvs[i].get("key")
                    try:
                        await kvs[i].update(
                            "key", str(int(e.value or b"0") + 1).encode(), e.revision
                        )
                        break
                    except KeyWrongLastSequenceError:
                        conflicts[0] += 1
                lat.append(time.perf_counter() - t0)

        for n in (1, 3):
            lat: list[float] = []
            conflicts = [0]
            end = time.monotonic() + seconds
            await asyncio.gather(*(client(i, end, lat, conflicts) for i in range(n)))
            print(
                f"KV bucket, a compare-and-set increment a request, {n} client(s) on one key: "
                f"{len(lat) / seconds:.0f} increments/s, p50 {_pct(lat, 0.5) * 1000:.2f} ms, "
                f"p99 {_pct(lat, 0.99) * 1000:.2f} ms, {conflicts[0]} conflicts retried"
            )
        await ncs[0].jetstream().delete_key_value("bench_share")
    finally:
        for nc in ncs:
            await nc.close()


async def _main(a: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateways-"))
    broker = EmbeddedBroker(tmp / "broker")
    broker.start()
    ports = [_port() for _ in range(a.replicas)]
    up = subprocess.Popen(  # noqa: ASYNC220 (started before the load)
        [
            sys.executable,
            __file__,
            "--serve-upstreams",
            ",".join(map(str, ports)),
            "--ttft",
            str(a.ttft),
        ],
        stderr=(tmp / "upstreams.log").open("wb"),
    )
    try:
        await _declare(broker.url, ports)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as http:
            direct = [f"http://127.0.0.1:{p}/v1/chat/completions" for p in ports]
            deadline = time.monotonic() + 30
            while True:
                try:
                    await _closed(http, direct, 1, 0.05)
                    break
                except aiohttp.ClientError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            n, base = await _closed(http, direct, a.clients, a.seconds)
            b50, b99 = _pct(base, 0.5), _pct(base, 0.99)
            print(
                f"host: {os.cpu_count()} CPUs; {a.replicas} replicas answering in "
                f"{a.ttft * 1000:.0f} ms; {a.clients} clients, closed loop, {a.seconds:.0f} s"
            )
            print(
                f"direct: {n / a.seconds:.0f} req/s, p50 {b50 * 1000:.2f} ms, "
                f"p99 {b99 * 1000:.2f} ms"
            )
            arms = [(g, True) for g in a.gateways] + [(g, False) for g in a.gateways if g > 1]
            for g, share in arms:
                r = await _arm(a, http, broker.url, g, share, tmp)
                lat = r["lat"]
                print(
                    f"{g} gateway{'s' if g > 1 else ''} {'shared' if share else 'local-only'}: "
                    f"{r['rps']:.0f} req/s, added p50 {(_pct(lat, 0.5) - b50) * 1000:.2f} ms, "
                    f"p99 {(_pct(lat, 0.99) - b99) * 1000:.2f} ms; CPU "
                    f"{r['cpu_per_1000']:.2f} s / 1,000 requests; in flight per replica "
                    f"max/min {r['maxmin_mean']:.2f} (mean), {r['maxmin_sample_p50']:.2f} "
                    f"(median sample); shared counts' delay {r['delay']}"
                )
        if a.kv_seconds > 0:
            await _kv(broker.url, a.kv_seconds)
        if a.prefix_scale > 0:
            await _prefix(a, broker.url, tmp)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(10)
        broker.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateways", default="1,2,3")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--ttft", type=float, default=0.02)
    p.add_argument("--prefix-scale", type=float, default=1.0)
    p.add_argument("--kv-seconds", type=float, default=2.0)
    p.add_argument("--serve-upstreams", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve_upstreams:
        ports = [int(x) for x in a.serve_upstreams.split(",")]
        asyncio.run(_serve_upstreams(ports, a.ttft))
        return
    a.gateways = [int(x) for x in a.gateways.split(",")]
    asyncio.run(_main(a))


if __name__ == "__main__":
    main()
