"""Benchmark: the real agent's cost with idle ready replicas, and how long a drain takes
for a server that ignores SIGTERM.

Run from the repository root: `python tests/bench/bench_agent.py [--replicas 8]
[--seconds 30] [--grace 2]`. Prints figures, asserts nothing (targets: agent CPU under
1% of one core with 8 idle ready replicas; drain-to-stopped within the grace + 1 s).

An embedded nats-server; `llmgw agent --gpus 8xH100-80GB` (the process runtime) as its
own process with default intervals (heartbeat 1 s, health 1 s, metrics every 5 s); one
fake model server (tests/agent/fakeserver.py) per GPU, all ready and idle. The agent's
CPU is read from /proc (user + system) over the window. Then a server that ignores
SIGTERM and holds a request that never ends is drained with the grace given; the figure
is the time between its `draining` and `stopped` events.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.bus import EmbeddedBroker, connect, ensure_streams  # noqa: E402
from tests.agent import realagent as ra  # noqa: E402
from tests.agent.helpers import drain_cmd, start_cmd, states  # noqa: E402
from tests.agent.test_process_runtime import _ports, _post  # noqa: E402

NODE = "bench-agent"


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text()
    fields = f[f.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(url: str, data: Path, replicas: int, seconds: float, grace: float) -> None:
    nc = await connect(url, "bench-agent")
    js = nc.jetstream()
    await ensure_streams(js)
    await ra.publish(js, ra.declared("idle", ra.fake_runtime()))
    await ra.publish(
        js, ra.declared("deaf", ra.fake_runtime("--ignore-term", "--request-s", "3600"))
    )
    agent = ra.RealAgent(url, NODE, data, "--ports", _ports(replicas + 2), gpus="8xH100-80GB")
    try:
        for i in range(replicas):
            await ra.publish(js, start_cmd(f"idle-{i}", NODE, (i % 8,), model="idle"))

        async def ready() -> int:
            return sum(1 for e in await states(js, NODE) if e.data.state == "ready")

        deadline = time.monotonic() + 60
        while await ready() < replicas:
            if time.monotonic() > deadline:
                raise SystemExit(f"replicas not ready in 60 s:\n{agent.text()}")
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.0)  # let start-up work finish before measuring
        c0, t0 = _cpu_s(agent.proc.pid), time.monotonic()
        await asyncio.sleep(seconds)
        c1, t1 = _cpu_s(agent.proc.pid), time.monotonic()
        pct = 100 * (c1 - c0) / (t1 - t0)
        print(f"agent CPU, {replicas} idle ready replicas, {t1 - t0:.0f} s: {pct:.2f}% of one core")

        for i in range(replicas):
            await ra.publish(js, drain_cmd(f"idle-{i}", model="idle", grace_s=5.0), node=NODE)
        await ra.until_state(js, NODE, f"idle-{replicas - 1}", "stopped", 60)
        await ra.publish(js, start_cmd("deaf", NODE, (0,), model="deaf"))
        await ra.until_state(js, NODE, "deaf", "ready", 60)
        port = ra.servers(data, NODE)["deaf"]["port"]
        threading.Thread(target=_post, args=(port, 3600), daemon=True).start()
        await asyncio.sleep(0.5)
        await ra.publish(js, drain_cmd("deaf", model="deaf", grace_s=grace), node=NODE)
        es = await ra.until_state(js, NODE, "deaf", "stopped", 60)
        took = (es[-1].time - es[-2].time).total_seconds()
        print(
            f"drain-to-stopped, SIGTERM ignored, a request in flight, grace {grace:g} s: "
            f"{took:.2f} s ({es[-2].data.state} -> {es[-1].data.state})"
        )
    finally:
        agent.stop()
        ra.sweep(NODE)
        await nc.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--grace", type=float, default=2.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        broker = EmbeddedBroker(Path(tmp) / "broker")
        broker.start()
        try:
            asyncio.run(bench(broker.url, Path(tmp), args.replicas, args.seconds, args.grace))
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
