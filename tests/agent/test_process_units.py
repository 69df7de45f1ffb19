"""The process runtime on its own, no broker: the engines' exact command lines, the stop
that waits for NVML to let go of a replica's GPUs, and the re-adoption refusals. Servers
are the fake model server as real processes; NVML is the fake `pynvml`
(tests/agent/fakenvml). After every test no process of its node is left.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from schemas import events as ev
from services import pids
from services.agent import gpus, process, procs, spec
from services.agent.process import ProcessRuntime
from tests.agent import realagent as ra
from tests.agent.test_process_runtime import _ports

pytestmark = pytest.mark.timeout(60)

_nodes = itertools.count(1)


class Reports:
    """A `Report` that keeps what it was told: [(state, reason)]."""

    def __init__(self) -> None:
        self.got: list[tuple[str, str | None]] = []

    async def __call__(self, state: ev.ReplicaStateName, reason: str | None = None) -> None:
        self.got.append((state, reason))

    def states(self) -> list[str]:
        return [s for s, _ in self.got]


@pytest.fixture
def node() -> Iterator[str]:
    """This test's node; whatever of its servers is left at the end fails the test."""
    name = f"unit-{next(_nodes)}-{time.monotonic_ns() % 10**6}"
    yield name
    left = ra.sweep(name)
    assert not left, f"processes left behind: {left}"


def _runtime(node: str, data: Path, ports: str, **kw: object) -> ProcessRuntime:
    low, high = (int(p) for p in ports.split("-"))
    return ProcessRuntime(
        node=node,
        data=data,
        gpus=spec.gpu_inventory(node, spec.parse_gpus("2xH100-80GB")),
        ports=range(low, high + 1),
        watch_s=0.1,
        **kw,  # type: ignore[arg-type]
    )


def _known(
    replica: str, node: str, gpu_list: tuple[int, ...], state: str
) -> dict[str, ev.ReplicaState]:
    return {
        replica: ev.ReplicaState(
            replica=replica,
            model="chat",
            profile="tp1",
            state=state,  # type: ignore[arg-type]
            shards=(ev.ShardSpec(node=node, gpus=gpu_list),),
        )
    }


async def _started(rt: ProcessRuntime, node: str, replica: str, *switches: str) -> Reports:
    rep = Reports()
    await rt.start(
        replica,
        model="chat",
        profile="tp1",
        shards=(ev.ShardSpec(node=node, gpus=(0,)),),
        report=rep,
        runtime=ra.fake_runtime(*switches),
    )
    assert rep.states() == ["starting", "loading", "ready"], rep.got
    return rep


# ---------------------------------------------------------------------- command lines


@pytest.mark.parametrize(
    ("engine", "want"),
    [
        pytest.param(
            "vllm",
            [
                "vllm",
                "serve",
                "org/llama-8b",
                "--host",
                "10.0.0.5",
                "--port",
                "20007",
                "--tensor-parallel-size",
                "2",
            ],
            id="vllm",
        ),
        pytest.param(
            "sglang",
            [
                "python3",
                "-m",
                "sglang.launch_server",
                "--model-path",
                "org/llama-8b",
                "--host",
                "10.0.0.5",
                "--port",
                "20007",
                "--tp",
                "2",
            ],
            id="sglang",
        ),
    ],
)
def test_engine_command_lines(engine: str, want: list[str], tmp_path: Path) -> None:
    rt = ProcessRuntime(
        node="argv", data=tmp_path, gpus=spec.gpu_inventory("argv", spec.parse_gpus("2xH100-80GB"))
    )
    values = {
        "port": "20007",
        "host": "10.0.0.5",
        "model": "org/llama-8b",
        "replica": "r-1",
        "gpus": "2",
        "tp": "2",
    }
    bare = ev.ModelRuntime(engine=engine)  # type: ignore[arg-type]
    assert rt._argv(bare, "org/llama-8b", values) == want
    args = ("--served-model-name", "{model}", "--max-model-len", "8192", "--tag={replica}/{gpus}")
    with_args = ev.ModelRuntime(engine=engine, args=args)  # type: ignore[arg-type]
    assert rt._argv(with_args, "org/llama-8b", values) == [
        *want,
        "--served-model-name",
        "org/llama-8b",
        "--max-model-len",
        "8192",
        "--tag=r-1/2",
    ]


def test_command_engine_fills_placeholders(tmp_path: Path) -> None:
    rt = ProcessRuntime(
        node="argv", data=tmp_path, gpus=spec.gpu_inventory("argv", spec.parse_gpus("1xL4-24GB"))
    )
    cmd = ev.ModelRuntime(
        engine="command", command=("srv", "--port", "{port}", "{host}:{tp}"), args=("--x={model}",)
    )
    values = {"port": "1", "host": "h", "model": "m", "replica": "r", "gpus": "1", "tp": "1"}
    assert rt._argv(cmd, "m", values) == ["srv", "--port", "1", "h:1", "--x=m"]


# ---------------------------------------------------------------------- stop and NVML


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[dict], gpus.Nvml]:
    """`nvml(pids)` writes the fake NVML's GPUs (2 H100) with `pids` on them, and returns
    NVML over it; call it again to change what the GPUs hold."""
    conf = tmp_path / "nvml.json"
    monkeypatch.setenv("FAKE_NVML", str(conf))
    monkeypatch.syspath_prepend(ra.FAKE_NVML_DIR)
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    importlib.invalidate_caches()

    def write(pids: dict) -> gpus.Nvml:
        gpu = {"name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}
        doc = {"gpus": [{**gpu, "uuid": f"GPU-{i}"} for i in range(2)], "pids": pids}
        conf.write_text(json.dumps(doc))
        mod = gpus.load_nvml()
        assert mod is not None
        return gpus.Nvml(mod)

    return write


async def test_stop_waits_until_nvml_no_longer_shows_the_servers_processes(
    node: str, tmp_path: Path, fake_nvml: Callable[[dict], gpus.Nvml]
) -> None:
    nvml = fake_nvml({})
    rt = _runtime(node, tmp_path, _ports(2), nvml=nvml)
    await _started(rt, node, "r-1")
    pid = json.loads((tmp_path / "state.json").read_text())[0]["pid"]
    # The driver still holds the server's memory after it is gone, for a while.
    fake_nvml({"0": [pid]})
    rep = Reports()
    # NVML's answers while the server is gone and the GPU still shows it.
    asked_after_exit: list[set[int]] = []
    pids_of = nvml.pids

    def pids(index: int) -> set[int]:
        got = pids_of(index)
        if not procs.alive(pid):
            asked_after_exit.append(got)
        return got

    nvml.pids = pids  # type: ignore[method-assign]

    async def free_once_asked() -> None:
        # The GPU is freed only once the agent has asked about it with the server gone:
        # until then it must not report stopped.
        while not any(pid in got for got in asked_after_exit):
            assert not rep.states() or rep.states() == ["draining"], rep.got
            await asyncio.sleep(0.01)
        fake_nvml({})

    freed = asyncio.create_task(free_once_asked())
    await rt.stop("r-1", grace_s=0.2, report=rep)
    await asyncio.wait_for(freed, 5)
    assert rep.states() == ["draining", "stopped"], rep.got
    assert any(pid in got for got in asked_after_exit)
    assert not procs.alive(pid)


async def test_stop_fails_naming_pids_and_gpus_nvml_keeps_showing(
    node: str,
    tmp_path: Path,
    fake_nvml: Callable[[dict], gpus.Nvml],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process, "KILL_WAIT_S", 1.0)
    nvml = fake_nvml({})
    rt = _runtime(node, tmp_path, _ports(2), nvml=nvml)
    await _started(rt, node, "r-1", "--ignore-term")
    pid = json.loads((tmp_path / "state.json").read_text())[0]["pid"]
    fake_nvml({"0": [pid, 1]})  # pid 1 is not the server's: never named
    rep = Reports()
    t0 = time.monotonic()
    await rt.stop("r-1", grace_s=0.2, report=rep)
    took = time.monotonic() - t0
    assert rep.states() == ["draining", "failed"], rep.got
    reason = rep.got[-1][1] or ""
    assert f"GPU 0: pids [{pid}]" in reason and "NVML" in reason, reason
    assert took < 0.2 + 2 * 1.0 + 1.0, took
    assert not procs.alive(pid)
    assert json.loads((tmp_path / "state.json").read_text()) == []


# ---------------------------------------------------------------------- re-adoption


@pytest.fixture
async def left_running(node: str, tmp_path: Path) -> AsyncIterator[tuple[ProcessRuntime, dict]]:
    """A ready server r-1 on GPU 0 that an agent left behind: (a new runtime over the same
    data, the state file's entry)."""
    ports = _ports(3)
    first = _runtime(node, tmp_path, ports)
    await _started(first, node, "r-1")
    srv = first._servers["r-1"]
    if srv.watch is not None:  # the agent is gone: nothing watches it any more
        srv.watch.cancel()
    (entry,) = json.loads((tmp_path / "state.json").read_text())
    assert procs.alive(entry["pid"], entry["started"])
    yield _runtime(node, tmp_path, ports), entry
    if srv.popen is not None and srv.popen.poll() is None:
        srv.popen.kill()
    if srv.popen is not None:
        srv.popen.wait(5)


def _stranger() -> subprocess.Popen[bytes]:
    """A process that is no server of anyone's."""
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )


def _edit_state(data: Path, **change: object) -> None:
    f = data / "state.json"
    (entry,) = json.loads(f.read_text())
    f.write_text(json.dumps([{**entry, **change}]))


async def _not_adopted(rt: ProcessRuntime, entry: dict) -> None:
    assert "r-1" not in rt.running()
    assert json.loads(rt.state_file.read_text()) == []
    await ra.gone({entry["pid"]})
    assert ra.leftovers(rt.node) == {}


async def test_adopts_a_server_that_matches(
    node: str, left_running: tuple[ProcessRuntime, dict]
) -> None:
    rt, entry = left_running
    await rt.adopt(_known("r-1", node, (0,), "ready"))
    assert rt.running() == {"r-1": "ready"}
    rep = Reports()
    await rt.stop("r-1", grace_s=0.5, report=rep)
    assert rep.states() == ["draining", "stopped"]
    await ra.gone({entry["pid"]})


async def test_not_adopted_when_the_log_says_it_is_stopped(
    node: str, left_running: tuple[ProcessRuntime, dict]
) -> None:
    rt, entry = left_running
    await rt.adopt({})  # a stopped replica holds no GPUs: the agent does not pass it on
    await _not_adopted(rt, entry)


async def test_not_adopted_when_its_pid_was_reused(
    node: str, tmp_path: Path, left_running: tuple[ProcessRuntime, dict]
) -> None:
    rt, entry = left_running
    _edit_state(tmp_path, started=entry["started"] + 1)  # same pid, another start time
    await rt.adopt(_known("r-1", node, (0,), "ready"))
    await _not_adopted(rt, entry)


async def test_not_adopted_when_its_gpus_differ(
    node: str, left_running: tuple[ProcessRuntime, dict]
) -> None:
    rt, entry = left_running
    await rt.adopt(_known("r-1", node, (1,), "ready"))
    await _not_adopted(rt, entry)


def _closed_port(rt: ProcessRuntime, entry: dict) -> int:  # type: ignore[type-arg]
    """A port of the agent's range that the left server does not listen on."""
    low = rt.ports.start
    return next(p for p in range(low, low + 3) if p != entry["port"])


async def test_not_adopted_when_its_port_is_closed(
    node: str, tmp_path: Path, left_running: tuple[ProcessRuntime, dict]
) -> None:
    rt, entry = left_running
    closed = _closed_port(rt, entry)
    _edit_state(tmp_path, port=closed)
    await rt.adopt(_known("r-1", node, (0,), "ready"))
    await _not_adopted(rt, entry)


@pytest.mark.parametrize("state", ["starting", "loading"])
async def test_a_loading_server_is_adopted_without_its_port_only_if_it_is_the_same_process(
    node: str, tmp_path: Path, left_running: tuple[ProcessRuntime, dict], state: str
) -> None:
    rt, entry = left_running
    closed = _closed_port(rt, entry)
    # Its port is not open yet (still loading): that alone does not refuse it...
    _edit_state(tmp_path, port=closed, started=entry["started"] + 1)
    # ...but another process under its pid does.
    await rt.adopt(_known("r-1", node, (0,), state))
    await _not_adopted(rt, entry)


async def test_a_loading_server_that_is_the_same_process_is_adopted(
    node: str, tmp_path: Path, left_running: tuple[ProcessRuntime, dict]
) -> None:
    rt, entry = left_running
    closed = _closed_port(rt, entry)
    _edit_state(tmp_path, port=closed)
    await rt.adopt(_known("r-1", node, (0,), "loading"))
    assert rt.running() == {"r-1": "loading"}
    rep = Reports()
    await rt.stop("r-1", grace_s=0.2, report=rep)
    assert rep.states() == ["draining", "stopped"]
    await ra.gone({entry["pid"]})


async def test_a_pid_and_start_time_from_another_boot_is_not_adopted(
    node: str, tmp_path: Path, left_running: tuple[ProcessRuntime, dict]
) -> None:
    # A state file from before a reboot can name a pid and start time that another
    # process has now (a boot starts the same processes in the same order): the entry's
    # boot must be this one, and that process is not signalled.
    rt, entry = left_running
    assert entry["boot"] == procs.boot_id() != ""
    stranger = _stranger()
    try:
        started = pids.start_time(stranger.pid)
        _edit_state(tmp_path, pid=stranger.pid, started=started, boot="an-earlier-boot")
        await rt.adopt(_known("r-1", node, (0,), "loading"))
        assert "r-1" not in rt.running()
        assert json.loads(rt.state_file.read_text()) == []
        await ra.gone({entry["pid"]})  # the real server, found by its tag, is stopped
        assert stranger.poll() is None  # not a server: left alone
    finally:
        stranger.kill()
        stranger.wait(5)


async def test_an_older_state_file_without_a_boot_still_adopts(
    node: str, tmp_path: Path, left_running: tuple[ProcessRuntime, dict]
) -> None:
    rt, entry = left_running
    f = tmp_path / "state.json"
    (e,) = json.loads(f.read_text())
    del e["boot"]
    f.write_text(json.dumps([e]))
    await rt.adopt(_known("r-1", node, (0,), "ready"))
    assert rt.running() == {"r-1": "ready"}
    rep = Reports()
    await rt.stop("r-1", grace_s=0.2, report=rep)
    assert rep.states() == ["draining", "stopped"]
    await ra.gone({entry["pid"]})


def _bin(d: Path, name: str, exit_code: int) -> None:
    d.mkdir(exist_ok=True)
    f = d / name
    f.write_text(f"#!/bin/sh\nexit {exit_code}\n")
    f.chmod(0o755)


async def test_engines_are_looked_for_on_the_servers_path(tmp_path: Path) -> None:
    rt = ProcessRuntime(
        node="eng", data=tmp_path, gpus=spec.gpu_inventory("eng", spec.parse_gpus("1xL4-24GB"))
    )
    empty, without, with_ = tmp_path / "empty", tmp_path / "without", tmp_path / "with"
    empty.mkdir()
    _bin(without, "python3", 1)  # a python3 that cannot import sglang
    _bin(with_, "python3", 0)
    _bin(with_, "vllm", 0)

    def on(engine: str, d: Path) -> ev.ModelRuntime:
        return ev.ModelRuntime(engine=engine, env={"PATH": str(d)})  # type: ignore[arg-type]

    assert await rt._engine_missing(on("sglang", empty)) == (
        "engine sglang is not installed on this host (no python3 on PATH)"
    )
    assert await rt._engine_missing(on("sglang", without)) == (
        f"engine sglang is not installed on this host (no sglang module in {without}/python3)"
    )
    assert await rt._engine_missing(on("sglang", with_)) is None
    assert await rt._engine_missing(on("vllm", empty)) == (
        "engine vllm is not installed on this host (no `vllm` on PATH)"
    )
    assert await rt._engine_missing(on("vllm", with_)) is None


# ---------------------------------------------------------------------- a killed server


async def test_a_killed_servers_untagged_group_members_are_killed_with_it(
    node: str, tmp_path: Path
) -> None:
    """vLLM's engine core renames itself (its process title is written over the memory
    /proc shows its environment from, tag included) and outlives a SIGKILLed API server.
    Here a member of the server's group without the tag stands for it: once the server
    is killed, the replica fails and that member is killed too, found by the group."""
    rt = _runtime(node, tmp_path, _ports(2))
    runtime = ev.ModelRuntime(
        engine="command",
        command=(
            "sh",
            "-c",
            f"env -u {procs.TAG_ENV} sleep 300 & exec {sys.executable} {ra.FAKE} "
            "--host {host} --port {port}",
        ),
        ready_timeout=30.0,
        metrics="/metrics",
    )
    rep = Reports()
    await rt.start(
        "r1",
        model="chat",
        profile="tp1",
        shards=(ev.ShardSpec(node=node, gpus=(0,)),),
        report=rep,
        runtime=runtime,
    )
    assert rep.states() == ["starting", "loading", "ready"], rep.got
    leader = json.loads((tmp_path / "state.json").read_text())[0]["pid"]
    tagged = set().union(*procs.tagged(f"llmgw/{node}/").values())
    untagged = {p for p in procs.members("-", leader) if p != leader} - tagged
    assert untagged, "the untagged member did not start"
    try:
        os.kill(leader, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while rep.states()[-1] != "failed":
            assert time.monotonic() < deadline, rep.got
            await asyncio.sleep(0.05)
        assert "signal 9" in (rep.got[-1][1] or ""), rep.got
        assert not any(procs.alive(p) for p in untagged), "the group outlived its server"
    finally:
        procs.kill(untagged)


def test_a_failures_log_quote_carries_no_key() -> None:
    """A failed server's reason quotes its log into the event log: a key it was given
    (vLLM prints its non-default arguments at start) or a URL's password never goes."""
    from services.agent.process import _unsecret

    said = _unsecret(
        "non-default args: {'api_key': ['sk-abc123']} | cmd --api-key sk-XYZ | "
        "token=t0k | nats://u:hunter2@h:4222 | tokens_in 8, prompt token ids"
    )
    for secret in ("sk-abc123", "sk-XYZ", "t0k", "hunter2"):
        assert secret not in said, said
    assert "tokens_in 8, prompt token ids" in said
