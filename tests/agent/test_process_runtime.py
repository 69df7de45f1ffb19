"""The process runtime, with a real `llmgw agent --gpus 2xH100-80GB` and the fake model
server as real processes: starting -> loading -> ready once each, failures with their
exit status and log, drains that wait for in-flight requests and then kill every
descendant (setsid ones, ones that ignore SIGTERM), use from metrics, refusals, and kill -9
of the agent mid-start and mid-drain followed by a restart that adopts. After every test
no process of its node is left.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.agent import procs
from services.bus import EmbeddedBroker
from tests.agent import realagent as ra
from tests.agent.helpers import drain_cmd, node_events, start_cmd, wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def run_agent(nats_server: EmbeddedBroker, tmp_path: Path) -> Iterator[list[ra.RealAgent]]:
    """Real agents started by the test; stopped at the end, and no server of theirs left."""
    started: list[ra.RealAgent] = []
    yield started
    for a in started:
        a.stop()
    left = {a.node: ra.sweep(a.node) for a in started}
    assert not any(left.values()), f"processes left behind: {left}"


def _agent(
    started: list[ra.RealAgent], url: str, node: str, data: Path, *extra: str
) -> ra.RealAgent:
    a = ra.RealAgent(url, node, data, *extra, n=len(started))
    started.append(a)
    return a


def _ports(n: int) -> str:
    """A range of `n` ports free now (an ephemeral one's neighbours)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            low = s.getsockname()[1]
        if low + n < 65000 and all(_free(p) for p in range(low, low + n)):
            return f"{low}-{low + n - 1}"


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _post(port: int, timeout: float = 30.0) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=b'{"model": "fake", "messages": [{"role": "user", "content": "hi"}]}',
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status)
    except OSError:
        return -1


def _in_flight(port: int) -> threading.Thread:
    t = threading.Thread(target=_post, args=(port,), daemon=True)
    t.start()
    return t


async def _running(port: int, n: int) -> None:
    def metric() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
        m = re.search(r"vllm:num_requests_running\{[^}]*\} ([0-9.]+)", text)
        return float(m.group(1)) if m else 0.0

    async def probe() -> float:
        return await asyncio.to_thread(metric)

    await wait_for(probe, lambda v: v >= n, 10)


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def _grandchild(log: str) -> int:
    m = re.search(r"setsid grandchild pid (\d+)", Path(log).read_text())
    assert m, Path(log).read_text()
    return int(m.group(1))


async def test_a_server_goes_ready_serves_is_used_and_drains(
    nats_server: EmbeddedBroker, js: JetStreamContext, tmp_path: Path, run_agent: list
) -> None:
    node = "proc-a"
    await ra.publish(
        js, ra.declared("chat", ra.fake_runtime("--load-s", "0.5", "--drain-s", "0.3"))
    )
    _agent(
        run_agent,
        nats_server.url,
        node,
        tmp_path,
        "--ports",
        _ports(4),
        "--used-interval",
        "0.2",
        "--scrape",
        "0.1",
        "--advertise",
        "proc-a.example",
    )
    await ra.publish(js, start_cmd("r-1", node, (1,), model="chat"))
    es = await ra.until_state(js, node, "r-1", "ready")
    assert [e.data.state for e in es] == ["starting", "loading", "ready"]
    srv = ra.servers(tmp_path, node)["r-1"]
    # Ready says where the server answers: the advertised name, the port it was given.
    assert [e.data.endpoint for e in es] == [None, None, f"http://proc-a.example:{srv['port']}"]
    # Pinned to its GPU, in a process group of its own, with its log in the data dir.
    assert _env_of(srv["pid"])["CUDA_VISIBLE_DEVICES"] == "1"
    assert os.getpgid(srv["pid"]) == srv["pid"]
    assert Path(srv["log"]).is_relative_to(tmp_path / f"agent-{node}")

    # No use is reported until a request is really served; then it is.
    used = [e for e in await node_events(js, node) if isinstance(e, ev.ReplicaUsedEvent)]
    assert used == []
    assert await asyncio.to_thread(_post, srv["port"]) == 200

    async def uses() -> list[ev.Event]:
        return [e for e in await node_events(js, node) if isinstance(e, ev.ReplicaUsedEvent)]

    await wait_for(uses, lambda u: len(u) == 1, 10)

    drain = drain_cmd("r-1", model="chat", grace_s=5.0)
    await ra.publish(js, drain, node=node)
    await ra.publish(js, drain_cmd("r-1", model="chat", grace_s=5.0), node=node)  # harmless
    es = await ra.until_state(js, node, "r-1", "stopped")
    assert [e.data.state for e in es] == ["starting", "loading", "ready", "draining", "stopped"]
    assert not procs.alive(srv["pid"])
    assert ra.leftovers(node) == {}
    assert ra.servers(tmp_path, node) == {}


async def test_failures_and_refusals_say_why(
    nats_server: EmbeddedBroker, js: JetStreamContext, tmp_path: Path, run_agent: list
) -> None:
    node = "proc-b"
    ports = _ports(2)
    await ra.publish(js, ra.declared("crashy", ra.fake_runtime("--crash-after", "0.3")))
    await ra.publish(
        js,
        ra.declared("stuck", ra.fake_runtime("--never-ready", "--spawn-setsid", ready_timeout=1)),
    )
    await ra.publish(js, ra.declared("bare", None))
    await ra.publish(
        js, ra.declared("nocmd", ev.ModelRuntime(engine="command", command=("/nonexistent/x",)))
    )
    await ra.publish(js, ra.declared("vllm-m", ev.ModelRuntime(engine="vllm")))
    await ra.publish(js, ra.declared("ok", ra.fake_runtime()))
    _agent(run_agent, nats_server.url, node, tmp_path, "--ports", ports)

    await ra.publish(js, start_cmd("crash", node, (0,), model="crashy"))
    es = await ra.until_state(js, node, "crash", "failed")
    reason = es[-1].data.reason or ""
    assert es[-1].data.state == "failed"
    assert "exited with status 3" in reason and "crashing" in reason, reason

    await ra.publish(js, start_cmd("stuck", node, (0,), model="stuck"))
    es = await ra.until_state(js, node, "stuck", "failed")
    assert es[-1].data.state == "failed"
    assert "not ready within 1s" in (es[-1].data.reason or "")
    assert ra.leftovers(node) == {}  # the setsid grandchild too

    for replica, model, says in [
        ("bare", "bare", "model bare declares no runtime"),
        ("nocmd", "nocmd", "command /nonexistent/x is not installed on this host"),
        ("vllm", "vllm-m", "engine vllm is not installed on this host"),
    ]:
        await ra.publish(js, start_cmd(replica, node, (0,), model=model))
        es = await ra.until_state(js, node, replica, "failed")
        assert es[-1].data.state == "failed" and says in (es[-1].data.reason or ""), es

    # Every port of the range taken by someone else: refused, saying so.
    low, high = (int(p) for p in ports.split("-"))
    held = []
    for p in range(low, high + 1):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", p))
        s.listen()
        held.append(s)
    try:
        await ra.publish(js, start_cmd("noport", node, (0,), model="ok"))
        es = await ra.until_state(js, node, "noport", "failed")
        assert f"no free port in {ports}" in (es[-1].data.reason or ""), es
    finally:
        for s in held:
            s.close()

    # GPUs another running server holds.
    await ra.publish(js, start_cmd("held-1", node, (1,), model="ok"))
    await ra.until_state(js, node, "held-1", "ready")
    await ra.publish(js, start_cmd("held-2", node, (1,), model="ok"))
    es = await ra.until_state(js, node, "held-2", "failed")
    assert "GPU 1 held by replica held-1" in (es[-1].data.reason or ""), es
    await ra.publish(js, drain_cmd("held-1", model="ok", grace_s=1.0), node=node)
    await ra.until_state(js, node, "held-1", "stopped")


async def test_drain_waits_for_in_flight_then_kills_what_ignores_sigterm(
    nats_server: EmbeddedBroker, js: JetStreamContext, tmp_path: Path, run_agent: list
) -> None:
    node = "proc-c"
    await ra.publish(
        js,
        ra.declared("deaf", ra.fake_runtime("--ignore-term", "--spawn-setsid", "--request-s", "1")),
    )
    await ra.publish(
        js,
        ra.declared("stuckreq", ra.fake_runtime("--ignore-term", "--request-s", "60")),
    )
    _agent(run_agent, nats_server.url, node, tmp_path, "--ports", _ports(4))
    await ra.publish(js, start_cmd("d-1", node, (0,), model="deaf"))
    await ra.publish(js, start_cmd("d-2", node, (1,), model="stuckreq"))
    await ra.until_state(js, node, "d-1", "ready")
    await ra.until_state(js, node, "d-2", "ready")
    s1, s2 = ra.servers(tmp_path, node)["d-1"], ra.servers(tmp_path, node)["d-2"]
    grandchild = _grandchild(s1["log"])
    assert procs.alive(grandchild)

    # d-1: one request of 1 s in flight, a grace of 10 s: stopped once it is served.
    t = _in_flight(s1["port"])
    await _running(s1["port"], 1)
    await ra.publish(js, drain_cmd("d-1", model="deaf", grace_s=10.0), node=node)
    es = await ra.until_state(js, node, "d-1", "stopped")
    took = (es[-1].time - es[-2].time).total_seconds()
    assert es[-1].data.state == "stopped" and took < 5.0, took
    t.join(5)
    assert not procs.alive(s1["pid"]) and not procs.alive(grandchild)

    # d-2: a request that never ends and SIGTERM ignored: stopped at the grace, + 1 s.
    _in_flight(s2["port"])
    await _running(s2["port"], 1)
    grace = 1.5
    await ra.publish(js, drain_cmd("d-2", model="stuckreq", grace_s=grace), node=node)
    es = await ra.until_state(js, node, "d-2", "stopped")
    took = (es[-1].time - es[-2].time).total_seconds()
    print(f"drain-to-stopped, SIGTERM ignored, grace {grace}s: {took:.2f}s")
    assert es[-1].data.state == "stopped"
    assert grace - 0.1 <= took <= grace + 1.0, took
    assert ra.leftovers(node) == {}


async def test_agent_killed_mid_start_and_mid_drain_adopts_its_servers(
    nats_server: EmbeddedBroker, js: JetStreamContext, tmp_path: Path, run_agent: list
) -> None:
    node = "proc-d"
    ports = _ports(4)
    await ra.publish(
        js,
        ra.declared("slow", ra.fake_runtime("--load-s", "2", "--ignore-term", "--request-s", "60")),
    )
    a1 = _agent(run_agent, nats_server.url, node, tmp_path, "--ports", ports)
    await ra.publish(js, start_cmd("s-1", node, (0,), model="slow"))
    await ra.until_state(js, node, "s-1", "loading")
    srv = ra.servers(tmp_path, node)["s-1"]
    a1.kill9()
    assert procs.alive(srv["pid"], srv["started"])
    # A server nobody can vouch for (tagged as this node's, in no state file) is stopped.
    ghost = ra.ghost(node)

    _agent(run_agent, nats_server.url, node, tmp_path, "--ports", ports)
    es = await ra.until_state(js, node, "s-1", "ready")
    assert [e.data.state for e in es] == ["starting", "loading", "ready"]
    assert ra.servers(tmp_path, node)["s-1"]["pid"] == srv["pid"]  # adopted, not restarted
    assert ra.text(srv["log"]).count("fake server pid") == 1
    assert ghost.wait(5) == -9

    # Mid-drain: a request that never ends, a grace of 3 s, the agent dies inside it.
    _in_flight(srv["port"])
    await _running(srv["port"], 1)
    await ra.publish(js, drain_cmd("s-1", model="slow", grace_s=3.0), node=node)
    await ra.until_state(js, node, "s-1", "draining")
    run_agent[-1].kill9()
    assert procs.alive(srv["pid"], srv["started"])
    _agent(run_agent, nats_server.url, node, tmp_path, "--ports", ports)
    es = await ra.until_state(js, node, "s-1", "stopped")
    assert [e.data.state for e in es] == ["starting", "loading", "ready", "draining", "stopped"]
    await ra.gone({srv["pid"]})
    assert ra.leftovers(node) == {}
