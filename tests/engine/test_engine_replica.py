"""vLLM's CPU build as a replica's server, run by a real `llmgw agent` on a host without
GPUs (its inventory given by flag) from the engine environment, serving the tiny model
made on the spot: ready through a real completion, its metrics read into `replica.used`
and the view, and `kill -9` of its server failing the replica with the engine's log.

One engine start serves the module: its tests run in order on it, the last one kills it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest

from schemas import events as ev
from services.agent import process, procs
from services.bus import EmbeddedBroker, Publisher, connect, ensure_streams
from tests.agent import realagent as ra
from tests.agent.helpers import drain_cmd, node_events, placement_of, start_cmd
from tests.agent.test_process_runtime import _ports
from tests.engine import engine

pytestmark = [pytest.mark.engine, pytest.mark.module_broker]

T = TypeVar("T")
NODE = "cpu-0"
MODEL = "tiny"
# A prompt of about 300 tokens: over two of the CPU build's 128-token blocks, so the
# second time it is asked its first 256 tokens come from the prefix cache.
PROMPT = " ".join(["the model request answer token prompt hello world"] * 40)


@dataclass
class Served:
    """A replica of the module's agent: its server's entry in the agent's state file,
    and how long from its start command to ready."""

    url: str
    agent: ra.RealAgent
    data: Path
    replica: str
    server: dict[str, Any]
    endpoint: str
    ready_s: float
    states: list[str]


def _on_bus(url: str, work: Callable[[Any], Awaitable[T]]) -> T:
    """Run `work(js)` on a connection of its own (the module's fixture is not async)."""

    async def run() -> T:
        nc = await connect(url, "engine-test")
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            return await work(js)
        finally:
            await nc.close()

    return asyncio.run(run())


async def _until(
    js: Any, what: str, probe: Callable[[list[ev.Event]], T | None], within_s: float
) -> T:
    deadline = time.monotonic() + within_s
    while True:
        got = probe(await node_events(js, NODE))
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {within_s:g}s")
        await asyncio.sleep(0.2)


def _states(es: list[ev.Event], replica: str) -> list[str]:
    return [
        e.data.state
        for e in es
        if isinstance(e, ev.ReplicaStateEvent) and e.data.replica == replica
    ]


def _start(url: str, agent: ra.RealAgent, data: Path, replica: str) -> Served:
    """Place and start `replica` of the model on the agent's node; wait until it is ready
    (or failed, which fails the test with the agent's and the server's logs)."""

    async def up(js: Any) -> tuple[float, list[str]]:
        start = start_cmd(replica, NODE, (0,), model=MODEL)
        await Publisher(js).publish(placement_of(start))
        t0 = time.monotonic()
        await Publisher(js).publish(start)

        def final(es: list[ev.Event]) -> list[str] | None:
            got = _states(es, replica)
            return got if {"ready", "failed"} & set(got) else None

        got = await _until(js, "ready or failed", final, engine.READY_S + 30)
        return time.monotonic() - t0, got

    ready_s, states = _on_bus(url, up)
    print(f"\nvLLM (CPU build) as replica {replica}: ready {ready_s:.1f}s after its start command")
    server = ra.servers(data, NODE).get(replica, {})
    log = data / f"agent-{NODE}" / "logs" / f"{replica}.log"
    assert states[-1] == "ready", (
        f"{states}: {agent.text()[-3000:]} {ra.text(log)[-3000:] if log.exists() else ''}"
    )
    return Served(
        url=url,
        agent=agent,
        data=data,
        replica=replica,
        server=server,
        endpoint=f"http://127.0.0.1:{server['port']}",
        ready_s=ready_s,
        states=states,
    )


@pytest.fixture(scope="module")
def agent(
    module_nats_server: EmbeddedBroker,
    engine_python: Path,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, ra.RealAgent, Path]]:
    """The module's agent on a host without GPUs (one slot given by flag), the model
    declared with the engine's runtime; at the end its replicas still up are drained
    and nothing of their servers is left."""
    url = module_nats_server.url
    data = tmp_path_factory.mktemp("engine-agent")
    # One sequence at a time: the drain test's streams queue behind one another.
    rt = engine.runtime(engine_python, tiny_model, "--max-num-seqs", "1")
    _on_bus(url, lambda js: Publisher(js).publish(ra.declared(MODEL, rt)))
    a = ra.RealAgent(
        url,
        NODE,
        data,
        "--ports",
        _ports(4),
        "--used-interval",
        "0.5",
        "--scrape",
        "0.5",
        gpus="1xCPU-8GB",
    )
    try:
        _on_bus(
            url,
            lambda js: _until(
                js,
                "inventory",
                lambda es: any(isinstance(e, ev.NodeInventoryEvent) for e in es) or None,
                30,
            ),
        )
        yield url, a, data
    finally:
        # The agent leaves its servers running when it stops (a restarted one adopts
        # them): a replica still up is drained first.
        async def down(js: Any) -> None:
            es = await node_events(js, NODE)
            up = {
                e.data.replica
                for e in es
                if isinstance(e, ev.ReplicaStateEvent)
                and not {"stopped", "failed"} & set(_states(es, e.data.replica))
            }
            for r in up:
                await Publisher(js).publish(drain_cmd(r, model=MODEL, grace_s=10.0), node=NODE)
            for r in up:

                def over(es: list[ev.Event], r: str = r) -> bool | None:
                    return bool({"stopped", "failed"} & set(_states(es, r))) or None

                await _until(js, "stopped", over, 60)

        try:
            _on_bus(url, down)
        finally:
            a.stop()
            left = ra.sweep(NODE)
        assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def served(agent: tuple[str, ra.RealAgent, Path]) -> Served:
    """Replica r-1, started once for the tests that use it (the drain's is the last)."""
    return _start(*agent, "r-1")


def _client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.endpoint + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.timeout(engine.READY_S + 120)
def test_the_agent_starts_vllm_and_it_is_ready_through_a_real_completion(
    served: Served, record_property: Callable[[str, object], None]
) -> None:
    record_property("ready_s", round(served.ready_s, 1))
    assert served.states == ["starting", "loading", "ready"]
    log = ra.text(served.server["log"])
    # Run by its module from the engine environment, the weights served under the
    # model's name, its own drain as long as the agent's grace allows.
    assert (
        f"-m vllm.entrypoints.openai.api_server --model {served.server['runtime']['weights']} "
        f"--served-model-name {MODEL} --host 127.0.0.1 --port {served.server['port']}"
    ) in log
    assert "--shutdown-timeout 86400 --enforce-eager" in log
    # Ready came after a completion was answered, not after /health alone.
    assert '"POST /v1/completions HTTP/1.0" 200' in log
    # The server answers what a client asks of the model by its llmgw name.
    c = _client(served)
    done = c.completions.create(model=MODEL, prompt="hello world", max_tokens=4)
    assert done.usage is not None and done.usage.completion_tokens <= 4
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens > 0


@pytest.mark.timeout(120)
def test_the_engines_metrics_reach_replica_used_and_the_view(served: Served) -> None:
    c = _client(served)
    first = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    again = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert first.usage is not None and again.usage is not None
    n = first.usage.prompt_tokens
    assert n > 256
    # The engine's own word on its cache, in the answer (--enable-prompt-tokens-details).
    details = again.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) >= 256

    def load(es: list[ev.Event]) -> ev.EngineLoad | None:
        for e in reversed(es):
            if isinstance(e, ev.ReplicaUsedEvent) and e.data.engine is not None:
                got = e.data.engine
                return got if (got.prefix_cache_hits or 0) >= 256 else None
        return None

    got = _on_bus(served.url, lambda js: _until(js, "the engine's load", load, 60))
    assert got.prompt_tokens is not None and got.prompt_tokens >= 2 * n
    assert got.generation_tokens is not None and got.generation_tokens >= 4
    assert got.prefix_cache_queries is not None and got.prefix_cache_queries >= 2 * n
    assert got.running == 0 and got.waiting == 0
    assert got.kv_cache_usage is not None and 0.0 <= got.kv_cache_usage <= 1.0

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "--nats",
            served.url,
            "explain",
            "replica",
            "r-1",
            "--json",
        ],
        cwd=ra.REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout)["engine"]
    assert said["prefix_cache_hits"] >= 256 and said["prefix_cache_hit_rate"] > 0


# LONG: each drained stream's tokens (1-3 s at one stream's pace on this tier's hosts).
LONG = 1000
# HELD: the streams the engine holds when its drain comes, one served and the rest waiting
# (the module's server is started with --max-num-seqs 1).
#
# The drain's way from the log to the server's SIGTERM took under 1 s on one host and over
# 20 s on another; on a third, three streams kept open by reopening each as it ended still
# all ended in that time, and vLLM had nothing in flight to drain (its log said nothing of
# draining). So the engine is held still instead: once its metrics say it holds HELD
# streams, its engine core and workers (every process of the server's but the API server)
# get SIGSTOP, and SIGCONT once the API server says its SIGTERM came. The SIGTERM the API
# server passes on to its engine core waits, pending, until then: the engine core wakes to
# it with every stream it held still in flight, whatever the drain's way took.
HELD = 3
# ENDED_S: how long the streams are watched once the engine is held, for those its API
# server can end without it (the engine had ended them already): more than the API
# server's lag behind its engine (under 1 s measured), less than a stream's pace.
ENDED_S = 1.0
# SIGTERM_S bounds the streams' start and the drain's way from the log to the server's
# SIGTERM.
SIGTERM_S = 120.0


@pytest.mark.timeout(SIGTERM_S + 120)
def test_a_drain_lets_a_stream_in_flight_finish_then_nothing_of_the_server_is_left(
    served: Served,
) -> None:
    """Streams the engine serves or holds when its SIGTERM comes (the drain sent to it
    directly: no gateway counts them) end whole, not in `finish_reason: "abort"` (vLLM's
    way without --shutdown-timeout); then its process group and its port are gone."""
    pid, port, tag = served.server["pid"], served.server["port"], served.server["tag"]
    c = _client(served)

    def signalled() -> bool:
        return "shutdown triggered" in ra.text(served.server["log"])  # vLLM's at a SIGTERM

    def held() -> float:
        """The requests the engine serves and holds now, by its own metrics."""
        names = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
        return engine.metrics(served.endpoint, names)

    def stream() -> Callable[[], bytes]:
        """Open a stream (its answer begun); what reads the rest of it."""
        answer = c.completions.with_streaming_response.create(
            model=MODEL,
            prompt="hello",
            max_tokens=LONG,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        held_open = contextlib.ExitStack()
        begun = held_open.enter_context(answer)

        def rest() -> bytes:
            with held_open:
                return b"".join(begun.iter_bytes())

        return rest

    engine_side = engine.engine_side(tag, pid)
    t0 = time.monotonic()
    deadline = t0 + SIGTERM_S
    timeline: list[str] = []

    def note(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.2f} s  {what}")

    with concurrent.futures.ThreadPoolExecutor(HELD * 4) as pool:
        read: list[concurrent.futures.Future[bytes]] = []
        try:
            while True:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the engine never held {HELD} streams: {timeline}")
                if sum(not r.done() for r in read) < HELD:
                    read.append(pool.submit(stream()))  # one ended: another in its place
                    continue
                if held() < HELD:
                    time.sleep(0.1)
                    continue
                engine.signal_all(engine_side, signal.SIGSTOP)
                # The metrics read before the SIGSTOP may be behind the engine: held
                # still, it reports nothing more, and its API server sends on what it
                # has. Once that is sent, the streams not ended are the engine's.
                note(f"SIGSTOP, {len(read)} streams opened")
                ends = time.monotonic() + ENDED_S
                while time.monotonic() < ends and sum(not r.done() for r in read) >= HELD - 1:
                    time.sleep(0.1)
                if sum(not r.done() for r in read) >= HELD - 1:
                    note(f"held: {held():g} by its metrics")
                    break
                engine.signal_all(engine_side, signal.SIGCONT)  # it held fewer: again
                note("SIGCONT: it held fewer")
            _on_bus(
                served.url,
                lambda js: Publisher(js).publish(
                    drain_cmd("r-1", model=MODEL, grace_s=180.0), node=NODE
                ),
            )
            while not signalled():
                if time.monotonic() > deadline:
                    said = ra.text(served.agent.log)[-3000:]
                    raise AssertionError(
                        f"no SIGTERM at the server in {SIGTERM_S:g}s; agent:\n{said}"
                    )
                time.sleep(0.2)
            note("the SIGTERM in the server's log")
        finally:
            engine.signal_all(engine_side, signal.SIGCONT)
            note("SIGCONT")
        answers = [r.result() for r in read]
    for raw in answers:
        chunks = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith(b"data: {")]
        ends = [
            ch["choices"][0]["finish_reason"]
            for ch in chunks
            if ch["choices"] and ch["choices"][0]["finish_reason"]
        ]
        assert ends == ["length"], ends
        assert chunks[-1]["usage"]["completion_tokens"] == LONG

    def over(es: list[ev.Event]) -> list[str] | None:
        got = _states(es, "r-1")
        return got if {"stopped", "failed"} & set(got) else None

    states = _on_bus(served.url, lambda js: _until(js, "stopped", over, 120))
    assert states[-2:] == ["draining", "stopped"], states
    log = ra.text(served.server["log"])
    drained = re.search(r"draining in-flight requests count=(\d+)", log)
    said = ra.text(served.agent.log)[-2000:]
    assert drained and int(drained[1]) >= HELD - 1, (timeline, log[-3000:], said)
    print(f"\nvLLM drained {drained[1]} streams held across its SIGTERM")
    assert not procs.alive(pid)
    assert procs.members(tag, None) == set()
    assert process._free("127.0.0.1", port)


@pytest.mark.timeout(engine.READY_S + 120)
def test_kill_9_of_the_server_fails_the_replica_with_the_engines_log(
    agent: tuple[str, ra.RealAgent, Path],
) -> None:
    served = _start(*agent, "r-2")
    pid, port = served.server["pid"], served.server["port"]
    tag = served.server["tag"]
    assert len(procs.members(tag, pid)) >= 2  # the API server and its engine core
    os.kill(pid, signal.SIGKILL)

    def failed(es: list[ev.Event]) -> str | None:
        for e in es:
            if (
                isinstance(e, ev.ReplicaStateEvent)
                and e.data.replica == "r-2"
                and e.data.state == "failed"
            ):
                return e.data.reason or ""
        return None

    reason = _on_bus(served.url, lambda js: _until(js, "failed", failed, 60))
    assert reason.startswith("server exited with signal 9: "), reason
    # What it carries is the server's log: its last lines, as the log has them.
    lines = set(ra.text(served.server["log"]).splitlines())
    tail = reason.removeprefix("server exited with signal 9: ").split(" | ")
    assert tail and all(t in lines for t in tail[-3:]), (reason, sorted(lines)[-10:])
    # Its engine process, which outlives a SIGKILLed API server, is gone; so is its port.
    # Looked for by its group too: the engine core's title hides its tag from /proc.
    assert procs.members(tag, None, group=pid) == set()
    # Nothing listens on it (connections in TIME_WAIT may be left, as after any server).
    assert process._free("127.0.0.1", port)
