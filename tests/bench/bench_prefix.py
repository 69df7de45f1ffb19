"""Benchmark: prefix-aware routing (`--routing prefix`) against the cache-blind rules, on
the same traces.

Run from the repository root:

    python tests/bench/bench_prefix.py [--workloads shared,multiturn,unique,hot]
        [--replicas 4] [--scale 1.0] [--skip-micro]

Prints figures, asserts nothing. An embedded nats-server; for each workload and each arm
a gateway (`services.gateway.server.Gateway`, in this process, told its rule as
`--routing` would) and `--replicas` fresh simulated servers (services.agent.responder)
with a prefix cache of `--cache-tokens` and a prefill of `--prefill-tps` tokens a second,
one prompt after another, so a cache miss costs time to first token and queues the
prompts behind it. Each workload is one trace (seeded), offered open loop (requests sent
at their times whatever the answers do) to every arm:

- round-robin: each request to the next replica, blind to load and cache;
- least-inflight: the plain rule, llmgw's default before this one;
- prefix: services.core.prefix, told the servers' cache size as an engine that reports
  its KV capacity would tell it (`--unknown-capacity`: its default, 262,144 tokens);
- oracle: the replica whose server's cache, read directly, holds most of the prompt
  (ties to the least in flight): the best hit rate a router could reach with these
  caches, load be damned.

Workloads (scaled for a 2-core host; `--scale` multiplies the requests):
- shared: 16 groups x 16 requests, each group's 2,000-token system prompt its own, a
  short question each, interleaved at random, Poisson arrivals at 30 a second (the issue's 64 x 16,
  scaled: its 16 a group, so the cold first ones are as rare);
- multiturn: 16 conversations of 6 turns, each turn's prompt the whole history (a
  600-token opening, 250 tokens a turn, 0.4 s + a random pause between turns);
- unique: 128 prompts of 1,000 tokens sharing nothing, 30 a second;
- hot: one 2,000-token prefix with a short suffix each, offered at about what the
  replicas take at their admission limit (saturation).

For each arm: the hit rate (prompt tokens the servers served from cache, over all),
time to first token p50/p90/p99 at the client, throughput (requests completed a second),
goodput (those with a first token within --slo), the most requests in flight at one
replica against the mean at the same instant (sampled every 5 ms), and the longest the
process's event loop was held (a stall of the host or the process, which every arm's
figures share the risk of). Then, with no
gateway: the prefix rule's pick for a 32k-character prompt among 64 replicas (p50/p99
by block size; at the rule's own (256) the plain implementation, `--no-fast-path`'s,
and the least-inflight rule's beside it: the median of 5 rounds of 1,000 picks, each prompt
decoded just before its pick as the gateway's one parse does, the garbage collector on,
each pick timed by the wall clock and by the thread's CPU time, which leaves out what
other processes took of the core), and its index's memory at 1,000 replicas at capacity
(prompts of 64 blocks, and of one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from schemas import events as ev  # noqa: E402
from schemas import subjects  # noqa: E402
from services.agent import responder as sim  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402
from services.core import catalog, prefix, routing  # noqa: E402
from services.core.pickers import PICKERS  # noqa: E402

# Rule is the prefix rule as a gateway makes it: its speed-up (its fast path on), where
# the tree has one (this file copied into a tree before it measures that tree's rule).
Rule: type[prefix.Prefix] = prefix.Prefix
try:
    from services.core.prefix_fast import FastPrefix

    Rule = FastPrefix
except ImportError:  # pragma: no cover
    pass
from services.core.view import ReplicaRecord, View  # noqa: E402
from services.gateway.config import Config  # noqa: E402
from services.gateway.server import Gateway  # noqa: E402

JSON_TYPE = {"Content-Type": "application/json"}
ARMS = ("round-robin", "least-inflight", "prefix", "oracle")
WORDS = ("the", "plane", "folds", "a", "log", "of", "facts", "and", "serves", "tokens")


def _text(rng: random.Random, tokens: int, head: str = "") -> str:
    """About `tokens` tokens (4 characters each) of words, after `head`."""
    out = [head]
    n = len(head)
    while n < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[: tokens * 4]


@dataclass
class Request:
    at: float
    body: dict[str, Any]


@dataclass
class Workload:
    name: str
    trace: list[Request]
    target_inflight: int = 8
    max_tokens: int = 4
    tps: float = 200.0


def _arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """`n` Poisson arrivals at `rate` a second (seeded: the same for every arm)."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def shared(scale: float, rng: random.Random) -> Workload:
    groups, each = 16, max(1, int(16 * scale))
    systems = [_text(rng, 2000, f"group {g}:") for g in range(groups)]
    order = [g for g in range(groups) for _ in range(each)]
    rng.shuffle(order)
    at = _arrivals(rng, len(order), 30.0)
    trace = [
        Request(
            at[i],
            {
                "messages": [
                    {"role": "system", "content": systems[g]},
                    {"role": "user", "content": _text(rng, 25, f"q{i}")},
                ]
            },
        )
        for i, g in enumerate(order)
    ]
    return Workload("shared", trace)


def multiturn(scale: float, rng: random.Random) -> Workload:
    convs, turns = max(1, int(16 * scale)), 6
    trace: list[Request] = []
    for c in range(convs):
        history: list[dict[str, str]] = [
            {"role": "system", "content": _text(rng, 600, f"conversation {c}:")}
        ]
        at = c * 0.15
        for t in range(turns):
            history = [*history, {"role": "user", "content": _text(rng, 100, f"turn {t}")}]
            trace.append(Request(at, {"messages": list(history)}))
            at += 0.4 + rng.expovariate(2.0)  # the user reads and types
            history = [*history, {"role": "assistant", "content": _text(rng, 150, "answer")}]
    trace.sort(key=lambda r: r.at)
    return Workload("multiturn", trace)


def unique(scale: float, rng: random.Random) -> Workload:
    n = max(1, int(128 * scale))
    at = _arrivals(rng, n, 30.0)
    trace = [
        Request(at[i], {"messages": [{"role": "user", "content": _text(rng, 1000, f"{i}:")}]})
        for i in range(n)
    ]
    return Workload("unique", trace)


def hot(scale: float, rng: random.Random) -> Workload:
    system = _text(rng, 2000, "the hot one:")
    # 4 replicas x 8 in flight (target 4 x 2), each answer ~0.4 s: ~80 a second.
    n = max(1, int(240 * scale))
    at = _arrivals(rng, n, 80.0)
    trace = [
        Request(
            at[i],
            {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": _text(rng, 50, f"ask {i}")},
                ]
            },
        )
        for i in range(n)
    ]
    return Workload("hot", trace, target_inflight=4, max_tokens=8, tps=20.0)


WORKLOADS: dict[str, Callable[[float, random.Random], Workload]] = {
    "shared": shared,
    "multiturn": multiturn,
    "unique": unique,
    "hot": hot,
}


@dataclass
class RoundRobin(routing.LeastInflight):
    """Each request to the next replica by name, blind to load and cache."""

    turn: int = 0

    def choose(
        self, view: View, m: catalog.Model, route: routing.Route | None, found: list[ReplicaRecord]
    ) -> ReplicaRecord:
        self.turn += 1
        return sorted(found, key=lambda r: r.id)[self.turn % len(found)]


@dataclass
class Oracle(routing.LeastInflight):
    """The replica whose server's cache holds most of the prompt, read directly."""

    servers: dict[str, sim.Responder] = field(default_factory=dict)

    def choose(
        self, view: View, m: catalog.Model, route: routing.Route | None, found: list[ReplicaRecord]
    ) -> ReplicaRecord:
        if route is None:
            return super().choose(view, m, route, found)
        text = sim._prompt(json.loads(route._body))

        def score(r: ReplicaRecord) -> tuple[int, int, int, str]:
            s = self.servers.get(r.id)
            held = s.matched(text) if s is not None else 0
            return (-held, *self._load(r))

        return min(found, key=score)


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    errors: int = 0
    hit: float = 0.0
    worst: float = 0.0
    """The most in flight at one replica over 1.5 x the mean then + 2 (<= 1: within)."""
    peak: tuple[int, float] = (0, 0.0)
    """The most in flight at one replica, and the mean in flight at that instant."""
    span: float = 0.0
    whys: dict[str, int] = field(default_factory=dict)
    lag: float = 0.0
    """The longest the event loop (gateway, servers and client alike) was held past a
    5 ms sleep: a stall of the process or the host, not of a rule."""


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else float("nan")


class Bench:
    def __init__(self, a: argparse.Namespace, js: Any) -> None:
        self.a = a
        self.js = js
        self.pub = Publisher(js)
        self.runs = 0

    async def say(self, data: ev.Data, node: str | None = None) -> int:
        e = ev.make(data, id=new_id(), time=utc_now(), source="bench")
        return int((await self.pub.publish(e, node=node)).seq)

    async def arm(self, w: Workload, arm: str) -> Result:
        """One run of `w`'s trace through a fresh gateway told `arm`, on fresh servers."""
        self.runs += 1
        model, node = f"{w.name}-{self.runs}", f"bench-pfx-{self.runs}"
        a = self.a
        gpus = tuple(
            ev.GpuInfo(index=i, uuid=f"{node}-g{i}", model="H100", memory_gb=80)
            for i in range(a.replicas)
        )
        await self.say(ev.NodeInventory(node=node, gpus=gpus, cpu_cores=8, memory_gb=64), node)
        await self.say(
            ev.ModelDeclared(
                name=model,
                min=0,
                target_inflight=w.target_inflight,
                profiles=(ev.ProfileSpec(name="p", gpus=1),),
            )
        )
        timing = sim.Timing(
            a.base_ttft, w.tps, prefill_tps=a.prefill_tps, cache_tokens=a.cache_tokens
        )
        servers: dict[str, sim.Responder] = {}
        seq = 0
        for i in range(a.replicas):
            rid = f"{model}-r{i}"
            s = servers[rid] = sim.Responder(rid, model, timing)
            await s.start()
            shards = (ev.ShardSpec(node=node, gpus=(i,)),)
            await self.say(
                ev.PlacementDecided(replica=rid, model=model, profile="p", shards=shards, reason="")
            )
            seq = await self.say(
                ev.ReplicaState(
                    replica=rid,
                    model=model,
                    profile="p",
                    state="ready",
                    shards=shards,
                    endpoint=s.endpoint,
                ),
                node,
            )
        pickers = {
            **PICKERS,
            "round-robin": RoundRobin,
            "oracle": lambda: Oracle(servers=servers),
            "prefix": lambda: Rule(
                threshold=a.threshold,
                slack=a.slack,
                stick=a.stick,
                capacity_tokens=(
                    prefix.DEFAULT_CAPACITY_TOKENS if a.unknown_capacity else a.cache_tokens
                ),
            ),
        }
        gw = Gateway.of(
            self.js,
            Config(listen="127.0.0.1:0", routing=arm, upstream_timeout_s=60),
            root=subjects.DEFAULT_ROOT,
            pickers=pickers,
        )
        sock = gw.bind()
        stop = asyncio.Event()
        ready = asyncio.Event()
        task = asyncio.create_task(gw.run(stop, sock, on_ready=lambda _: ready.set()))
        try:
            await asyncio.wait_for(ready.wait(), 30)
            await gw.follower.wait_for(seq, 30)
            res = await self.offer(gw, w, model)
            if isinstance(gw.router, prefix.Prefix):
                res.whys["corrections"] = gw.router.corrections
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            prompt = sum(s.prompt_tokens for s in servers.values())
            res.hit = sum(s.cached_tokens for s in servers.values()) / max(1, prompt)
            for s in servers.values():
                await s.close()
        return res

    async def offer(self, gw: Gateway, w: Workload, model: str) -> Result:
        res = Result()
        url = f"{gw.url}/v1/chat/completions"
        router = gw.router
        done = asyncio.Event()

        async def sample() -> None:
            last = time.perf_counter()
            while not done.is_set():
                now = time.perf_counter()
                res.lag = max(res.lag, now - last - 0.005)
                last = now
                got = router.inflight
                if got:
                    top = max(got.values())
                    mean = sum(got.values()) / self.a.replicas
                    res.worst = max(res.worst, (top - 2) / (1.5 * mean) if mean else 0.0)
                    if top > res.peak[0]:
                        res.peak = (top, mean)
                await asyncio.sleep(0.005)

        async def one(http: aiohttp.ClientSession, r: Request) -> None:
            body = {**r.body, "model": model, "max_tokens": w.max_tokens, "stream": True}
            t0 = time.perf_counter()
            try:
                async with http.post(url, data=json.dumps(body), headers=JSON_TYPE) as resp:
                    if resp.status != 200:
                        res.errors += 1
                        await resp.read()
                        return
                    why = resp.headers.get("x-llmgw-route", "").split(";")[0] or "-"
                    await resp.content.readany()
                    res.ttft.append(time.perf_counter() - t0)
                    await resp.read()
                    res.ends.append(time.perf_counter())
                    res.whys[why] = res.whys.get(why, 0) + 1
            except aiohttp.ClientError:
                res.errors += 1

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            sampler = asyncio.create_task(sample())
            start = time.perf_counter()
            tasks = []
            for r in w.trace:
                delay = start + r.at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(http, r)))
            await asyncio.gather(*tasks)
            done.set()
            await sampler
        res.span = (max(res.ends) - start) if res.ends else float("nan")
        return res


def _print(w: Workload, results: dict[str, Result], slo: float) -> None:
    print(
        f"\n== {w.name}: {len(w.trace)} requests "
        f"({sum(len(json.dumps(r.body)) for r in w.trace) // 4 // max(1, len(w.trace))} "
        "prompt tokens each on average)"
    )
    print(
        f"{'arm':<15} {'hit':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'req/s':>7} "
        f"{'good/s':>7} {'peak in flight (mean then)':>27} {'max/(1.5 mean+2)':>17} "
        f"{'stall ms':>8}  picks"
    )
    for arm, r in results.items():
        good = sum(1 for t in r.ttft if t <= slo) / r.span if r.span else 0.0
        tput = len(r.ends) / r.span if r.span else 0.0
        peak = f"{r.peak[0]} ({r.peak[1]:.1f})"
        whys = ", ".join(f"{k} {v}" for k, v in sorted(r.whys.items()) if k != "-" and v)
        print(
            f"{arm:<15} {r.hit:>5.2f} {_pct(r.ttft, 0.5):>8.1f} {_pct(r.ttft, 0.9):>8.1f} "
            f"{_pct(r.ttft, 0.99):>8.1f} {tput:>7.1f} {good:>7.1f} {peak:>27} "
            f"{r.worst:>17.2f} {r.lag * 1e3:>8.0f}  {whys}"
            f"{'  errors ' + str(r.errors) if r.errors else ''}"
        )


# ROUNDS of the micro-benchmark's 1,000 picks; each figure is the median of the rounds'.
ROUNDS = 5


def _timed(
    picker: routing.Picker, view: View, m: catalog.Model, bodies: list[bytes]
) -> tuple[float, float, float, float]:
    """One round: each body picked as a fresh request (its prompt decoded just before,
    as the gateway's one parse does, and not timed), 32 kept in flight (the oldest ended as each
    is picked, so that replicas have work to wait for and the cold ones are weighed),
    the garbage collector on (its pauses are the pick's too). The wall time's and the
    thread's CPU time's p50 and p99, in microseconds: on a shared host the wall time
    also holds what other processes took of the core."""
    routes = [routing.Route("m", body=b) for b in bodies]
    wall: list[float] = []
    cpu: list[float] = []
    flight: list[tuple[str, routing.Route]] = []
    for r in routes:
        _ = r.prompt
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        got = picker.pick(view, m, r)
        c, t = time.thread_time_ns() - c, time.perf_counter_ns() - t
        wall.append(t / 1e3)
        cpu.append(c / 1e3)
        assert got is not None
        flight.append((got.id, r))
        if len(flight) > 32:
            picker.done(*flight.pop(0))
    for rid, r in flight:
        picker.done(rid, r)
    wall.sort()
    cpu.sort()
    n = len(wall)
    return wall[n // 2], wall[n * 99 // 100], cpu[n // 2], cpu[n * 99 // 100]


def _warmed(
    p: prefix.Prefix, view: View, m: catalog.Model, bases: list[str], *, full: bool
) -> prefix.Prefix:
    """`p` with each base prompt routed once (8 a replica); `full`: every replica's LRU
    first filled to its bound with other blocks, as in a gateway that has run a while
    (a growing LRU's table is resized as it grows; a full one's, each time its
    evictions have left it too many holes)."""
    if full:
        rng = random.Random(3)
        for rep in routing.candidates(view, m):
            p.record(rep.id, [rng.getrandbits(63) for _ in range(p.total_blocks // 64)])
    for b in bases:
        r = routing.Route("m", body=json.dumps({"prompt": b}).encode())
        got = p.pick(view, m, r)
        assert got is not None
        p.done(got.id, r)
    return p


def micro(blocks_list: tuple[int, ...]) -> None:
    """The pick's CPU cost for a 32k-character prompt among 64 replicas, by block size,
    and the index's memory at 1,000 replicas at capacity."""
    from tests.core.test_fold import MODEL, Log, inventory

    log = Log()
    assert log.add(MODEL) is None
    for n in range(8):
        assert log.add(inventory(f"n{n}", gpus=8), node=f"n{n}") is None
    for i in range(64):
        node = f"n{i // 8}"
        shards = (ev.ShardSpec(node=node, gpus=(i % 8,)),)
        rid = f"r{i}"
        assert (
            log.add(
                ev.PlacementDecided(replica=rid, model="m", profile="p", shards=shards, reason="")
            )
            is None
        )
        state = ev.ReplicaState(
            replica=rid,
            model="m",
            profile="p",
            state="ready",
            shards=shards,
            endpoint=f"http://{node}:1",
        )
        assert log.add(state, node=node) is None
    m = log.view.catalog.resolve("m")
    assert m is not None
    rng = random.Random(7)
    print(
        "\n== the pick's CPU cost: a 32k-character prompt among 64 replicas "
        f"(median of {ROUNDS} rounds of 1,000 picks, the garbage collector on)"
    )
    print(
        f"{'block chars':>11} {'blocks':>7} {'rule':>14} {'wall p50':>8} {'p99':>8} "
        f"{'CPU p50':>8} {'p99':>8}  (us)"
    )
    # main: the size the plain implementation and the least-inflight rule are timed at.
    main = prefix.BLOCK_CHARS if prefix.BLOCK_CHARS in blocks_list else blocks_list[0]
    for size in blocks_list:
        # Each replica warm with 8 prompts of its own; the requests share 28k characters
        # with one of them (a long conversation's next turn).
        bases = [_text(rng, 8000, f"base {i}:") for i in range(64 * 8)]
        bodies = [
            json.dumps(
                {"prompt": bases[rng.randrange(len(bases))][:28_000] + _text(rng, 1000)}
            ).encode()
            for _ in range(1000)
        ]
        arms: tuple[tuple[str, routing.Picker], ...] = (
            ("prefix", _warmed(Rule(block_chars=size), log.view, m, bases, full=False)),
            ("prefix-full", _warmed(Rule(block_chars=size), log.view, m, bases, full=True)),
        )
        if size == main and Rule is not prefix.Prefix:
            # The plain rule (`--no-fast-path`): the same picks, for the speed-up's ratio.
            arms += (
                ("plain", _warmed(prefix.Prefix(block_chars=size), log.view, m, bases, full=False)),
                (
                    "plain-full",
                    _warmed(prefix.Prefix(block_chars=size), log.view, m, bases, full=True),
                ),
            )
        if size == main:
            arms += (("least-inflight", routing.LeastInflight()),)  # for scale
        rounds: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, _ in arms}
        for _ in range(ROUNDS):
            for name, picker in arms:
                rounds[name].append(_timed(picker, log.view, m, bodies))
        n = len(prefix.blocks("m", None, json.loads(bodies[0])["prompt"], size))
        for name, _ in arms:
            w50, w99, c50, c99 = (statistics.median(r[i] for r in rounds[name]) for i in range(4))
            print(f"{size:>11} {n:>7} {name:>14} {w50:>8.1f} {w99:>8.1f} {c50:>8.1f} {c99:>8.1f}")
    print("\n== the index's memory: 1,000 replicas at capacity")
    # Prompts of 64 blocks; then prompts of one block, each block a prompt's first (what
    # fills the speed-up's map of first blocks), and of two (the speed-up's chains at
    # their smallest with a node each).
    for per, each in ((64, 8), (1, 512), (2, 256)):
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        p = Rule()
        for i in range(1000):
            for _ in range(each):
                p.record(f"r{i}", [rng.getrandbits(63) for _ in range(per)])
        # Filled past the bound: every LRU is at its share of TOTAL_BLOCKS.
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        firsts = len(getattr(p, "_firsts", ()))
        print(
            f"{per}-block prompts: {p.blocks_held():,} blocks held (bound {p.total_blocks:,}; "
            f"{p._cap} a replica), {firsts:,} first blocks mapped, {used / 2**20:.1f} MiB"
        )
        del p


async def _main(a: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    broker = EmbeddedBroker(tmp / "broker")
    broker.start()
    try:
        nc = await connect(broker.url, "bench")
        js = nc.jetstream()
        await ensure_streams(js)
        b = Bench(a, js)
        for name in a.workloads.split(","):
            w = WORKLOADS[name](a.scale, random.Random(a.seed))
            results = {}
            for arm in ARMS:
                results[arm] = await b.arm(w, arm)
            _print(w, results, a.slo)
        await nc.close()
    finally:
        broker.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefill-tps", type=float, default=20_000.0)
    p.add_argument("--cache-tokens", type=int, default=12_288)
    p.add_argument("--base-ttft", type=float, default=0.005)
    p.add_argument("--threshold", type=float, default=prefix.THRESHOLD)
    p.add_argument("--slack", type=float, default=prefix.SLACK)
    p.add_argument("--stick", type=float, default=prefix.STICK)
    p.add_argument(
        "--unknown-capacity",
        action="store_true",
        help="the prefix rule not told the servers' cache size (its default instead)",
    )
    p.add_argument("--slo", type=float, default=1.0, help="goodput's bound on TTFT (s)")
    p.add_argument("--blocks", default="64,128,256,512,1024")
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--only-micro", action="store_true")
    a = p.parse_args()
    print(
        f"{a.replicas} simulated replicas, prefill {a.prefill_tps:g} tokens/s, cache "
        f"{a.cache_tokens} tokens each, base TTFT {a.base_ttft * 1e3:g} ms; "
        f"prefix block {prefix.BLOCK_CHARS} chars, threshold {a.threshold}"
    )
    if not a.only_micro:
        asyncio.run(_main(a))
    if not a.skip_micro:
        micro(tuple(int(x) for x in a.blocks.split(",")))


if __name__ == "__main__":
    main()
