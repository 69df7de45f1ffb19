"""Benchmark: prefix-aware routing on real engines, two vLLM CPU replicas of the tiny model,
least-inflight against prefix.

Run from the repository root (the engine environment set up as the README's test
command does):

    python tests/bench/bench_prefix_engine.py [--engine-python .venv-engine/bin/python]
        [--groups 8] [--each 6] [--rate 3] [--blocks 64]

Prints figures, asserts nothing. Makes the tiny model (`deploy/examples/tiny-model/make.py
--size large`, about 4.7M parameters), starts two vLLM servers (`--enforce-eager
--enable-prompt-tokens-details`, each with `--blocks` KV blocks of 128 tokens, so that
all the groups' prefixes do not fit in one replica's cache), an embedded nats-server and,
per arm, a gateway in this process told the two endpoints by `replica.state` events (the
prefix rule told the servers' KV capacity, `--blocks` x 128 tokens, as an agent that
reported it would).
Each arm sends the same shape of trace (`--groups` shared prefixes of 8 blocks of the
CPU build's 128 tokens, `--each` completions of each with a short suffix of their own,
in a random order, Poisson arrivals at `--rate` a second, one token each), its texts
its own so that no arm finds another's prefixes cached. The figures: the engines' own
`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries` over the arm, the hit rate the
answers' `cached_tokens` say, and time to first token (the whole answer: one token) at
the client. Both servers are stopped at the end, however it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from schemas import events as ev  # noqa: E402
from schemas import subjects  # noqa: E402
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402
from services.core import prefix  # noqa: E402
from services.core.pickers import PICKERS  # noqa: E402
from services.gateway.config import Config  # noqa: E402
from services.gateway.server import Gateway  # noqa: E402
from tests.engine import engine  # noqa: E402

JSON_TYPE = {"Content-Type": "application/json"}
ARMS = ("least-inflight", "prefix")
NODE = "bench-pfx-engine"
# BLOCK_TOKENS is vLLM's CPU build's KV block.
BLOCK_TOKENS = 128
WORDS = ("alpha", "beta", "gamma", "delta", "log", "fold", "plane", "token", "cache", "seed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else float("nan")


def _metric(text: str, name: str) -> float:
    """The sum of a counter's samples in a Prometheus page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (
            m := re.match(rf"{name}(?:_total)?(?:{{[^}}]*}})? (\S+)", line)
        ):
            total += float(m.group(1))
    return total


async def _tokens(http: aiohttp.ClientSession, url: str, text: str) -> int:
    async with http.post(
        f"{url}/tokenize", json={"model": "tiny", "prompt": text}, headers=JSON_TYPE
    ) as r:
        return int((await r.json())["count"])


async def _prefix(http: aiohttp.ClientSession, url: str, rng: random.Random, tokens: int) -> str:
    """Text of `tokens` tokens by the engine's own tokenizer (give or take one)."""
    words: list[str] = [f"prefix-{rng.getrandbits(32)}"]
    while True:
        n = await _tokens(http, url, " ".join(words))
        if n >= tokens:
            return " ".join(words)
        words.extend(rng.choice(WORDS) for _ in range(max(1, (tokens - n) // 3)))


async def _wait_ready(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + engine.READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {proc.returncode}")
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{url}/health") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(1.0)
    raise RuntimeError(f"the server at {url} was not ready within {engine.READY_S:g}s")


async def _arm(
    a: argparse.Namespace, js: Any, http: aiohttp.ClientSession, urls: list[str], arm: str, n: int
) -> None:
    pub = Publisher(js)
    model = f"tiny-{arm}"

    async def say(data: ev.Data, node: str | None = None) -> int:
        e = ev.make(data, id=new_id(), time=utc_now(), source="bench")
        return int((await pub.publish(e, node=node)).seq)

    await say(
        ev.ModelDeclared(
            name=model, min=0, target_inflight=4, profiles=(ev.ProfileSpec(name="p", gpus=1),)
        )
    )
    seq = 0
    for i, url in enumerate(urls):
        rid = f"{model}-r{i}"
        shards = (ev.ShardSpec(node=NODE, gpus=(2 * n + i,)),)
        await say(
            ev.PlacementDecided(replica=rid, model=model, profile="p", shards=shards, reason="")
        )
        seq = await say(
            ev.ReplicaState(
                replica=rid, model=model, profile="p", state="ready", shards=shards, endpoint=url
            ),
            NODE,
        )
    # The prefix rule told the engines' KV capacity, as an agent that reported it would.
    pickers = {
        **PICKERS,
        "prefix": lambda: prefix.Prefix(capacity_tokens=a.blocks * BLOCK_TOKENS),
    }
    gw = Gateway.of(
        js,
        Config(listen="127.0.0.1:0", routing=arm, upstream_timeout_s=120),
        root=subjects.DEFAULT_ROOT,
        pickers=pickers,
    )
    sock = gw.bind()
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(gw.run(stop, sock, on_ready=lambda _: ready.set()))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        await gw.follower.wait_for(seq, 30)
        rng = random.Random(a.seed * 100 + n)
        prefixes = [await _prefix(http, urls[0], rng, a.prefix_tokens) for _ in range(a.groups)]
        order = [g for g in range(a.groups) for _ in range(a.each)]
        rng.shuffle(order)
        before = []
        for url in urls:
            async with http.get(f"{url}/metrics") as r:
                before.append(await r.text())
        ttft: list[float] = []
        cached_prompt = [0, 0]
        whys: dict[str, int] = {}

        async def one(i: int, g: int) -> None:
            body = {
                "model": model,
                "prompt": f"{prefixes[g]} question {i}: {rng.choice(WORDS)} {rng.choice(WORDS)}",
                "max_tokens": 1,
            }
            t0 = time.perf_counter()
            async with http.post(
                f"{gw.url}/v1/completions", data=json.dumps(body), headers=JSON_TYPE
            ) as r:
                doc = await r.json()
                if r.status != 200:
                    print("error", r.status, str(doc)[:200])
                    return
                ttft.append(time.perf_counter() - t0)
                why = r.headers.get("x-llmgw-route", "-").split(";")[0]
                whys[why] = whys.get(why, 0) + 1
            u = doc.get("usage") or {}
            cached_prompt[0] += int(
                (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            )
            cached_prompt[1] += int(u.get("prompt_tokens") or 0)

        tasks = []
        start = time.perf_counter()
        t = 0.0
        for i, g in enumerate(order):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, g)))
            t += rng.expovariate(a.rate)
        await asyncio.gather(*tasks)
        span = time.perf_counter() - start
        hits = queries = 0.0
        for url, b in zip(urls, before, strict=True):
            async with http.get(f"{url}/metrics") as r:
                after = await r.text()
            hits += _metric(after, "vllm:prefix_cache_hits") - _metric(b, "vllm:prefix_cache_hits")
            queries += _metric(after, "vllm:prefix_cache_queries") - _metric(
                b, "vllm:prefix_cache_queries"
            )
        print(
            f"{arm:<15} engines' hits/queries {hits / max(queries, 1):.2f} "
            f"({hits:.0f}/{queries:.0f}), answers' cached {cached_prompt[0] / max(cached_prompt[1], 1):.2f}; "
            f"TTFT p50 {_pct(ttft, 0.5):.0f} ms, p90 {_pct(ttft, 0.9):.0f} ms, "
            f"p99 {_pct(ttft, 0.99):.0f} ms; {len(ttft) / span:.1f} req/s; picks {whys}"
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def _main(
    a: argparse.Namespace, urls: list[str], procs: list[subprocess.Popen[bytes]]
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-engine-"))
    broker = EmbeddedBroker(tmp / "broker")
    broker.start()
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
        ) as http:
            t0 = time.monotonic()
            for url, proc in zip(urls, procs, strict=True):
                await _wait_ready(http, url, proc)
            print(f"both servers ready in {time.monotonic() - t0:.0f} s")
            nc = await connect(broker.url, "bench")
            js = nc.jetstream()
            await ensure_streams(js)
            gpus = tuple(
                ev.GpuInfo(index=i, uuid=f"{NODE}-g{i}", model="cpu", memory_gb=1) for i in range(8)
            )
            e = ev.make(
                ev.NodeInventory(node=NODE, gpus=gpus, cpu_cores=2, memory_gb=8),
                id=new_id(),
                time=utc_now(),
                source="bench",
            )
            await Publisher(js).publish(e, node=NODE)
            for n, arm in enumerate(ARMS):
                await _arm(a, js, http, urls, arm, n)
            await nc.close()
    finally:
        broker.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-python", default=str(ROOT / ".venv-engine" / "bin" / "python"))
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--each", type=int, default=6)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--blocks", type=int, default=48, help="KV blocks of 128 tokens a server")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    python = Path(a.engine_python)
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-engine-model-"))
    weights = engine.make_model(python, tmp / "tiny", "--size", "large")
    urls: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for i in range(2):
            port = _free_port()
            log = open(tmp / f"server-{i}.log", "wb")  # noqa: SIM115
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [
                        str(python),
                        "-m",
                        "vllm.entrypoints.openai.api_server",
                        "--model",
                        str(weights),
                        "--served-model-name",
                        "tiny",
                        *(f"tiny-{arm}" for arm in ARMS),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        *engine.ARGS,
                        "--num-gpu-blocks-override",
                        str(a.blocks),
                    ],
                    env={**os.environ, **engine.ENV},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        asyncio.run(_main(a, urls, procs))
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for log in logs:
            log.close()
        print(f"servers stopped; their logs in {tmp}")


if __name__ == "__main__":
    main()
