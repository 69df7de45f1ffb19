"""Benchmark: a gateway process killed -9 under an open-loop load through the fleet.

Run from the repository root:

    python tests/bench/bench_gateway_kill.py [--rate 200] [--seconds 20] [--gateways 3]

Prints figures, asserts nothing. `llmgw up --simulate 2x4xH100-80GB --gateways N` (the
gateways on one SO_REUSEPORT port, processes of their own), `chat` on 3 simulated
replicas answering `--tokens` tokens at 50 a second (0.1 s for 5). An open loop (a
request every 1/rate s whatever the answers do) of whole chats over a pool of
HTTP/1.1 keep-alive connections (a raw client in this process, cheaper than a library's
at this rate; a connection is opened when none is idle, so the kernel spreads the
connections over the gateways, and one the server closed is not reused, as a
library's pool does). Midway one gateway process is killed -9; `up` starts it again.

Each request's connection is known by its local port, and at the kill the ports of the
connections the killed process held are read from /proc, so each failure is told apart:
begun before the kill on the killed process (its own in flight: the only ones expected
to fail), sent after it on a connection the killed process had held (the client's pool
had not yet seen it closed), or anything else (an error from a gateway that lives, or a
request on another's connection: none expected).

The plane's evidence: the scheduler's and preemption's leases (`up`'s output: each led
once, never lost, as tests/e2e/test_gateway_fleet.py checks), and two decisions timed
from the log, from `scale.desired` to `placement.decided` and to the replica `ready`:
`other` scaled to 1 a quarter into the run (under load, no kill) and `spare` scaled to 1
at the kill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from schemas import codec  # noqa: E402
from schemas import events as ev  # noqa: E402
from services.bus import connect, consume  # noqa: E402
from tests.up_process import UpProcess  # noqa: E402

CLUSTER = """\
models:
  - name: chat
    min: 0
    max: 4
    target_inflight: 32
    profiles: [{name: tp1, gpus: 1}]
  - name: other
    min: 0
    profiles: [{name: tp1, gpus: 1}]
  - name: spare
    min: 0
    profiles: [{name: tp1, gpus: 1}]
scale:
  chat: 3
"""


@dataclass
class Sent:
    at: float
    port: int = 0
    took: float = 0.0
    error: str | None = None


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.port = int(writer.get_extra_info("sockname")[1])

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())


class Pool:
    """HTTP/1.1 keep-alive connections to one address; a request takes an idle one or
    opens another."""

    def __init__(self, host: str, port: int, path: str, body: bytes) -> None:
        self.host, self.port = host, port
        self.head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.idle: list[Conn] = []
        self.opened = 0

    async def _take(self) -> Conn:
        while self.idle:
            c = self.idle.pop()
            if c.usable():
                return c
            c.writer.close()
        r, w = await asyncio.open_connection(self.host, self.port)
        self.opened += 1
        return Conn(r, w)

    async def one(self, s: Sent) -> None:
        t0 = time.perf_counter()
        c: Conn | None = None
        try:
            c = await self._take()
            s.port = c.port
            c.writer.write(self.head)
            status = (await c.reader.readuntil(b"\r\n")).split(b" ", 2)
            length, chunked, close = 0, False, False
            while (line := await c.reader.readuntil(b"\r\n")) != b"\r\n":
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
                elif name == b"connection" and b"close" in value.lower():
                    close = True
            if chunked:
                body = b""
                while size := int((await c.reader.readuntil(b"\r\n")).strip(), 16):
                    body += (await c.reader.readexactly(size + 2))[:-2]
                await c.reader.readuntil(b"\r\n")
            else:
                body = await c.reader.readexactly(length)
            if status[1] != b"200":
                s.error = f"status {status[1].decode()}"
            elif b'"choices"' not in body:
                s.error = "no choices"
            if close:
                c.writer.close()
            else:
                self.idle.append(c)
            c = None
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            s.error = f"connection: {type(e).__name__}"
        finally:
            if c is not None:
                c.writer.close()
            s.took = time.perf_counter() - t0


def _ports_of(pid: int, server_port: int) -> set[int]:
    """The client ports of the connections `pid` holds to its listening `server_port`."""
    inodes = set()
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            local, remote, inode = f[1], f[2], f[9]
            if inode in inodes and int(local.rsplit(":", 1)[1], 16) == server_port:
                ports.add(int(remote.rsplit(":", 1)[1], 16))
    return ports


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _until(what: str, up: UpProcess, check: Any, within_s: float = 60) -> Any:
    deadline = time.monotonic() + within_s
    while not (got := check()):
        assert up.alive(), up.text()[-3000:]
        assert time.monotonic() < deadline, f"{what} not within {within_s}s"
        time.sleep(0.1)
    return got


def _pids(up: UpProcess) -> list[int]:
    got = up.llmgw("get", "gateways", "-o", "json")
    return sorted(g["pid"] for g in json.loads(got.stdout)["items"]) if got.returncode == 0 else []


async def _decisions(url: str) -> dict[str, tuple[float, float]]:
    """Per model scaled by the bench: seconds from its `scale.desired` to its
    `placement.decided`, and to its replica's `ready`."""
    nc = await connect(url, "bench")
    try:
        js = nc.jetstream()
        desired: dict[str, Any] = {}
        placed: dict[str, tuple[str, Any]] = {}
        ready: dict[str, Any] = {}
        async for batch in consume.read_range(js, 1):
            for d in batch:
                try:
                    e = codec.decode(d.data)
                except Exception:  # not every subject is an event
                    continue
                if isinstance(e, ev.ScaleDesiredEvent) and e.data.model in ("other", "spare"):
                    desired.setdefault(e.data.model, e.time)
                elif isinstance(e, ev.PlacementDecidedEvent) and e.data.model in desired:
                    placed.setdefault(e.data.model, (e.data.replica, e.time))
                elif isinstance(e, ev.ReplicaStateEvent) and e.data.state == "ready":
                    ready.setdefault(e.data.replica, e.time)
        out = {}
        for m, t in desired.items():
            if m in placed:
                rid, pt = placed[m]
                rt = ready.get(rid)
                out[m] = (
                    (pt - t).total_seconds(),
                    (rt - t).total_seconds() if rt is not None else float("nan"),
                )
        return out
    finally:
        await nc.close()


async def _load(
    pool: Pool, rate: float, seconds: float, at_kill: Any, at_quarter: Any
) -> tuple[list[Sent], float, float]:
    sent: list[Sent] = []
    tasks = []
    n = int(rate * seconds)
    late = 0.0
    t0 = time.perf_counter()
    kill_at = quarter_at = -1
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            late = max(late, -delay)
        if i == n // 4:
            quarter_at = i
            at_quarter()
        if i == n // 2:
            kill_at = i
            at_kill()
        s = Sent(time.perf_counter())
        sent.append(s)
        tasks.append(asyncio.create_task(pool.one(s)))
    send_s = time.perf_counter() - t0
    await asyncio.gather(*tasks)
    del kill_at, quarter_at
    return sent, send_s, late


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=200.0, help="requests a second (open loop)")
    p.add_argument("--seconds", type=float, default=20.0, help="how long the load runs")
    p.add_argument("--gateways", type=int, default=3, help="`llmgw up --gateways N`")
    p.add_argument("--tokens", type=int, default=5, help="each answer's tokens (50 a second)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-kill-") as d:
        run(Path(d), a)


def run(base: Path, a: argparse.Namespace) -> None:
    up = UpProcess(
        base / "data",
        base / "up.log",
        *("--simulate", "2x4xH100-80GB", "--no-ui", "--gateways", str(a.gateways)),
        *("--gateway-listen", "127.0.0.1:0", "--sim-ttft", "0", "--sim-tps", "50"),
        *("--start-delay", "0.01", "--load-delay", "0.05"),
    )
    try:
        url = up.wait_url()
        gw = base / "data" / "gateway.url"
        gateway = _until("gateway.url", up, lambda: gw.exists() and gw.read_text().strip())
        spec = base / "cluster.yaml"
        spec.write_text(CLUSTER)
        assert up.llmgw("apply", "-f", str(spec)).returncode == 0
        health = gateway.removesuffix("/v1") + "/health"
        _until("chat on 3", up, lambda: len(_get(health)["routable"].get("chat", [])) == 3)
        pids = _until(f"{a.gateways} gateways", up, lambda: len(p := _pids(up)) == a.gateways and p)
        host, port = gateway.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
        body = json.dumps(
            {
                "model": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": a.tokens,
            }
        ).encode()
        pool = Pool(host, int(port), "/v1/chat/completions", body)
        victim = pids[0]
        killed: dict[str, Any] = {}
        cpu0 = {pid: _cpu(pid) for pid in pids}

        def at_quarter() -> None:
            killed["scale_other"] = asyncio.get_running_loop().run_in_executor(
                None, up.llmgw, "scale", "other", "1"
            )

        def at_kill() -> None:
            killed["cpu"] = {pid: _cpu(pid) - cpu0[pid] for pid in pids}
            killed["ports"] = _ports_of(victim, int(port))
            killed["at"] = time.perf_counter()
            os.kill(victim, signal.SIGKILL)
            killed["scale_spare"] = asyncio.get_running_loop().run_in_executor(
                None, up.llmgw, "scale", "spare", "1"
            )

        async def drive() -> tuple[list[Sent], float, float]:
            got = await _load(pool, a.rate, a.seconds, at_kill, at_quarter)
            for k in ("scale_other", "scale_spare"):
                assert (await killed[k]).returncode == 0
            for c in pool.idle:
                c.writer.close()
            return got

        sent, send_s, late = asyncio.run(drive())
        kill_t = killed["at"]
        restarted = _until(
            "the killed gateway started again",
            up,
            lambda: len(p := _pids(up)) == a.gateways and victim not in p and p,
        )
        decisions = asyncio.run(_decisions(url))
        text = up.text()
    finally:
        code = up.stop()
    ports = killed["ports"]
    ok = [s for s in sent if s.error is None]
    failed = [s for s in sent if s.error is not None]
    own = [s for s in failed if s.at <= kill_t and s.port in ports]
    stale = [s for s in failed if s.at > kill_t and s.port in ports]
    other = [s for s in failed if s not in own and s not in stale]
    took = sorted(s.took for s in ok)
    answered_s = max(s.at + s.took for s in sent) - min(s.at for s in sent)
    print(f"load: {a.rate:g} req/s open loop for {a.seconds:g} s through {a.gateways} gateways")
    print(
        f"sent {len(sent)} in {send_s:.2f} s ({len(sent) / send_s:.1f} req/s sent; the "
        f"sender at most {late * 1000:.0f} ms behind its schedule), answered in "
        f"{answered_s:.2f} s; {pool.opened} connections opened"
    )
    print(
        f"ok {len(ok)}, failed {len(failed)}; latency of the ok p50 "
        f"{statistics.median(took) * 1000:.1f} ms, p99 {took[int(0.99 * len(took))] * 1000:.1f} ms"
    )
    print(
        f"failed, begun before the kill on the killed process (its own in flight): {len(own)} "
        f"{dict(Counter(s.error for s in own))}"
    )
    print(
        f"failed, sent after the kill on a connection the killed process had held: "
        f"{len(stale)} {dict(Counter(s.error for s in stale))}"
        + (
            f", sent at most {max(s.at - kill_t for s in stale) * 1000:.1f} ms after it (before "
            "the client had read the connection's end)"
            if stale
            else ""
        )
    )
    print(f"failed otherwise: {len(other)} {dict(Counter(s.error for s in other))}")
    inflight_victim = sum(1 for s in sent if s.port in ports and s.at <= kill_t < s.at + s.took)
    print(
        f"the killed process held {len(ports)} connections and {inflight_victim} requests "
        "open at the kill by the client's clock (an answer already sent but not yet read counts)"
    )
    print(
        "gateways' CPU until the kill (s): "
        + ", ".join(f"{pid}: {c:.2f}" for pid, c in killed["cpu"].items())
    )
    print(f"killed {victim}; {a.gateways} gateways again: {restarted}")
    print(
        "plane: scheduler led "
        f"{text.count('scheduler: leading')}x, preemption led "
        f"{text.count('leading; consuming')}x, 'stands by' "
        f"{text.count('stands by')}x, 'lost the lease' {text.count('lost the lease')}x, "
        f"'stopping everything' {text.count('stopping everything')}x; up exited {code}"
    )
    for m, what in (("other", "a quarter in, no kill"), ("spare", "at the kill")):
        if m in decisions:
            placed, ready = decisions[m]
            print(
                f"decision {what}: {m} scale.desired -> placement.decided {placed * 1000:.0f} ms, "
                f"-> ready {ready * 1000:.0f} ms"
            )
        else:
            print(f"decision {what}: {m} not placed")


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
