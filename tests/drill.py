"""The drain drill: steady load through the gateway while the plane takes replicas away.

`llmgw up --simulate 3x4xH100-80GB` as a real process, its simulated servers stopping at
once on a drain (`--sim-no-drain`, as a server that exits on SIGTERM: only the agents'
wait for the gateway keeps a request in flight whole), and an open-loop load of `rate`
requests a second for `seconds` (aiohttp; every other one streaming, half to `chat`,
half to `batch`, each far shorter than the drain's grace). Meanwhile, at fixed points of
the run: a critical model is scaled up (the preemption service drains `batch` replicas
for it), `chat` is scaled down, one node is drained (`llmgw drain node`), and `batch` is
scaled down. Counted: requests, client-visible errors (any status but 200, a stream
that does not end in `data: [DONE]`, a broken connection), latency, the gateway's
retries, and misroutes: answers picked (their `x-llmgw-seq`) from a view that had
already folded a `replica.drain` of the replica that served them (the drain's stream
seq, read from the log after the run).

Used by tests/bench/bench_drain_drill.py (the full size, figures printed) and
tests/e2e/test_drain_drill.py (scaled down, in the suite).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from schemas import codec
from schemas import events as ev
from services.bus import connect, consume
from services.plane.follower import ViewFollower
from tests.up_process import UpProcess

GRACE_S = 10.0
NODES = "3x4xH100-80GB"
CLUSTER = """\
models:
  - name: chat
    class: standard
    min: 1
    max: 6
    profiles: [{name: tp1, gpus: 1}]
  - name: batch
    class: opportunistic
    min: 1
    max: 8
    profiles: [{name: tp1, gpus: 1}]
  - name: urgent
    class: critical
    min: 0
    max: 4
    profiles: [{name: tp1, gpus: 1}]
scale:
  chat: 4
  batch: 8
"""
LOADED = ("chat", "batch")
# min 1: neither is on-demand, so the autoscaler does not size them down to the load
# meanwhile (a model it takes to one replica can be left with none by the next drain).
# MAX_TOKENS after the simulated 0.3 s to the first token, at 50 tokens a second: an
# answer of half a second (a twentieth of the grace) in ten chunks, so that what is
# measured is the drains and not the host's cost of a chunk.
MAX_TOKENS = 10
SIM_TTFT_S = 0.3
SIM_TPS = 50


@dataclass
class Answer:
    model: str
    stream: bool
    sent: float
    took: float
    status: int
    replica: str = ""
    seq: int = 0
    error: str | None = None
    tokens: int = 0


@dataclass
class Figures:
    """What a drill measured."""

    rate: float
    seconds: float
    streaming: str = "half streaming"
    answers: list[Answer] = field(default_factory=list)
    drains: dict[str, int] = field(default_factory=dict)
    """Replica -> the stream seq of its (first) `replica.drain`."""
    reasons: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    steps: list[str] = field(default_factory=list)
    freed: list[float] = field(default_factory=list)
    tps: float = SIM_TPS
    """The simulated servers' pace, tokens a second."""
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds (user + system) while the load ran, by process: the load's client
    (this process), the gateways, `up` (the plane and the simulated servers), the
    broker; and `wall`, the load's seconds, and `load1`, the host's load average after."""
    """Seconds from each preempted replica's `replica.drain` to its `stopped`: from the
    decision to the preempting model's GPUs freed."""

    @property
    def errors(self) -> list[Answer]:
        return [a for a in self.answers if a.error is not None]

    @property
    def misroutes(self) -> list[Answer]:
        return [
            a for a in self.answers if a.replica in self.drains and self.drains[a.replica] <= a.seq
        ]

    @property
    def drained_under_load(self) -> int:
        """Drained replicas that had served at least one request of the drill."""
        served = {a.replica for a in self.answers}
        return len(served & set(self.drains))

    def quantile_ms(self, q: float) -> float:
        took = sorted(a.took for a in self.answers if a.error is None)
        if not took:
            return float("nan")
        if q == 0.5:
            return statistics.median(took) * 1000
        return took[min(len(took) - 1, int(q * len(took)))] * 1000

    def summary(self) -> str:
        """One line: the errors, and the preempted replicas' drain to stopped."""
        kinds = Counter(a.error for a in self.errors)
        freed = (
            f"p50 {statistics.median(self.freed):.2f} s, max {max(self.freed):.2f} s "
            f"({len(self.freed)} replicas)"
            if self.freed
            else "none preempted"
        )
        return (
            f"{len(self.answers)} requests, {len(self.errors)} client-visible errors"
            + (f" {dict(kinds)}" if kinds else "")
            + f"; preempted, decision to GPUs freed: {freed}"
        )

    def _by_time(self) -> list[str]:
        first = min(a.sent for a in self.answers)
        spans: dict[int, Counter[str]] = {}
        for a in self.errors:
            spans.setdefault(int((a.sent - first) // 10), Counter())[str(a.error)] += 1
        return [f"{k * 10}s {dict(spans[k])}" for k in sorted(spans)]

    def _stretch(self) -> list[str]:
        """Each answered stream's time over what its server takes (0.3 s to the first
        token, then `tps` tokens a second), p50 / max by when sent: above 1 the host (the
        servers, the gateways or the client) fell behind the streams' pace."""
        first = min(a.sent for a in self.answers)
        spans: dict[int, list[float]] = {}
        for a in self.answers:
            if a.stream and a.error is None and a.tokens:
                pace = SIM_TTFT_S + (a.tokens - 1) / self.tps
                spans.setdefault(int((a.sent - first) // 10), []).append(a.took / pace)
        return [
            f"{k * 10}s {statistics.median(v):.2f}/{max(v):.2f}" for k, v in sorted(spans.items())
        ]

    def lines(self) -> list[str]:
        kinds = Counter(a.error for a in self.errors)
        return [
            f"load: {self.rate:g} req/s for {self.seconds:g} s, {self.streaming}, "
            f"{len(self.answers)} requests, the servers at {self.tps:g} tokens a second",
            f"errors: {len(self.errors)}" + (f" {dict(kinds)}" if kinds else ""),
            *(
                f"  {what}: {len(group)} of {n} {dict(Counter(a.error for a in group))}"
                for what, group, n in (
                    (
                        "streams",
                        [a for a in self.errors if a.stream],
                        sum(1 for a in self.answers if a.stream),
                    ),
                    (
                        "whole answers",
                        [a for a in self.errors if not a.stream],
                        sum(1 for a in self.answers if not a.stream),
                    ),
                )
                if self.errors
            ),
            f"latency: p50 {self.quantile_ms(0.5):.1f} ms, p99 {self.quantile_ms(0.99):.1f} ms",
            f"misroutes: {len(self.misroutes)} (answers picked after their replica's drain "
            "was folded)",
            f"drains: {len(self.drains)} {dict(self.reasons)}; "
            f"{self.drained_under_load} of them had served the load",
            f"gateway retries (before the first byte): {self.retries}",
            *(
                ["errors by when sent (10 s each): " + " | ".join(self._by_time())]
                if self.errors
                else []
            ),
            "preempted, drain to stopped (the preempting model's GPUs freed): "
            + (
                f"{len(self.freed)} replicas, p50 {statistics.median(self.freed):.2f} s, "
                f"max {max(self.freed):.2f} s"
                if self.freed
                else "none"
            ),
            *(
                [
                    "CPU seconds while the load ran ("
                    + f"{self.cpu['wall']:.0f} s, {os.cpu_count()} cores, load average "
                    + f"{self.cpu['load1']:.1f} after): "
                    + ", ".join(
                        f"{k} {v:.0f}" for k, v in self.cpu.items() if k not in ("wall", "load1")
                    )
                ]
                if self.cpu
                else []
            ),
            "streams' time over their servers' pace, p50/max by when sent (10 s each): "
            + " | ".join(self._stretch()),
            *(f"step: {s}" for s in self.steps),
        ]


def _tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds of `root` and every process below it, by kind: `gateways`, `broker`,
    `up` (the rest)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    out: dict[str, float] = {"gateways": 0.0, "broker": 0.0, "up": 0.0}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in tree:
        with contextlib.suppress(OSError):
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            kind = (
                "gateways"
                if b"services.gateway" in cmd
                else "broker"
                if b"nats-server" in cmd
                else "up"
            )
            out[kind] += (int(f[11]) + int(f[12])) / tick
    return out


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _routable(gateway: str) -> dict[str, list[str]]:
    """What the gateway routes to per model; nothing while it does not answer yet."""
    try:
        return dict(_get(f"{gateway.removesuffix('/v1')}/health")["routable"])
    except OSError:
        return {}


def _until(what: str, up: UpProcess, check: Any, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert up.alive(), up.text()[-3000:]
        assert time.monotonic() < deadline, f"{what} not within {within_s}s"
        time.sleep(0.1)


async def _one(
    http: aiohttp.ClientSession, base: str, model: str, stream: bool, max_tokens: int = MAX_TOKENS
) -> Answer:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "drill"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    t0 = time.perf_counter()
    a = Answer(model, stream, t0, 0.0, 0, tokens=max_tokens)
    try:
        async with http.post(f"{base}/chat/completions", json=body) as r:
            a.status = r.status
            a.replica = r.headers.get("x-llmgw-replica", "")
            a.seq = int(r.headers.get("x-llmgw-seq", "0") or 0)
            data = await r.read()
        if a.status != 200:
            a.error = f"{a.status} {r.headers.get('x-llmgw-reason', '')}".rstrip()
        elif stream and not data.rstrip().endswith(b"data: [DONE]"):
            a.error = "stream cut"
        elif not stream and b'"choices"' not in data:
            a.error = "no choices"
    except (aiohttp.ClientError, TimeoutError) as e:
        a.error = type(e).__name__
    a.took = time.perf_counter() - t0
    return a


async def _load(
    base: str,
    rate: float,
    seconds: float,
    tokens: tuple[int, int] = (MAX_TOKENS, MAX_TOKENS),
    streams: int = 2,
    whole: int | None = None,
    tps: float = SIM_TPS,
) -> list[Answer]:
    """Open loop: a request every 1/rate s whatever the answers do, each of `tokens`
    (the least and the most, spread over the requests); one in `streams` of them whole,
    the others streamed (1: all streamed); a whole one of `whole` tokens when given. A
    client gives up on an answer after five times the longest one's time at `tps` (at
    least twice the default grace)."""
    timeout = aiohttp.ClientTimeout(total=max(GRACE_S * 2, 5 * tokens[1] / tps))
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        tasks: list[asyncio.Task[Answer]] = []
        t0 = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            model = LOADED[(i // 2) % 2]
            size = tokens[0] + (i * 37) % (tokens[1] - tokens[0] + 1)
            stream = streams == 1 or i % streams != 0
            if not stream and whole is not None:
                size = whole
            tasks.append(asyncio.create_task(_one(http, base, model, stream, size)))
        return list(await asyncio.gather(*tasks))


def _node_to_drain(view: Any) -> str:
    """The node whose drain leaves the most routable replicas of the loaded models
    elsewhere (at least one of each: the drill is of drains, not of a model gone)."""
    best: tuple[int, str] | None = None
    for node in sorted(view.state.nodes):
        left = []
        for m in LOADED:
            rs = [r for r in view.replicas_of(m) if r.state == "ready" and r.drained_by is None]
            left.append(sum(1 for r in rs if all(s.node != node for s in r.shards)))
        if min(left) == 0:
            continue
        score = (min(left), node)
        if best is None or score > best:
            best = score
    assert best is not None, "no node can be drained and leave each model a replica"
    return best[1]


async def _chaos(up: UpProcess, url: str, seconds: float, steps: list[str]) -> None:
    """The drains, at fixed points of the run."""
    nc = await connect(url, "drill")
    follower = ViewFollower(nc.jetstream(), consumer="drill")
    task = follower.start()
    try:
        await follower.caught_up(30)

        async def cli(*args: str) -> None:
            p = await asyncio.to_thread(up.llmgw, *args)
            assert p.returncode == 0, f"llmgw {' '.join(args)}: {p.stderr}"
            steps.append(f"{time.perf_counter() - t0:5.1f}s llmgw {' '.join(args)}")

        t0 = time.perf_counter()
        plan: list[tuple[float, tuple[str, ...] | None]] = [
            # Early enough that the last one's drains are under load too, on a busy host
            # where each command takes a second or two to start.
            (0.1, ("scale", "urgent", "2")),
            (0.25, ("scale", "chat", "2")),
            (0.4, None),  # drain a node, chosen then
            (0.55, ("scale", "batch", "3")),
        ]
        # Each step starts at its time, whatever the one before still does: a command
        # takes seconds to start on a loaded host.
        running = []
        for at, args in plan:
            await asyncio.sleep(max(0.0, t0 + at * seconds - time.perf_counter()))
            if args is None:
                await follower.caught_up(10)
                args = ("drain", "node", _node_to_drain(follower.view), "--yes")
            running.append(asyncio.create_task(cli(*args)))
        await asyncio.gather(*running)
    finally:
        await follower.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await nc.close()


async def _drains(url: str) -> tuple[dict[str, int], Counter[str], list[float]]:
    nc = await connect(url, "drill")
    try:
        js = nc.jetstream()
        seqs: dict[str, int] = {}
        reasons: Counter[str] = Counter()
        preempted: dict[str, Any] = {}
        async for batch in consume.read_range(js, 1, filter_subject="llmgw.cmd.*.replica.drain"):
            for d in batch:
                e = codec.decode(d.data)
                if isinstance(e, ev.ReplicaDrainEvent) and e.data.replica not in seqs:
                    seqs[e.data.replica] = d.seq
                    reasons[e.data.reason] += 1
                    if e.data.reason == "preempted":
                        preempted[e.data.replica] = e.time
        freed: list[float] = []
        async for batch in consume.read_range(js, 1, filter_subject="llmgw.node.*.replica.*"):
            for d in batch:
                e = codec.decode(d.data)
                if (
                    isinstance(e, ev.ReplicaStateEvent)
                    and e.data.state == "stopped"
                    and e.data.replica in preempted
                ):
                    freed.append((e.time - preempted.pop(e.data.replica)).total_seconds())
        return seqs, reasons, freed
    finally:
        await nc.close()


def run(
    base: Path,
    rate: float,
    seconds: float,
    grace_s: float = GRACE_S,
    tokens: tuple[int, int] = (MAX_TOKENS, MAX_TOKENS),
    extra: tuple[str, ...] = (),
    streams: int = 2,
    whole: int | None = None,
    target_inflight: int | None = None,
    tps: float = SIM_TPS,
) -> Figures:
    """One drill on a fresh `llmgw up` in `base`; its figures. `tokens`: each answer's
    (`tps` a second, the simulated servers' pace), the least and the most; `whole`: a whole answer's instead, when
    given; `extra`: more flags of `llmgw up`; `target_inflight`: the loaded models'
    (their default, 8, when not given: a replica admits twice it)."""
    up = UpProcess(
        base / "data",
        base / "up.log",
        *("--simulate", NODES, "--no-ui", "--sim-no-drain"),
        *("--start-delay", "0.05", "--load-delay", "0.3", "--stop-delay", "0"),
        *("--sim-ttft", str(SIM_TTFT_S), "--sim-tps", str(tps)),
        *("--drain-grace", str(grace_s), "--min-lifetime", "0", "--hold", "2"),
        *("--tick", "0.2"),
        *extra,
    )
    figures = Figures(rate, seconds, "all streaming" if streams == 1 else "half streaming", tps=tps)
    try:
        url = up.wait_url()
        gw_file = base / "data" / "gateway.url"
        _until("the gateway's address", up, gw_file.exists)
        gateway = gw_file.read_text().strip()
        spec = base / "cluster.yaml"
        cluster = CLUSTER
        if target_inflight is not None:
            for m in LOADED:
                cluster = cluster.replace(
                    f"  - name: {m}\n", f"  - name: {m}\n    target_inflight: {target_inflight}\n"
                )
        spec.write_text(cluster)
        applied = up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        _until(
            "chat 4 and batch 8 routable",
            up,
            lambda: [len(_routable(gateway).get(m, [])) for m in LOADED] == [4, 8],
        )

        async def both() -> list[Answer]:
            chaos = asyncio.create_task(_chaos(up, url, seconds, figures.steps))
            answers = await _load(gateway, rate, seconds, tokens, streams, whole, tps)
            await chaos
            return answers

        before, own, t0 = _tree_cpu(up.proc.pid), _self_cpu(), time.perf_counter()

        figures.answers = asyncio.run(both())
        after = _tree_cpu(up.proc.pid)
        figures.cpu = {"client": _self_cpu() - own} | {k: after[k] - before[k] for k in after}
        figures.cpu |= {"wall": time.perf_counter() - t0, "load1": os.getloadavg()[0]}
        figures.retries = int(_get(f"{gateway.removesuffix('/v1')}/health")["retries"])
        figures.drains, figures.reasons, figures.freed = asyncio.run(_drains(url))
        assert up.alive(), up.text()[-3000:]
    finally:
        up.stop()
    return figures
