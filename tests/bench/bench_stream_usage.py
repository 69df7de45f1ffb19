"""Benchmark: what counting a stream's tokens costs the streaming path, when its client did
not ask for the usage chunk (the gateway asks on its behalf and strips the chunk).

Run from the repository root: `python tests/bench/bench_stream_usage.py [--streams 200]
[--rounds 4] [--tokens 16]`. Prints figures, asserts nothing.

Two parts. In process, no I/O: the cost per stream of `streams.ask_for_usage` (the body
written into) and of `streams.Strip` over a simulated server's stream of `--tokens`
tokens fed one event a chunk, beside the pass-through's own bookkeeping (the tail kept
for a client that asked). Then end to end, in one run: an embedded nats-server, one
simulated model server and `python -m services.gateway` as their own processes, and
`--streams` concurrent streams through the gateway, alternating rounds of clients that
ask for the usage chunk (the body and the stream pass untouched) and clients that do
not (the body written into, the chunk stripped): time to first byte and to the last
byte, medians and p99 of each kind over all rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import timeit
from pathlib import Path

# JSON_TYPE says a body is JSON, as the gateway asks (another type is 415).
JSON_TYPE = {"Content-Type": "application/json"}

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import msgspec  # noqa: E402

from schemas import events as ev  # noqa: E402
from services.bus import Publisher, connect, ensure_streams  # noqa: E402
from services.clock import new_id, utc_now  # noqa: E402
from services.gateway import streams  # noqa: E402

NODE = "bench-su"


def _body(asks: bool, tokens: int) -> bytes:
    doc: dict[str, object] = {
        "model": "bench",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": tokens,
        "stream": True,
    }
    if asks:
        doc["stream_options"] = {"include_usage": True}
    return json.dumps(doc).encode()


def _events(tokens: int) -> list[bytes]:
    """A simulated server's stream of `tokens` tokens, one event a chunk, usage included."""
    out = []
    for i in range(tokens + 2):
        c = {"index": 0, "delta": {"content": " word"}, "finish_reason": None, "logprobs": None}
        doc = {"id": "chatcmpl-x-1", "object": "chat.completion.chunk", "created": 1}
        out.append(b"data: " + json.dumps({**doc, "model": "bench", "choices": [c]}).encode())
        if i == tokens + 1:
            usage = {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": tokens + 4}
            out[-1] = b"data: " + json.dumps({**doc, "choices": [], "usage": usage}).encode()
    return [e + b"\n\n" for e in out] + [b"data: [DONE]\n\n"]


def _in_process(tokens: int) -> None:
    body = _body(False, tokens)
    events = _events(tokens)

    def ask() -> None:
        streams.ask_for_usage(body, msgspec.UNSET)

    def strip() -> None:
        s = streams.Strip()
        for e in events:
            s.feed(e)
        s.end()

    def tail() -> None:
        t = b""
        for e in events:
            t = (t + e)[-8192:]

    def per(f: object) -> float:
        n = 2000
        runs = timeit.repeat(f, number=n, repeat=5)  # type: ignore[arg-type]
        return sorted(runs)[2] / n * 1e6

    a, s, t = per(ask), per(strip), per(tail)
    print(f"in process, a stream of {tokens} tokens ({len(events)} events), median of 5:")
    print(f"  body written into: {a:.2f} us; strip: {s:.2f} us; pass-through tail: {t:.2f} us")
    print(f"  added per stream by asking on the client's behalf: {a + s - t:.2f} us")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else float("nan")


async def _round(
    http: aiohttp.ClientSession, url: str, body: bytes, n: int
) -> tuple[list[float], list[float], int]:
    first: list[float] = []
    last: list[float] = []
    usage = 0

    async def one() -> None:
        nonlocal usage
        t = time.perf_counter()
        async with http.post(url, data=body, headers=JSON_TYPE) as r:
            chunk = await r.content.readany()
            first.append(time.perf_counter() - t)
            rest = await r.read()
            last.append(time.perf_counter() - t)
            usage += b'"usage"' in chunk + rest

    await asyncio.gather(*(one() for _ in range(n)))
    return first, last, usage


async def _end_to_end(a: argparse.Namespace) -> None:
    from tests.bench.bench_gateway import _start

    a.tps = 0.0
    broker, procs, up_port, gw_port = _start(a)
    try:
        nc = await connect(broker.url, "bench")
        js = nc.jetstream()
        await ensure_streams(js)
        pub = Publisher(js)

        def make(data: ev.Data) -> ev.Event:
            return ev.make(data, id=new_id(), time=utc_now(), source="bench")

        gpu = ev.GpuInfo(index=0, uuid="g0", model="H100", memory_gb=80)
        inv = ev.NodeInventory(node=NODE, gpus=(gpu,), cpu_cores=8, memory_gb=64)
        await pub.publish(make(inv), node=NODE)
        model = ev.ModelDeclared(name="bench", min=0, profiles=(ev.ProfileSpec(name="p", gpus=1),))
        await pub.publish(make(model))
        shards = (ev.ShardSpec(node=NODE, gpus=(0,)),)
        # Placed first: only a placement makes a replica (a report alone is refused).
        placed = ev.PlacementDecided(
            replica="bench-1", model="bench", profile="p", shards=shards, reason="bench"
        )
        await pub.publish(make(placed))
        ready = ev.ReplicaState(
            replica="bench-1",
            model="bench",
            profile="p",
            state="ready",
            shards=shards,
            endpoint=f"http://127.0.0.1:{up_port}",
        )
        await pub.publish(make(ready), node=NODE)
        await nc.close()
        url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            deadline = time.monotonic() + 30
            while True:
                try:
                    async with http.post(url, data=_body(True, 1), headers=JSON_TYPE) as r:
                        await r.read()
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "the gateway never routed"
                await asyncio.sleep(0.1)
            got: dict[bool, tuple[list[float], list[float], int]] = {
                True: ([], [], 0),
                False: ([], [], 0),
            }
            for _ in range(a.rounds):
                for asks in (True, False):
                    f, la, u = await _round(http, url, _body(asks, a.tokens), a.streams)
                    old = got[asks]
                    got[asks] = (old[0] + f, old[1] + la, old[2] + u)
        print(
            f"end to end, {a.streams} concurrent streams of {a.tokens} tokens, "
            f"{a.rounds} rounds of each, alternating:"
        )
        for asks, name in ((True, "client asks (untouched)"), (False, "asked on its behalf")):
            f, la, u = got[asks]
            print(
                f"  {name:24} first byte p50 {_pct(f, 0.5):.2f} / p99 {_pct(f, 0.99):.2f} ms; "
                f"last byte p50 {_pct(la, 0.5):.2f} / p99 {_pct(la, 0.99):.2f} ms; "
                f"usage chunks seen {u}/{len(la)}"
            )
        yes, no = got[True], got[False]
        print(
            f"  ratio (on behalf / asks), last byte p50 {_pct(no[1], 0.5) / _pct(yes[1], 0.5):.3f}"
            f", first byte p50 {_pct(no[0], 0.5) / _pct(yes[0], 0.5):.3f}"
        )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        broker.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    _in_process(a.tokens)
    asyncio.run(_end_to_end(a))


if __name__ == "__main__":
    main()
