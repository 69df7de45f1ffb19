"""Benchmark: cold starts through the gateway's waiting room, one after another.

Run from the repository root: `python tests/bench/bench_coldstart.py [--starts 100]`.
Prints figures, asserts nothing (the issue's targets: 0 held requests lost; the first
byte of the first held request within 50 ms of the replica's ready being folded, p99;
`model.demanded` published within 10 ms of a request arriving for a model at zero, p99).

An embedded nats-server; one simulated model server (services.agent.responder, no
delays) as its own process; `python -m services.gateway` as its own process. Each round
is a cold start: the model has no replica; the bench sends one chat request (and, with
`--held N`, N-1 more behind it), times the `model.demanded` it hears on the demand
subject from the moment it sent the first request, then publishes a `replica.state`
ready with the server's endpoint (what an agent does once a start is done), reads the
answers, and takes the replica away (drained, stopped) for the next round.

Three figures a round: demand, from the request sent to the event heard (the client's
send, the gateway's parse and publish, the broker's delivery: more than the gateway's
share); wake, from the fold of the ready in the gateway to the first byte of the first
request it released (the gateway's own figure, read from its /health); and ready to
first byte as the bench sees it, from the ready published to the first byte received
(adds the broker's delivery and the gateway's fold to the wake).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# JSON_TYPE says a body is JSON, as the gateway asks (another type is 415).
JSON_TYPE = {"Content-Type": "application/json"}

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from schemas import codec, subjects  # noqa: E402
from schemas import events as ev  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402
from tests.bench.bench_gateway import _free_port, _pct, _waited_s  # noqa: E402

NODE = "bench-cold"
GATEWAY_LOG = Path()
MODEL = "cold"
CHAT = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
).encode()


def _start() -> tuple[EmbeddedBroker, list[subprocess.Popen[bytes]], int, int]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-coldstart-"))
    global GATEWAY_LOG
    GATEWAY_LOG = tmp / "gateway.log"
    broker = EmbeddedBroker(tmp / "broker")
    broker.start()
    up_port, gw_port = _free_port(), _free_port()
    upstream = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests/bench/bench_gateway.py"),
            "--serve-upstream",
            str(up_port),
        ]
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
        stderr=(tmp / "gateway.log").open("wb"),
    )
    return broker, [gateway, upstream], up_port, gw_port


async def _bench(
    a: argparse.Namespace,
    broker: EmbeddedBroker,
    up_port: int,
    gw_port: int,
    pids: dict[str, int],
) -> None:
    nc = await connect(broker.url, "bench")
    js = nc.jetstream()
    await ensure_streams(js)
    pub = Publisher(js)

    def make(data: ev.Data) -> ev.Event:
        return ev.make(data, id=new_id(), time=utc_now(), source="bench")

    def state(rid: str, s: str, endpoint: str | None = None) -> ev.Event:
        return make(
            ev.ReplicaState(
                replica=rid,
                model=MODEL,
                profile="p",
                state=s,  # type: ignore[arg-type]
                shards=(ev.ShardSpec(node=NODE, gpus=(0,)),),
                endpoint=endpoint,
            )
        )

    def placement(rid: str) -> ev.PlacementDecided:
        shards = (ev.ShardSpec(node=NODE, gpus=(0,)),)
        return ev.PlacementDecided(
            replica=rid, model=MODEL, profile="p", shards=shards, reason="bench"
        )

    gpu = ev.GpuInfo(index=0, uuid="g0", model="H100", memory_gb=80)
    await pub.publish(
        make(ev.NodeInventory(node=NODE, gpus=(gpu,), cpu_cores=8, memory_gb=64)), node=NODE
    )
    await pub.publish(
        make(ev.ModelDeclared(name=MODEL, min=0, profiles=(ev.ProfileSpec(name="p", gpus=1),)))
    )
    heard: asyncio.Queue[float] = asyncio.Queue()

    async def on_demand(msg: Any) -> None:
        t = time.perf_counter()
        if codec.decode(msg.data).data.waiting:  # type: ignore[union-attr]
            heard.put_nowait(t)  # (a waiting of 0 is a wait's end)

    await nc.subscribe(subjects.demand_subject(MODEL), cb=on_demand)
    base = f"http://127.0.0.1:{gw_port}"
    endpoint = f"http://127.0.0.1:{up_port}"
    demand: list[float] = []
    ready_to_first: list[float] = []
    lost = 0
    answered = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        deadline = time.monotonic() + 30
        while True:  # the gateway and the server up, and the model in the gateway's view
            try:
                async with http.get(f"{endpoint}/health") as r:
                    up = r.status == 200
                async with http.get(f"{base}/health") as r:
                    if up and MODEL in (await r.json())["routable"]:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the gateway did not come up")
            await asyncio.sleep(0.05)

        async def ask(first: asyncio.Future[float]) -> int:
            async with http.post(f"{base}/v1/chat/completions", data=CHAT, headers=JSON_TYPE) as r:
                await r.content.readany()
                if not first.done():
                    first.set_result(time.perf_counter())
                await r.read()
                return r.status

        waited0 = {k: _waited_s(pid) for k, pid in pids.items()}
        wall0 = time.perf_counter()
        for i in range(a.starts):
            rid = f"cold-{i}"
            while not heard.empty():
                heard.get_nowait()
            loop = asyncio.get_running_loop()
            first: asyncio.Future[float] = loop.create_future()
            t0 = time.perf_counter()
            tasks = [asyncio.create_task(ask(first))]
            t_heard = await asyncio.wait_for(heard.get(), 5)
            demand.append(t_heard - t0)
            for _ in range(a.held - 1):
                tasks.append(asyncio.create_task(ask(first)))
            await asyncio.sleep(0.01)  # the rest in the line (they wait behind the first)
            # Placed first: only a placement makes a replica (a report alone is refused).
            await pub.publish(make(placement(rid)))
            t_ready = time.perf_counter()
            await pub.publish(state(rid, "ready", endpoint), node=NODE)
            statuses = await asyncio.gather(*tasks, return_exceptions=True)
            ready_to_first.append(first.result() - t_ready)
            answered += sum(s == 200 for s in statuses)
            lost += sum(s != 200 for s in statuses)
            if any(s != 200 for s in statuses):
                print(f"round {i}: {statuses} (the gateway's log: {GATEWAY_LOG})")
            await pub.publish(
                make(ev.ReplicaDrain(replica=rid, model=MODEL, reason="scale_down")), node=NODE
            )
            await pub.publish(state(rid, "stopped"), node=NODE)
        wall = time.perf_counter() - wall0
        waited = {k: _waited_s(pid) - waited0[k] for k, pid in pids.items()}
        # The next round must start at zero: the gateway has folded the stop.
        async with http.get(f"{base}/health") as r:
            health = await r.json()
    await nc.close()
    wake = health["wake_ms"]
    print(
        f"{a.starts} cold starts, {a.held} held a start: {answered} answered 200, "
        f"{lost} lost; held at the end {sum(health['held'].values())}"
    )
    print(
        f"demand (request sent -> model.demanded heard): p50 {_pct(demand, 0.5):.2f} ms, "
        f"p99 {_pct(demand, 0.99):.2f} ms"
    )
    print(
        f"wake (ready folded -> first byte of the first held, in the gateway): "
        f"p50 {wake.get('p50', float('nan')):.2f} ms, p99 {wake.get('p99', float('nan')):.2f} ms "
        f"over {wake['n']}"
    )
    send = health["wake_send_ms"]
    print(
        f"of which the gateway's own (ready folded -> request sent to the replica): "
        f"p50 {send.get('p50', float('nan')):.2f} ms, p99 {send.get('p99', float('nan')):.2f} ms"
    )
    print(
        f"ready published -> first byte received (the bench's view): "
        f"p50 {_pct(ready_to_first, 0.5):.2f} ms, p99 {_pct(ready_to_first, 0.99):.2f} ms"
    )
    # Where the rest of a wake's tail goes on a busy host: each process ready to run and
    # waiting for a CPU (the run queue, /proc/PID/schedstat), a start's share of it.
    print(
        "ready but without a CPU, ms a start: "
        + ", ".join(f"{k} {1e3 * v / a.starts:.2f}" for k, v in waited.items())
        + f" (over {wall:.1f} s of starts)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--starts", type=int, default=100)
    p.add_argument("--held", type=int, default=4, help="requests held through each start")
    a = p.parse_args()
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    broker, procs, up_port, gw_port = _start()
    try:
        pids = {"gateway": procs[0].pid, "server": procs[1].pid, "bench": os.getpid()}
        asyncio.run(_bench(a, broker, up_port, gw_port, pids))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        broker.stop()


if __name__ == "__main__":
    main()
