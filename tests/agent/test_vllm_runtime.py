"""vLLM as a replica's server, run by its module from an engine environment of its own
(a runtime with `python`), without vLLM: the command line, the check that the engine is
there, readiness as a completion answered, failures that carry the engine's error, and
the load its metrics say. The server is the fake model server behind a stand-in `vllm`
package (tests/agent/fakevllm), as real processes; tests/engine/ runs the real vLLM.
After every test no process of its node is left.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.agent import process, spec
from services.agent.process import ProcessRuntime
from services.bus import EmbeddedBroker
from tests.agent import realagent as ra
from tests.agent.helpers import drain_cmd, node_events, placement_of, start_cmd, wait_for
from tests.agent.test_process_runtime import _ports
from tests.agent.test_process_units import Reports

pytestmark = pytest.mark.timeout(60)

_nodes = itertools.count(1)

VALUES = {
    "port": "20007",
    "host": "10.0.0.5",
    "model": "tiny",
    "replica": "r-1",
    "gpus": "1",
    "tp": "1",
}

# What vLLM 0.32.0's CPU build says on /metrics after two completions of a 1,199-token
# prompt (the second served 1,152 tokens from its prefix cache) and two short ones.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.03125
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 2415.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7965325646269116e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1152.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 2415.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 1263.0
vllm:prompt_tokens_cached_total{engine="0",model_name="tiny"} 1152.0
vllm:generation_tokens_total{engine="0",model_name="tiny"} 12.0
vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.796532564627105e+09
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 4.0
"""


@pytest.fixture
def node() -> Iterator[str]:
    """This test's node; whatever of its servers is left at the end fails the test."""
    name = f"vllm-{next(_nodes)}-{time.monotonic_ns() % 10**6}"
    yield name
    left = ra.sweep(name)
    assert not left, f"processes left behind: {left}"


def _runtime(node: str, data: Path, **kw: object) -> ProcessRuntime:
    low, high = (int(p) for p in _ports(2).split("-"))
    return ProcessRuntime(
        node=node,
        data=data,
        gpus=spec.gpu_inventory(node, spec.parse_gpus("1xCPU-8GB")),
        ports=range(low, high + 1),
        watch_s=0.1,
        **kw,  # type: ignore[arg-type]
    )


def _shards(node: str) -> tuple[ev.ShardSpec, ...]:
    return (ev.ShardSpec(node=node, gpus=(0,)),)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


# ---------------------------------------------------------------------- the command line


def test_a_runtime_with_python_runs_vllms_server_module(tmp_path: Path) -> None:
    rt = ProcessRuntime(
        node="argv", data=tmp_path, gpus=spec.gpu_inventory("argv", spec.parse_gpus("1xL4-24GB"))
    )
    py = "/opt/engine/bin/python"
    mod = ev.ModelRuntime(engine="vllm", python=py, weights="/models/tiny")
    assert rt._argv(mod, "tiny", VALUES) == [
        py,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/tiny",
        "--served-model-name",
        "tiny",
        "--host",
        "10.0.0.5",
        "--port",
        "20007",
        "--tensor-parallel-size",
        "1",
        "--shutdown-timeout",
        str(process.SHUTDOWN_S),
    ]
    # Without weights the model's name is what is loaded, and served under itself.
    bare = ev.ModelRuntime(engine="vllm", python=py)
    assert rt._argv(bare, "org/llama-8b", VALUES)[3:5] == ["--model", "org/llama-8b"]
    assert "--served-model-name" not in rt._argv(bare, "org/llama-8b", VALUES)
    # The runtime's own --shutdown-timeout is the one given.
    own = ev.ModelRuntime(engine="vllm", python=py, args=("--shutdown-timeout=5",))
    argv = rt._argv(own, "tiny", VALUES)
    assert [a for a in argv if a.startswith("--shutdown-timeout")] == ["--shutdown-timeout=5"]
    # `vllm serve` with weights serves them under the model's name too.
    served = ev.ModelRuntime(engine="vllm", weights="/models/tiny")
    assert rt._argv(served, "tiny", VALUES)[:5] == [
        "vllm",
        "serve",
        "/models/tiny",
        "--served-model-name",
        "tiny",
    ]
    # SGLang takes the interpreter too.
    sg = ev.ModelRuntime(engine="sglang", python=py, weights="/models/tiny")
    assert rt._argv(sg, "tiny", VALUES)[:7] == [
        py,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/tiny",
        "--served-model-name",
        "tiny",
    ]


async def test_the_engine_is_looked_for_in_the_interpreter_given(tmp_path: Path) -> None:
    rt = ProcessRuntime(
        node="eng", data=tmp_path, gpus=spec.gpu_inventory("eng", spec.parse_gpus("1xL4-24GB"))
    )
    nowhere = ev.ModelRuntime(engine="vllm", python=str(tmp_path / "no" / "python"))
    assert await rt._engine_missing(nowhere) == (
        f"engine vllm is not installed on this host (no {tmp_path}/no/python)"
    )
    # This interpreter has no vllm module (llmgw's environment is not the engine's).
    without = ev.ModelRuntime(engine="vllm", python=sys.executable)
    assert await rt._engine_missing(without) == (
        f"engine vllm is not installed on this host (no vllm module in {sys.executable})"
    )
    # The module is looked for as the server would import it: with the runtime's env.
    assert await rt._engine_missing(ra.fake_vllm_runtime()) is None


# ---------------------------------------------------------------------- readiness


async def test_ready_once_a_completion_is_answered(node: str, tmp_path: Path) -> None:
    rt = _runtime(node, tmp_path)
    got = Reports()
    await rt.start(
        "r-1", model="tiny", profile="cpu", shards=_shards(node), report=got,
        runtime=ra.fake_vllm_runtime("--load-s", "0.3"),
    )  # fmt: skip
    assert got.states() == ["starting", "loading", "ready"]
    s = rt._servers["r-1"]
    log = ra.text(s.e.log)
    assert "--model /models/tiny --served-model-name tiny" in log
    # The probe was a completion the server served, not its health alone.
    assert 'vllm:request_success_total{finished_reason="stop"} 1.0' in _metrics(s.e.port)
    await rt.stop("r-1", grace_s=2.0, report=got)
    assert got.states()[-1] == "stopped"


async def test_health_200_and_a_failed_completion_is_failed_with_the_engines_error(
    node: str, tmp_path: Path
) -> None:
    rt = _runtime(node, tmp_path)
    got = Reports()
    why = "Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
    await rt.start(
        "r-1", model="tiny", profile="cpu", shards=_shards(node), report=got,
        runtime=ra.fake_vllm_runtime("--fail-completions", why),
    )  # fmt: skip
    assert got.states() == ["starting", "loading", "failed"]
    reason = got.got[-1][1] or ""
    assert reason.startswith(
        "server answers /health but failed a completion: HTTP 500: EngineCore encountered an "
        "issue. See stack trace (above) for the root cause.: first error: RuntimeError: " + why
    ), reason
    assert rt._servers == {}


async def test_a_server_that_dies_on_its_first_request_is_failed_with_its_log(
    node: str, tmp_path: Path
) -> None:
    rt = _runtime(node, tmp_path)
    got = Reports()
    await rt.start(
        "r-1", model="tiny", profile="cpu", shards=_shards(node), report=got,
        runtime=ra.fake_vllm_runtime("--die-on-request"),
    )  # fmt: skip
    assert got.states() == ["starting", "loading", "failed"]
    reason = got.got[-1][1] or ""
    assert reason.startswith(
        "server exited with status 1 while loading: first error: RuntimeError: the engine "
        "died on its first request"
    ), reason


async def test_a_command_server_is_ready_on_its_health_alone(node: str, tmp_path: Path) -> None:
    """A `command` server need not serve completions (the probe is vllm's and sglang's)."""
    rt = _runtime(node, tmp_path)
    got = Reports()
    await rt.start(
        "r-1", model="tiny", profile="cpu", shards=_shards(node), report=got,
        runtime=ra.fake_runtime("--fail-completions", "never asked"),
    )  # fmt: skip
    assert got.states() == ["starting", "loading", "ready"]
    await rt.stop("r-1", grace_s=2.0, report=got)


# ---------------------------------------------------------------------- metrics


def test_vllms_metric_names_are_read_into_its_load() -> None:
    names = process.METRICS["vllm"]
    values = process.parse_metrics(VLLM_METRICS, names.all())
    at = datetime(2026, 12, 6, tzinfo=UTC)
    assert process.engine_load(values, names, at) == ev.EngineLoad(
        at=at,
        running=1,
        waiting=2,
        kv_cache_usage=0.03125,
        prefix_cache_queries=2415,
        prefix_cache_hits=1152,
        prompt_tokens=2415,
        generation_tokens=12,
    )
    # Served: the sum over its label sets; `_created` and `_by_reason` series are others.
    assert values[names.served] == 4.0
    # An engine that says none of them has no load to say, but a load all the same.
    assert process.engine_load({}, names, at) == ev.EngineLoad(at=at)


def test_an_engines_error_is_read_from_its_answer() -> None:
    e = process.engine_error
    assert e(b'{"error": {"message": "model x\\n not found", "code": 404}}') == "model x not found"
    assert e(b'{"detail": "Not Found"}') == "Not Found"
    assert e(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
    assert e(b"") == "(no body)"


async def test_a_slow_metrics_read_is_waited_for_beside_the_watch(
    node: str, tmp_path: Path
) -> None:
    """A /metrics that takes 3 s (vLLM's under load: 1-6 s) is read, and a server that
    dies meanwhile is failed at once, not after the read."""
    rt = _runtime(node, tmp_path, scrape_s=0.1)
    got = Reports()
    await rt.start(
        "r-1", model="tiny", profile="cpu", shards=_shards(node), report=got,
        runtime=ra.fake_vllm_runtime("--metrics-s", "3", "--waiting", "2"),
    )  # fmt: skip
    assert got.states()[-1] == "ready"
    deadline = time.monotonic() + 15
    while "r-1" not in rt.loads():
        assert time.monotonic() < deadline, "no load read"
        await asyncio.sleep(0.05)
    load = rt.loads()["r-1"]
    assert (load.running, load.waiting, load.prefix_cache_queries) == (0, 2, 7)
    # A read is under way (3 s); the server is killed; the watch sees it within its tick.
    s = rt._servers["r-1"]
    # The next read starts a tick (0.1 s) after the last ended: wait for one under way.
    while s.scraping is None or s.scraping.done():
        assert time.monotonic() < deadline, "no metrics read under way"
        await asyncio.sleep(0.02)
    t0 = time.monotonic()
    os.killpg(s.e.pid, signal.SIGKILL)
    while got.states()[-1] != "failed":
        assert time.monotonic() - t0 < 2.5, "the death waited for the metrics read"
        await asyncio.sleep(0.02)
    assert (got.got[-1][1] or "").startswith("server exited with signal 9")


# ---------------------------------------------------------------------- through the log


@pytest.fixture
def run_agent(nats_server: EmbeddedBroker) -> Iterator[list[ra.RealAgent]]:
    """Real agents started by the test; stopped at the end, and no server of theirs left."""
    started: list[ra.RealAgent] = []
    yield started
    for a in started:
        a.stop()
    left = {a.node: ra.sweep(a.node) for a in started}
    assert not any(left.values()), f"processes left behind: {left}"


def _complete(port: int) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=b'{"model": "tiny", "prompt": "hello", "max_tokens": 1}',
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return int(r.status)


def _llmgw(url: str, *argv: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "--nats", url, *argv],
        cwd=ra.REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


async def test_the_engines_load_reaches_the_log_the_view_and_explain(
    nats_server: EmbeddedBroker, js: JetStreamContext, tmp_path: Path, run_agent: list
) -> None:
    node = f"vllm-load-{time.monotonic_ns() % 10**6}"
    await ra.publish(js, ra.declared("tiny", ra.fake_vllm_runtime("--waiting", "2")))
    agent = ra.RealAgent(
        nats_server.url,
        node,
        tmp_path,
        "--ports",
        _ports(4),
        "--used-interval",
        "0.2",
        "--scrape",
        "0.1",
        gpus="1xCPU-8GB",
    )
    run_agent.append(agent)

    async def inventory() -> list[ev.Event]:
        return [e for e in await node_events(js, node) if isinstance(e, ev.NodeInventoryEvent)]

    await wait_for(inventory, bool, 15)
    start = start_cmd("r-1", node, (0,), model="tiny")
    await ra.publish(js, placement_of(start))
    await ra.publish(js, start)
    es = await ra.until_state(js, node, "r-1", "ready")
    assert es[-1].data.state == "ready", agent.text()
    port = ra.servers(tmp_path, node)["r-1"]["port"]
    for _ in range(2):
        assert await asyncio.to_thread(_complete, port) == 200

    async def loads() -> list[ev.EngineLoad]:
        return [
            e.data.engine
            for e in await node_events(js, node)
            if isinstance(e, ev.ReplicaUsedEvent) and e.data.engine is not None
        ]

    # The probe's completion and the two: 3 x 7 prompt tokens, 3 generated.
    got = await wait_for(loads, lambda ls: bool(ls) and ls[-1].prompt_tokens == 21, 15)
    load = got[-1]
    assert (load.running, load.waiting, load.generation_tokens) == (0, 2, 3)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (21, 10)

    doc = json.loads(
        await asyncio.to_thread(_llmgw, nats_server.url, "explain", "replica", "r-1", "--json")
    )
    said = doc["engine"]
    assert (said["prompt_tokens"], said["waiting"], said["prefix_cache_hit_rate"]) == (
        21,
        2,
        round(10 / 21, 4),
    )
    text = await asyncio.to_thread(_llmgw, nats_server.url, "explain", "replica", "r-1")
    assert "its engine said, read " in text
    assert (
        "0 running, 2 waiting; KV cache 0% used; prefix cache hits 10 of 21 prompt tokens" in text
    )
    await ra.publish(js, drain_cmd("r-1", model="tiny", grace_s=5.0), node=node)
    assert (await ra.until_state(js, node, "r-1", "stopped"))[-1].data.state == "stopped"
