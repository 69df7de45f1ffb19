"""Streams that survive their replica, on real engines: two vLLM servers (CPU build) of
the tiny model behind a gateway in this process, greedy; streams begun on one, that one
`kill -9`'d midway, and each stream goes on on the other. No client sees an error, and
each continued text is compared with the same request's uninterrupted answer (by text,
the new replica reads the text so far as prompt: the fraction that differs is printed,
and recorded in docs/performance.md).

`STREAMS` streams of 512 to 895 tokens at once (the tiny model is too fast on two cores
for a kill to land in shorter ones), the server killed once each has begun (its answer's
headers read), and the other made ready then: those it had not finished wait for it, and go on there. Both servers start in the module's
fixture and are killed, with their process groups, at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.agent.process import VLLM_MODULE
from services.gateway.server import Gateway
from tests.engine import engine
from tests.gateway.conftest import Plane

pytestmark = [pytest.mark.engine, pytest.mark.module_broker]

MODEL = "tiny-ce"
STREAMS = 50
# The tiny model writes thousands of tokens a second on two cores: streams of 64-256
# tokens all end before a kill can land in them, so these are 512-895 tokens long.
SHORTEST = 512


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def servers(
    engine_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """Two vLLM servers of the tiny model, ready; killed with their groups at the end."""
    logs = tmp_path_factory.mktemp("ce-logs")
    made: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for name in ("a", "b"):
            port = _port()
            argv = [str(engine_python), "-m", VLLM_MODULE, "--model", str(tiny_model)]
            argv += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port)]
            argv += [*engine.ARGS, "--max-model-len", "1024"]
            with open(logs / f"{name}.log", "wb") as log:
                p = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **engine.ENV},
                    start_new_session=True,
                )
            made.append((p, f"http://127.0.0.1:{port}"))
        deadline = time.monotonic() + engine.READY_S
        while not all(_healthy(url) for _, url in made):
            for p, _ in made:
                assert p.poll() is None, f"a server exited: {(logs / 'a.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the servers were not ready in time"
            time.sleep(1)
        yield made
    finally:
        for p, _ in made:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


@pytest.fixture
async def plane(nc: Client, js: JetStreamContext) -> AsyncIterator[Plane]:
    """A gateway in this process, as tests/gateway's, that waits for a CPU engine's
    answers (60 s for a whole one) and holds the 50 streams at once."""
    gw = Gateway(js, listen="127.0.0.1:0", upstream_timeout_s=60, min_wait_s=5, nc=nc)
    sock = gw.bind()
    stop = asyncio.Event()
    ready = asyncio.Event()
    task = asyncio.create_task(gw.run(stop, sock, on_ready=lambda _: ready.set()))
    await asyncio.wait_for(ready.wait(), 10)
    async with aiohttp.ClientSession() as http:
        p = Plane(js, gw, http)
        await p.inventory(p.node, 4)
        yield p
    stop.set()
    await asyncio.wait_for(task, 10)


def _request(i: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": f"request {i}: the model answer token prompt hello world {i}",
        "max_tokens": SHORTEST + (i * 37) % 384,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }


@pytest.mark.timeout(engine.READY_S + 300)
async def test_streams_whose_server_is_killed_midway_end_as_one_answer(
    plane: Plane,
    servers: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    (a, a_url), (_, b_url) = servers
    # Declared as served by vLLM: the gateway asks it for the running token count.
    await plane.say(
        ev.ModelDeclared(
            name=MODEL,
            min=0,
            profiles=(ev.ProfileSpec(name="p", gpus=1),),
            target_inflight=STREAMS,
            runtime=ev.ModelRuntime(engine="vllm"),
        )
    )
    await plane.ready("ce-a", MODEL, a_url)
    client = openai.AsyncOpenAI(
        base_url=f"{plane.url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    try:
        # The uninterrupted answers, from the server to be killed.
        t0 = time.monotonic()
        whole = await asyncio.gather(
            *(client.completions.create(**_request(i)) for i in range(STREAMS))
        )
        took = time.monotonic() - t0
        expected = [w.choices[0].text for w in whole]

        got: list[list[str]] = [[] for _ in range(STREAMS)]
        errors: list[BaseException] = []
        begun = asyncio.Event()
        cut_at: list[int] = []
        opened: list[int] = []

        async def one(i: int) -> None:
            try:
                stream = await client.completions.create(stream=True, **_request(i))
                opened.append(i)
                if len(opened) == STREAMS:
                    # Every stream begun (its answer's headers read): the server killed
                    # at once, before any other task reads on. (At the first chunk read
                    # after that, the server had sometimes written every answer whole
                    # into the sockets already: nothing was left to continue.)
                    os.killpg(a.pid, signal.SIGKILL)
                    cut_at.extend(len("".join(g)) for g in got)
                    begun.set()
                async for c in stream:
                    if c.choices:
                        got[i].append(c.choices[0].text)
            except (openai.APIError, OSError) as e:
                errors.append(e)

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        await asyncio.wait_for(begun.wait(), 120)
        # The other replica made ready once the first is dead: the streams wait for it.
        await plane.ready("ce-b", MODEL, b_url)
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    assert errors == []
    texts = ["".join(g) for g in got]
    moved = plane.gateway.continuations.moved.get("ce-a", 0)
    ended = [t for t, c in zip(texts, cut_at, strict=True) if len(t) > c]
    differ = [i for i in range(STREAMS) if texts[i] != expected[i]]
    print(
        f"\n{STREAMS} streams, ce-a killed once all had begun: {moved} moved, "
        f"0 client errors, {len(differ)} differ from the uninterrupted answer "
        f"({len(ended)} went on past the kill, {sum(1 for c in cut_at if c)} had text "
        f"before it; the uninterrupted ones took {took:.1f} s)"
    )
    for i in differ[:3]:
        at = next(
            (k for k, (x, y) in enumerate(zip(texts[i], expected[i], strict=False)) if x != y),
            min(len(texts[i]), len(expected[i])),
        )
        print(
            f"stream {i}: {len(texts[i])} against {len(expected[i])} characters, cut at "
            f"{cut_at[i]}, first differs at {at}: {texts[i][at - 20 : at + 40]!r} against "
            f"{expected[i][at - 20 : at + 40]!r}"
        )
    assert moved >= 1
    assert all(len(t) >= len(e) // 2 for t, e in zip(texts, expected, strict=True))
