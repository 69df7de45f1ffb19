"""Benchmark: a critical model's time to first byte while an opportunistic model sharing
the gateway is offered twice what its replicas take.

Run from the repository root: `python tests/bench/bench_overload.py [--seconds 10]
[--rounds 2]`. Prints figures, asserts nothing (the issue's target: at 2x a model's
capacity, the critical model's requests keep their time-to-first-byte p99 within 1.2x
of the unloaded figure).

An embedded nats-server; two simulated model servers (services.agent.responder), each
a process of its own as two replicas on two GPUs would be, one replica of `crit`
(critical) and one of `opp` (opportunistic), each taking `--ttft` to its first token and streaming `--tokens`
tokens at `--tps` (by default 0.1 s and 50 tokens at 100 a second: 0.6 s, a short chat
answer); `python -m services.gateway` as its own process. `opp` declares
`target_inflight` `--opp-target` (2), so the gateway sends its replica at most 4 at once
(x INFLIGHT_FACTOR); its capacity is that over one request's time, and the bench offers
it twice that, open loop (sent at a fixed rate whatever the answers do). The rest
waits in its line (256) and past it is refused with 429. `crit` is offered a steady
`--crit-rate` of streaming requests in both phases; its time to first byte is read at
the client, in this process; `opp`'s load comes from a process of its own, so that
what is shared between the two is the gateway (and the host's CPUs), not the client's
event loop. The two phases alternate (unloaded, loaded, ...), `--rounds` times each,
and the figures are the medians over the rounds of each round's p50 and p99. A third
phase, the control, offers `opp`'s load straight to its replica, around the gateway:
the host's CPUs as loaded, the gateway not; what the loaded phase adds over the
control is the gateway's share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# JSON_TYPE says a body is JSON, as the gateway asks (another type is 415).
JSON_TYPE = {"Content-Type": "application/json"}

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from schemas import events as ev  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402
from services.core.routing import INFLIGHT_FACTOR  # noqa: E402
from tests.bench.bench_gateway import _free_port, _pct  # noqa: E402

NODE = "bench-ovl"


def _body(model: str, tokens: int) -> bytes:
    return json.dumps(
        {"model": model, "prompt": "hi", "max_tokens": tokens, "stream": True}
    ).encode()


async def _serve(port: int, model: str, ttft: float, tps: float) -> None:
    from services.agent.responder import Responder, Timing

    r = Responder(f"{model}-1", model, Timing(ttft, tps))
    await r.start(port)
    await asyncio.Event().wait()


async def _offer(url: str, model: str, tokens: int, rate: float, seconds: float) -> None:
    """The opportunistic load, as its own process: prints its statuses as JSON."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        _, statuses = await _load(http, url, _body(model, tokens), rate, seconds)
    print(json.dumps(statuses), flush=True)


async def _load(
    http: aiohttp.ClientSession, url: str, body: bytes, rate: float, seconds: float
) -> tuple[list[float], dict[int, int]]:
    """Open loop: `rate` streaming requests a second for `seconds`; each one's time to
    first byte (200s), and the count of each status."""
    ttfb: list[float] = []
    statuses: dict[int, int] = {}

    async def one() -> None:
        t0 = time.perf_counter()
        try:
            async with http.post(url, data=body, headers=JSON_TYPE) as r:
                if r.status == 200:
                    await r.content.readany()
                    ttfb.append(time.perf_counter() - t0)
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
        except aiohttp.ClientError:
            statuses[0] = statuses.get(0, 0) + 1

    tasks = []
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return ttfb, statuses


async def _bench(a: argparse.Namespace, broker: EmbeddedBroker, ports: list[int], gw: int) -> None:
    nc = await connect(broker.url, "bench")
    js = nc.jetstream()
    await ensure_streams(js)
    pub = Publisher(js)

    def make(data: ev.Data) -> ev.Event:
        return ev.make(data, id=new_id(), time=utc_now(), source="bench")

    gpus = tuple(ev.GpuInfo(index=i, uuid=f"g{i}", model="H100", memory_gb=80) for i in range(2))
    await pub.publish(
        make(ev.NodeInventory(node=NODE, gpus=gpus, cpu_cores=8, memory_gb=64)), node=NODE
    )
    for name, cls, target in (("crit", "critical", 8), ("opp", "opportunistic", a.opp_target)):
        await pub.publish(
            make(
                ev.ModelDeclared(
                    name=name,
                    cls=cls,  # type: ignore[arg-type]
                    min=0,
                    target_inflight=target,
                    profiles=(ev.ProfileSpec(name="p", gpus=1),),
                )
            )
        )
    for i, (rid, model) in enumerate((("crit-1", "crit"), ("opp-1", "opp"))):
        # Placed first: only a placement makes a replica (a report alone is refused).
        shards = (ev.ShardSpec(node=NODE, gpus=(i,)),)
        placed = ev.PlacementDecided(
            replica=rid, model=model, profile="p", shards=shards, reason="bench"
        )
        await pub.publish(make(placed))
        await pub.publish(
            make(
                ev.ReplicaState(
                    replica=rid,
                    model=model,
                    profile="p",
                    state="ready",
                    shards=(ev.ShardSpec(node=NODE, gpus=(i,)),),
                    endpoint=f"http://127.0.0.1:{ports[i]}",
                )
            ),
            node=NODE,
        )
    base = f"http://127.0.0.1:{gw}"
    url = f"{base}/v1/completions"
    crit = _body("crit", a.tokens)
    one_s = a.ttft + (a.tokens / a.tps if a.tps else 0.0)
    capacity = a.opp_target * INFLIGHT_FACTOR / one_s  # in flight at once, over one request
    opp_rate = 2 * capacity
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        deadline = time.monotonic() + 30
        while True:
            try:
                async with http.get(f"{base}/health") as r:
                    routable = (await r.json())["routable"]
                    if routable.get("crit") and routable.get("opp"):
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the gateway did not come up")
            await asyncio.sleep(0.05)
        await _load(http, url, crit, a.crit_rate, 1.0)  # warm up
        print(
            f"one request {one_s * 1e3:.0f} ms; opp's capacity {capacity:.0f} req/s, offered "
            f"{opp_rate:.0f} req/s; crit offered {a.crit_rate:.0f} req/s; "
            f"{a.seconds:g} s a phase"
        )
        quiet: list[tuple[float, float]] = []
        loaded: list[tuple[float, float]] = []
        control: list[tuple[float, float]] = []

        async def beside(target: str) -> tuple[list[float], dict[int, int], dict[str, int]]:
            offer = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--offer",
                target,
                "opp",
                str(opp_rate),
                str(a.seconds),
                "--tokens",
                str(a.tokens),
                stdout=asyncio.subprocess.PIPE,
            )
            await asyncio.sleep(0.5)  # its interpreter up and its load begun
            t, cs = await _load(http, url, crit, a.crit_rate, a.seconds)
            out, _ = await offer.communicate()
            return t, cs, json.loads(out.decode().strip().splitlines()[-1])

        direct = f"http://127.0.0.1:{ports[1]}/v1/completions"
        for rnd in range(a.rounds):
            t, _ = await _load(http, url, crit, a.crit_rate, a.seconds)
            quiet.append((_pct(t, 0.5), _pct(t, 0.99)))
            t, cs, os_ = await beside(url)
            loaded.append((_pct(t, 0.5), _pct(t, 0.99)))
            print(
                f"round {rnd + 1}: crit unloaded p50 {quiet[-1][0]:.2f} / p99 {quiet[-1][1]:.2f}"
                f" ms; loaded p50 {loaded[-1][0]:.2f} / p99 {loaded[-1][1]:.2f} ms "
                f"(crit statuses {cs}); opp statuses {os_}"
            )
            await asyncio.sleep(1.0)  # opp's line drained before the control
            t, _, _ = await beside(direct)
            control.append((_pct(t, 0.5), _pct(t, 0.99)))
            print(
                f"         control (opp's load around the gateway): crit p50 "
                f"{control[-1][0]:.2f} / p99 {control[-1][1]:.2f} ms"
            )
    await nc.close()
    q50 = statistics.median(x for x, _ in quiet)
    q99 = statistics.median(x for _, x in quiet)
    l50 = statistics.median(x for x, _ in loaded)
    l99 = statistics.median(x for _, x in loaded)
    c50 = statistics.median(x for x, _ in control)
    c99 = statistics.median(x for _, x in control)
    print(
        f"crit time to first byte, median of {a.rounds} rounds: unloaded p50 {q50:.2f} ms / "
        f"p99 {q99:.2f} ms; with opp at 2x its capacity p50 {l50:.2f} ms / p99 {l99:.2f} ms; "
        f"p99 ratio {l99 / q99:.2f}; control (the same load around the gateway) p50 "
        f"{c50:.2f} ms / p99 {c99:.2f} ms, loaded over control p99 {l99 / c99:.2f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--crit-rate", type=float, default=10.0)
    p.add_argument("--ttft", type=float, default=0.1)
    p.add_argument("--tps", type=float, default=100.0)
    p.add_argument("--tokens", type=int, default=50)
    p.add_argument("--opp-target", type=int, default=2, help="opp's target_inflight")
    p.add_argument("--serve", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--offer", nargs=4, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve is not None:
        asyncio.run(_serve(int(a.serve[0]), a.serve[1], a.ttft, a.tps))
        return
    if a.offer is not None:
        url, model, rate, seconds = a.offer
        asyncio.run(_offer(url, model, a.tokens, float(rate), float(seconds)))
        return
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    broker = EmbeddedBroker(tmp / "broker")
    broker.start()
    ports = [_free_port(), _free_port()]
    gw = _free_port()
    procs = [
        *(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--serve",
                    str(port),
                    model,
                    "--ttft",
                    str(a.ttft),
                    "--tps",
                    str(a.tps),
                ]
            )
            for port, model in zip(ports, ("crit", "opp"), strict=True)
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.gateway",
                "--nats",
                broker.url,
                "--listen",
                f"127.0.0.1:{gw}",
            ],
            cwd=ROOT,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        asyncio.run(_bench(a, broker, ports, gw))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        broker.stop()


if __name__ == "__main__":
    main()
