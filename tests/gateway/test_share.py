"""Three gateway processes on one broker share the keys' limits, the replicas' load, the
prefix index and the demand they hold (`services.gateway.share`), as an operator runs
them (`python -m services.gateway`), asked with the official `openai` client.

Each test starts its own gateways on free ports, a real nats-server, and simulated model
servers in this process. A limit's minute is the key's: the test counts what is
admitted against the key's limit plus what its bucket refilled while the test ran (its
`rpm` over 60 s times the seconds it took), so nothing waits for a minute to pass."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import codec, subjects
from schemas import events as ev
from schemas import share as share_schema
from services.agent.responder import Responder, Timing
from services.bus import EmbeddedBroker, Publisher
from services.clock import utc_now
from tests.agent.helpers import new_id

pytestmark = [pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
KEY = "k-share-" + "a" * 24
FRESH = "k-share-" + "b" * 24
TOKENS = "k-share-" + "c" * 24
FREE = "k-share-" + "d" * 24
OTHER = "k-share-" + "e" * 24
RPM = 100
TPM = 2000
FAST = Timing(0.0, 0.0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateways:
    """`n` gateway processes on the broker at `url`, each on a port of its own."""

    def __init__(self, url: str, n: int, keys: Path, logs: Path, *extra: str) -> None:
        self.urls: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []
        for i in range(n):
            port = _port()
            self.urls.append(f"http://127.0.0.1:{port}")
            out = (logs / f"gateway-{i}.log").open("wb")
            self.logs.append(out)
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "services.gateway",
                        "--nats",
                        url,
                        "--listen",
                        f"127.0.0.1:{port}",
                        "--api-keys",
                        str(keys),
                        "--upstream-timeout",
                        "20",
                        *extra,
                    ],
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )

    async def health(self, http: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        async with http.get(f"{self.urls[i]}/health") as r:
            got: dict[str, Any] = await r.json()
            return got

    async def sharing(self, http: aiohttp.ClientSession, n: int, among: list[int]) -> None:
        """Each of `among` says it shares with `n` gateways (itself included)."""
        deadline = time.monotonic() + 40
        while True:
            seen = []
            for i in among:
                with contextlib.suppress(aiohttp.ClientError, json.JSONDecodeError):
                    h = await self.health(http, i)
                    # A gateway that shares nothing (before sharing) is one alone, up.
                    seen.append((h.get("share") or {}).get("gateways", n) if "seq" in h else None)
            if seen == [n] * len(among):
                return
            assert time.monotonic() < deadline, f"gateways sharing: {seen}, not {n}"
            await asyncio.sleep(0.02)

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(15)
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for f in self.logs:
            f.close()


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    p = tmp_path / "keys"
    p.write_text(
        f"{KEY} team-a rpm={RPM}\n{FRESH} team-a rpm={RPM}\n{TOKENS} team-a tpm={TPM}\n"
        f"{FREE} team-a\n{OTHER} team-b\n"
    )
    p.chmod(0o600)
    return p


class Plane:
    """The test's hand on the log: a model, its node and its replicas (simulated
    servers in this process)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.pub = Publisher(js)
        self.servers: list[Responder] = []

    async def say(self, data: ev.Data, node: str | None = None) -> None:
        await self.pub.publish(ev.make(data, id=new_id(), time=utc_now(), source="test"), node=node)

    async def model(self, name: str, replicas: int, timing: Timing = FAST, **kw: Any) -> None:
        node = f"{name}-node"
        gpus = tuple(
            ev.GpuInfo(index=i, uuid=f"{node}-g{i}", model="H100", memory_gb=80) for i in range(8)
        )
        await self.say(ev.NodeInventory(node=node, gpus=gpus, cpu_cores=8, memory_gb=64), node)
        await self.say(
            ev.ModelDeclared(name=name, min=0, profiles=(ev.ProfileSpec(name="p", gpus=1),), **kw)
        )
        for i in range(replicas):
            rid = f"{name}-r{i}"
            s = Responder(rid, name, timing)
            await s.start()
            self.servers.append(s)
            shards = (ev.ShardSpec(node=node, gpus=(i,)),)
            await self.say(
                ev.PlacementDecided(replica=rid, model=name, profile="p", shards=shards, reason="")
            )
            await self.say(
                ev.ReplicaState(
                    replica=rid,
                    model=name,
                    profile="p",
                    state="ready",
                    shards=shards,
                    endpoint=s.endpoint,
                ),
                node,
            )

    async def close(self) -> None:
        for s in self.servers:
            await s.close()


@contextlib.asynccontextmanager
async def fleet(
    broker: EmbeddedBroker, keys: Path, logs: Path, n: int = 3, *extra: str
) -> AsyncIterator[tuple[Gateways, aiohttp.ClientSession]]:
    gws = Gateways(broker.url, n, keys, logs, *extra)
    try:
        async with aiohttp.ClientSession() as http:
            await gws.sharing(http, n, list(range(n)))
            yield gws, http
    finally:
        gws.close()


async def routable(gws: Gateways, http: aiohttp.ClientSession, model: str, replicas: int) -> None:
    """Every gateway has folded `replicas` routable replicas of `model`."""
    deadline = time.monotonic() + 30
    for url in gws.urls:
        while True:
            async with http.get(f"{url}/health") as r:
                got = (await r.json())["routable"].get(model)
            if got is not None and len(got) == replicas:
                break
            assert time.monotonic() < deadline, f"{url}: {got}"
            await asyncio.sleep(0.02)


def clients(gws: Gateways, key: str, among: list[int] | None = None) -> list[openai.AsyncOpenAI]:
    return [
        openai.AsyncOpenAI(base_url=f"{gws.urls[i]}/v1", api_key=key, max_retries=0, timeout=20)
        for i in (among if among is not None else range(len(gws.urls)))
    ]


async def hammer(
    cs: list[openai.AsyncOpenAI], model: str, n: int, concurrency: int = 24, **kw: Any
) -> tuple[int, int, int, float]:
    """`n` chats round robin over `cs`: (admitted, refused 429, tokens the admitted took,
    seconds it took)."""
    ok = refused = tokens = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        nonlocal ok, refused, tokens
        async with sem:
            try:
                r = await cs[i % len(cs)].chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"hi {i}"}], **kw
                )
            except openai.RateLimitError:
                refused += 1
                return
            ok += 1
            tokens += r.usage.total_tokens if r.usage is not None else 0

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        for c in cs:
            await c.close()
    took = time.monotonic() - t0
    print(f"hammer: {ok} admitted, {refused} refused, {tokens} tokens in {took:.2f}s")
    return ok, refused, tokens, took


@pytest.fixture
async def plane(js: JetStreamContext) -> AsyncIterator[Plane]:
    p = Plane(js)
    yield p
    await p.close()


async def test_a_key_hammered_through_three_gateways_is_admitted_its_limit_once(
    nats_server: EmbeddedBroker, plane: Plane, keys: Path, tmp_path: Path
) -> None:
    await plane.model("lim", 3, target_inflight=1000)
    async with fleet(nats_server, keys, tmp_path) as (gws, http):
        await routable(gws, http, "lim", 3)
        ok, refused, _, took = await hammer(clients(gws, KEY), "lim", 3 * RPM)
        refill = RPM * took / 60
        # Today each gateway admits the key's whole minute: about 300.
        assert RPM - 3 <= ok <= RPM + refill + 3, (ok, refused, took)
        assert ok + refused == 3 * RPM

        # tpm likewise: the tokens the admitted took, against the key's tokens a minute.
        ok, refused, tokens, took = await hammer(clients(gws, TOKENS), "lim", 300, max_tokens=16)
        refill = TPM * took / 60
        one = tokens / max(1, ok)
        assert tokens <= TPM + refill + 3 * one, (ok, refused, tokens, took)
        assert tokens >= 0.8 * TPM, (ok, refused, tokens, took)


async def test_a_killed_gateways_share_returns_to_the_others_within_a_second(
    nats_server: EmbeddedBroker, plane: Plane, keys: Path, tmp_path: Path
) -> None:
    await plane.model("kill", 2, target_inflight=1000)
    async with fleet(nats_server, keys, tmp_path) as (gws, http):
        await routable(gws, http, "kill", 2)
        t0 = time.monotonic()
        gws.kill(2)
        await gws.sharing(http, 2, [0, 1])
        assert time.monotonic() - t0 <= 1.0
        # The two left admit the key's whole minute between them, not two thirds of it.
        ok, refused, _, took = await hammer(clients(gws, FRESH, [0, 1]), "kill", 2 * RPM)
        refill = RPM * took / 60
        assert RPM - 3 <= ok <= RPM + refill + 3, (ok, refused, took)


async def test_a_key_sent_through_one_gateway_of_three_gets_its_whole_limit(
    nats_server: EmbeddedBroker, plane: Plane, keys: Path, tmp_path: Path
) -> None:
    # The others hand the gateway that refuses the key what their shares hold.
    await plane.model("one", 2, target_inflight=1000)
    async with fleet(nats_server, keys, tmp_path) as (gws, http):
        await routable(gws, http, "one", 2)
        ok = 0
        deadline = time.monotonic() + 20
        began = time.monotonic()
        while ok < RPM - 3:
            got, _, _, _ = await hammer(clients(gws, FRESH, [0]), "one", 20, concurrency=4)
            ok += got
            assert time.monotonic() < deadline, ok
        took = time.monotonic() - began
        assert ok <= RPM + RPM * took / 60 + 3


async def test_a_conversation_alternating_between_gateways_keeps_its_warm_replica(
    nats_server: EmbeddedBroker, plane: Plane, keys: Path, tmp_path: Path
) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "bench"))
    import bench_prefix

    timing = Timing(0.0, 0.0, prefill_tps=400_000.0, cache_tokens=200_000)
    await plane.model("pfx-one", 4, timing, target_inflight=1000)
    await plane.model("pfx-three", 4, timing, target_inflight=1000)
    async with fleet(nats_server, keys, tmp_path, 3, "--routing", "prefix") as (gws, http):
        await routable(gws, http, "pfx-one", 4)
        await routable(gws, http, "pfx-three", 4)
        trace = bench_prefix.shared(0.25, random.Random(7)).trace

        async def run(model: str, among: list[int]) -> float:
            cs = clients(gws, FREE, among)
            # One request at a time, as a conversation's turns come: each sent once the
            # one before it was answered, and each must find the warm replica its prefix
            # went to, through whichever gateway it comes. Two at a time, two requests
            # of a group begun together at two gateways could not know of each other,
            # however fast the sharing: on a loaded host that race alone took the hit
            # rate through three to 0.689 against 0.735 (0.95 x: 0.698). One at a time,
            # 0.735 through both in six runs beside four busy processes; 0.490 through
            # three with --no-share.
            sem = asyncio.Semaphore(1)

            async def one(i: int, body: dict[str, Any]) -> None:
                async with sem:
                    await cs[i % len(cs)].chat.completions.create(
                        model=model, messages=body["messages"], max_tokens=2
                    )

            try:
                await asyncio.gather(*(one(i, r.body) for i, r in enumerate(trace)))
            finally:
                for c in cs:
                    await c.close()
            servers = [s for s in plane.servers if s.model == model]
            return sum(s.cached_tokens for s in servers) / sum(s.prompt_tokens for s in servers)

        through_one = await run("pfx-one", [0])
        through_three = await run("pfx-three", [0, 1, 2])
        print(f"prefix hit rate: {through_one:.3f} through one, {through_three:.3f} through three")
        assert through_three >= 0.95 * through_one, (through_three, through_one)


async def test_a_model_demanded_counts_each_waiting_request_once(
    nats_server: EmbeddedBroker, js: JetStreamContext, plane: Plane, keys: Path, tmp_path: Path
) -> None:
    # At zero, nothing starts it (no scheduler): every request waits.
    await plane.model("dem", 0)
    async with fleet(nats_server, keys, tmp_path) as (gws, http):
        await routable(gws, http, "dem", 0)
        body = {"model": "dem", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {FREE}"}

        async def held(url: str) -> None:
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()

        waiting = [asyncio.create_task(held(url)) for url in gws.urls for _ in range(2)]
        try:
            subject = subjects.demand_subject("dem")
            deadline = time.monotonic() + 15
            seen: list[int] = []
            while not seen or seen[-1] != 6:
                with contextlib.suppress(Exception):
                    m = await js.get_last_msg(subjects.STREAM, subject)
                    e = codec.decode(m.data or b"")
                    assert isinstance(e, ev.ModelDemandedEvent)
                    seen.append(e.data.waiting)
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.05)
            assert max(seen) == 6
        finally:
            for t in waiting:
                t.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)


def test_the_shared_blocks_are_the_rules_blocks_hashed_alike_in_every_process() -> None:
    from services.core import prefix
    from services.gateway.shared import stable_blocks

    text = "system prompt " * 200 + "é" * 300
    assert len(stable_blocks("m", None, text)) == len(prefix.blocks("m", None, text))
    code = (
        "import sys; from services.gateway.shared import stable_blocks; "
        f"print(stable_blocks('m', 's', {text!r}, owner='o')[-1])"
    )
    said = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(said) == 1


async def test_what_is_not_a_gateways_share_is_dropped_and_the_gateway_serves_on(
    nc: Any, js: JetStreamContext
) -> None:
    from schemas import share as schema
    from tests.gateway.conftest import gateway_for, serving

    async with serving(gateway_for(js, nc=nc, share=True)) as gw, aiohttp.ClientSession() as http:
        assert gw.sharing is not None
        other = schema.Share(gateway="g-other", inflight={"r1": 3}, want=("t" * 16,))
        junk = [
            (subjects.share_subject("g-x"), b"not json"),
            (subjects.share_subject("g-x"), b'{"gateway": 5}'),
            (subjects.share_subject("g-x"), b'{"gateway": "g-x", "inflight": {"r": -1}}'),
            # A message on another gateway's subject counts for nobody.
            (subjects.share_subject("g-x"), schema.encode(other)),
            (subjects.cache_subject("g-x"), b'{"gateway": "g-x", "blocks": {"r": ["a"]}}'),
            (subjects.cache_subject("g-x"), schema.encode(schema.Routed(gateway="g-y"))),
        ]
        for subject, data in junk:
            await nc.publish(subject, data)
        await nc.publish(subjects.share_subject("g-other"), schema.encode(other))
        await nc.flush()
        deadline = time.monotonic() + 5
        while gw.sharing.gateways() != 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert gw.sharing.peers.keys() == {"g-other"}
        assert gw.sharing.inflight() == {"r1": 3}
        async with http.get(f"{gw.url}/health") as r:
            assert r.status == 200 and (await r.json())["share"]["gateways"] == 2
        # It says it leaves: gone at once, its counts with it.
        bye = schema.Share(gateway="g-other", leaving=True)
        await nc.publish(subjects.share_subject("g-other"), schema.encode(bye))
        while gw.sharing.gateways() != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert gw.sharing.inflight() == {}


async def test_a_tenants_share_of_a_models_line_is_its_share_of_the_fleets(
    nats_server: EmbeddedBroker, plane: Plane, keys: Path, tmp_path: Path
) -> None:
    # A line of 4 requests a model over the fleet: team-a holds all 4 through two
    # gateways, so its fifth is refused at the third, whose own line is empty; team-b,
    # under its share, is let in there.
    await plane.model("fair", 0)
    async with fleet(nats_server, keys, tmp_path, 3, "--queue-per-model", "4") as (gws, http):
        await routable(gws, http, "fair", 0)
        body = {"model": "fair", "messages": [{"role": "user", "content": "hi"}]}

        async def send(url: str, key: str) -> int:
            headers = {"Authorization": f"Bearer {key}"}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
                return r.status

        held = [asyncio.create_task(send(gws.urls[i % 2], FREE)) for i in range(4)]
        try:
            deadline = time.monotonic() + 15
            while True:
                h = await gws.health(http, 2)
                if h["share"]["remote_waiting"].get("fair") == 4:
                    break
                assert time.monotonic() < deadline, h["share"]
                await asyncio.sleep(0.02)
            # Refused at once (a request held would not answer in 10 s: today's fifth).
            assert await asyncio.wait_for(send(gws.urls[2], FREE), 10) == 429
            other = asyncio.create_task(send(gws.urls[2], OTHER))
            while (await gws.health(http, 2))["held"].get("fair") != 1:
                assert time.monotonic() < deadline and not other.done()
                await asyncio.sleep(0.02)
            held.append(other)
        finally:
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)


async def test_an_idle_gateway_says_its_state_at_its_heartbeat_and_at_once_to_a_newcomer(
    nats_server: EmbeddedBroker, nc: Client, keys: Path, tmp_path: Path
) -> None:
    # Alone and idle, a gateway said the same state every interval (20 messages a
    # second, each a wake of every gateway, its own too); now once a fifth of its
    # expiry (0.4 s here), and at its next interval to a gateway that joins.
    heard: dict[str, list[float]] = {}
    news = asyncio.Event()

    async def on(msg: Any) -> None:
        s = share_schema.decode_share(msg.data)
        if s is not None and not s.leaving:
            heard.setdefault(s.gateway, []).append(time.monotonic())
            news.set()

    async def until(done: Any) -> None:
        deadline = time.monotonic() + 30
        while not done():
            assert time.monotonic() < deadline, heard
            news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), 1)

    await nc.subscribe(subjects.share_wildcard(), cb=on)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    first = Gateways(nats_server.url, 1, keys, tmp_path / "a", "--share-expiry", "2")
    try:
        await until(lambda: len(heard) == 1 and len(next(iter(heard.values()))) >= 8)
        (idle,) = heard
        times = heard[idle][3:]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) >= 0.3, gaps  # its heartbeat, not its 50 ms interval
        assert max(gaps) <= 1.0, gaps  # well within its expiry
        second = Gateways(nats_server.url, 1, keys, tmp_path / "b")
        try:
            await until(lambda: len(heard) == 2)
            (newcomer,) = set(heard) - {idle}
            joined = heard[newcomer][0]
            await until(lambda: heard[idle][-1] > joined)
            after = min(t for t in heard[idle] if t > joined)
            assert after - joined <= 0.25, after - joined
        finally:
            second.close()
    finally:
        first.close()


async def test_a_lone_gateway_sleeps_until_its_heartbeat_but_says_a_refused_key_at_once(
    nats_server: EmbeddedBroker, nc: Client, plane: Plane, tmp_path: Path
) -> None:
    # Alone, a gateway's loop turns at its heartbeat only (1 s here), not every interval
    # to find nothing to say; a key it refuses is still said an interval after its last
    # message, as by a gateway that is not alone, not at its next heartbeat.
    said: list[tuple[float, tuple[str, ...]]] = []
    news = asyncio.Event()

    async def on(msg: Any) -> None:
        s = share_schema.decode_share(msg.data)
        if s is not None and not s.leaving:
            said.append((time.monotonic(), tuple(s.want)))
            news.set()

    async def next_message() -> tuple[float, tuple[str, ...]]:
        n = len(said)
        deadline = time.monotonic() + 10
        while len(said) == n:
            assert time.monotonic() < deadline, said
            news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(news.wait(), 1)
        return said[n]

    await nc.subscribe(subjects.share_wildcard(), cb=on)
    await plane.model("want", 1, target_inflight=1000)
    one = "k-share-" + "f" * 24
    keys = tmp_path / "keys"
    keys.write_text(f"{one} team-a rpm=1\n")
    keys.chmod(0o600)
    gws = Gateways(nats_server.url, 1, keys, tmp_path, "--share-expiry", "5")
    try:
        async with aiohttp.ClientSession() as http:
            await gws.sharing(http, 1, [0])
            await routable(gws, http, "want", 1)
        (c,) = clients(gws, one)
        try:
            await c.chat.completions.create(
                model="want", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
            for _ in range(3):
                t, want = await next_message()
            gaps = [b[0] - a[0] for a, b in itertools.pairwise(said[-3:])]
            assert min(gaps) >= 0.8, gaps  # its heartbeat (1 s), not its 50 ms interval
            with pytest.raises(openai.RateLimitError):
                await c.chat.completions.create(
                    model="want", messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
            refused = time.monotonic()
            t, want = await next_message()
            assert want, said[-3:]  # the key it refused, said
            assert t - refused <= 0.5, (t - refused, t - said[-2][0])
        finally:
            await c.close()
    finally:
        gws.close()


async def test_a_lone_gateway_tells_its_load_and_blocks_only_once_another_listens(
    nats_server: EmbeddedBroker, nc: Client, plane: Plane, keys: Path, tmp_path: Path
) -> None:
    # Alone, a gateway's counts and routed blocks reach nobody: its state goes at its
    # heartbeat (0.4 s here), however its counts change, and no block batch goes (each
    # one a publish and a wake a request). Once another gateway is heard, both go as
    # before: the counts each interval while they change, the blocks each turn.
    shares: dict[str, list[float]] = {}
    batches: dict[str, int] = {}

    async def on_share(msg: Any) -> None:
        s = share_schema.decode_share(msg.data)
        if s is not None and not s.leaving:
            shares.setdefault(s.gateway, []).append(time.monotonic())

    async def on_routed(msg: Any) -> None:
        b = share_schema.decode_routed(msg.data)
        if b is not None:
            batches[b.gateway] = batches.get(b.gateway, 0) + 1

    await nc.subscribe(subjects.share_wildcard(), cb=on_share)
    await nc.subscribe(subjects.cache_wildcard(), cb=on_routed)
    await plane.model("lone", 2, Timing(0.0, 40.0), target_inflight=1000)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    first = Gateways(
        nats_server.url, 1, keys, tmp_path / "a", "--routing", "prefix", "--share-expiry", "2"
    )
    try:
        async with aiohttp.ClientSession() as http:
            await first.sharing(http, 1, [0])
            await routable(first, http, "lone", 2)

            async def load(gws: Gateways) -> tuple[float, float]:
                # Three lines of requests one after another, of 4, 6 and 8 tokens at 40
                # a second: the counts in flight change every 0.1 s or sooner, for 1 s.
                cs = clients(gws, FREE, [0])
                t0 = time.monotonic()

                async def line(n: int) -> None:
                    for i in range(10 // (n + 1)):
                        await cs[0].chat.completions.create(
                            model="lone",
                            messages=[{"role": "user", "content": f"{n} {i} " + "x" * 300}],
                            max_tokens=4 + 2 * n,
                        )

                try:
                    await asyncio.gather(*(line(n) for n in range(3)))
                finally:
                    await cs[0].close()
                return t0, time.monotonic()

            t0, t1 = await load(first)
            (lone,) = shares
            during = [t for t in shares[lone] if t0 <= t <= t1]
            gaps = [b - a for a, b in itertools.pairwise(during)]
            assert gaps and min(gaps) >= 0.3, gaps  # its heartbeat, not its interval
            assert not batches, batches  # no block told to nobody

            second = Gateways(nats_server.url, 1, keys, tmp_path / "b", "--routing", "prefix")
            try:
                await first.sharing(http, 2, [0])
                t0, t1 = await load(first)
                during = [t for t in shares[lone] if t0 <= t <= t1]
                gaps = [b - a for a, b in itertools.pairwise(during)]
                assert min(gaps) < 0.2, gaps  # each interval while its counts change
                assert batches.get(lone, 0) >= 6, batches  # its blocks told each turn
            finally:
                second.close()
    finally:
        first.close()


async def test_a_gateway_process_is_sent_none_of_its_own_messages(
    nats_server: EmbeddedBroker, keys: Path, tmp_path: Path
) -> None:
    # Its load and its announcements are for the other gateways; each one the broker
    # sent back would be a wake of its loop and a decode, to be dropped.
    def conn() -> dict[str, Any] | None:
        url = f"http://127.0.0.1:{nats_server.monitor_port}/connz"
        with urllib.request.urlopen(url, timeout=5) as r:
            conns = json.load(r).get("connections") or []
        return next((c for c in conns if c.get("name") == "gateway"), None)

    async def after(n: int) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while (c := await asyncio.to_thread(conn)) is None or c["in_msgs"] < n:
            assert time.monotonic() < deadline, c
            await asyncio.sleep(0.05)
        return c

    gws = Gateways(nats_server.url, 1, keys, tmp_path)
    try:
        begun = await after(30)  # its start's requests and answers done
        ended = await after(begun["in_msgs"] + 40)
        # What it is sent is the log's (its follower's, and the stream's heartbeats),
        # not the heartbeats of its sharing (10 a second) and its fleet (4 a second).
        sent, said = (ended[k] - begun[k] for k in ("out_msgs", "in_msgs"))
        assert sent <= said // 4, (sent, said)
    finally:
        gws.close()
