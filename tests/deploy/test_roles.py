"""Each role of deploy/nats/permissions.conf runs its whole documented command list
against a real nats-server with the shipped configs, beside a running plane (`llmgw up
--nats` as `control`) and an agent (`llmgw agent` as `gpu-a1`): every command exits 0,
and the server refused nobody anything but what the README says (a viewer may not delete
the consumers of its reads; they expire on their own).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from services.agent import consumers as agent_consumers
from services.agent.agent import inbox_prefix
from services.bus.stream import node_stream_name
from tests.deploy.natsconf import (
    CONTROL_PASSWORD,
    ROOT,
    VIEWER_PASSWORD,
    Rendered,
    agent_password,
    free_port,
    render_single,
    server,
    stop,
    wait_for,
)
from tests.up_process import FAST, UpProcess

pytestmark = pytest.mark.timeout(90)

NODE = "gpu-a1"
CLUSTER = (
    "models:\n  - {name: chat, class: opportunistic, min: 1, profiles: [{name: tp1, gpus: 1}]}\n"
)

# What a viewer's reads may be refused: deleting the consumer a read made.
EXPECTED = re.compile(
    r'"\$G/user:viewer" - Publish Violation - '
    r'Subject "\$JS\.API\.CONSUMER\.DELETE\.(LLMGW|OBJ_LLMGW_SNAPSHOTS)\.[A-Za-z0-9_]+"$'
)


@dataclass
class Deployed:
    rendered: Rendered
    base: Path
    up: UpProcess
    agent: subprocess.Popen[bytes]
    agent_log: Path
    server_log: Path

    def env(self, user: str) -> dict[str, str]:
        password = {"control": CONTROL_PASSWORD, "viewer": VIEWER_PASSWORD}[user]
        env = {k: v for k, v in os.environ.items() if k != "LLMGW_NATS"}
        env["LLMGW_NATS"] = self.rendered.url(user, password)
        env["LLMGW_DATA"] = str(self.base / f"cli-{user}")
        return env

    def llmgw(self, user: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli", *args],
            capture_output=True,
            text=True,
            env=self.env(user),
            cwd=ROOT,
            timeout=30,
        )


async def _consumers_made(url: str) -> None:
    """The plane answers an agent's hello (and has made its consumers): asked as the
    agent, whose inbox is the only place the plane answers it."""
    nc = await nats.connect(url, inbox_prefix=inbox_prefix(NODE))
    try:
        async with asyncio.timeout(20):
            while True:
                try:
                    reply = await nc.request(agent_consumers.hello_subject(NODE), b"", timeout=5)
                    # Under the shipped roles the log takes the node's reports through
                    # the node's own stream, which the answer names.
                    assert json.loads(reply.data) == {
                        "ok": True,
                        "stream": node_stream_name(NODE),
                    }
                    return
                except nats.errors.NoRespondersError:
                    await asyncio.sleep(0.05)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    base = tmp_path_factory.mktemp("roles")
    r = render_single(base / "nats", [NODE])
    server_log = base / "nats-server.log"
    with server(r, server_log):
        control = r.url("control", CONTROL_PASSWORD)
        up = UpProcess(base / "data", base / "up.log", "--nats", control, *FAST)
        agent_log = base / "agent.log"
        agent = None
        try:
            asyncio.run(_consumers_made(r.url(NODE, agent_password(NODE))))
            with open(agent_log, "wb") as out:
                agent = subprocess.Popen(
                    [
                        *(sys.executable, "-m", "services.cli", "agent", "--simulate"),
                        *("--nats", r.url(NODE, agent_password(NODE)), "--node", NODE),
                        *("--gpus", "8xH100-80GB", *FAST),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    start_new_session=True,
                )
            wait_for("the agent up", lambda: "up: 8 GPUs" in agent_log.read_text())
            d = Deployed(r, base, up, agent, agent_log, server_log)
            spec = base / "cluster.yaml"
            spec.write_text(CLUSTER)
            applied = d.llmgw("control", "apply", "-f", str(spec))
            assert applied.returncode == 0, applied.stderr
            yield d
        finally:
            if agent is not None:
                stop(agent, signal.SIGINT)
            up.stop()


def _ok(p: subprocess.CompletedProcess[str], what: str) -> str:
    assert p.returncode == 0, f"{what}: exit {p.returncode}\n{p.stderr}"
    assert "violation" not in p.stderr.lower(), f"{what}:\n{p.stderr}"
    return p.stdout


def _ready(d: Deployed) -> None:
    def ready() -> bool:
        s = json.loads(_ok(d.llmgw("control", "status", "--json"), "status"))
        return any(m["model"] == "chat" and m["states"] == {"ready": 1} for m in s["models"])

    wait_for("chat ready", ready, within=30, every=0.2)


def _follow(d: Deployed, user: str, *args: str) -> str:
    """A command that runs until Ctrl-C: its first line of output, then Ctrl-C."""
    p = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=d.env(user),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
    finally:
        stop(p, signal.SIGINT)
    _, err = p.communicate()
    assert line, f"{args}: no output\n{err}"
    assert "violation" not in err.lower() and "Traceback" not in err, err
    return line


def test_the_viewer_runs_its_commands(deployed: Deployed) -> None:
    d = deployed
    _ready(d)
    out = d.base / "viewer"
    out.mkdir()
    s = json.loads(_ok(d.llmgw("viewer", "status", "--json"), "status"))
    assert [n["node"] for n in s["nodes"]] == [NODE]
    assert "chat" in _ok(d.llmgw("viewer", "view"), "view")
    assert "chat" in _ok(d.llmgw("viewer", "explain", "model", "chat"), "explain")
    assert "chat" in _ok(d.llmgw("viewer", "history", "model", "chat"), "history")
    _ok(d.llmgw("viewer", "events", "export", "--out", str(out / "log.jsonl")), "export")
    assert (out / "log.jsonl").read_text().count("\n") > 3
    _ok(d.llmgw("viewer", "replay", "--db", str(out / "view.sqlite")), "replay")
    _ok(d.llmgw("viewer", "snapshot", "--list"), "snapshot --list")
    assert "policy.configured" in _follow(d, "viewer", "events", "tail", "--since", "1")
    # The dashboard, standalone, as the viewer.
    port = free_port()
    dash = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "dashboard", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=d.env("viewer"),
        cwd=ROOT,
        start_new_session=True,
    )
    try:

        def view() -> dict[str, object]:
            assert dash.poll() is None, dash.communicate()[1].decode()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/view", timeout=5) as r:
                return json.loads(r.read())  # type: ignore[no-any-return]

        assert wait_for("the dashboard's view", view, within=30, every=0.1)
    finally:
        stop(dash, signal.SIGINT)
    err = dash.communicate()[1].decode()
    assert "violation" not in err.lower() and "Traceback" not in err, err


def test_the_operator_runs_its_commands(deployed: Deployed) -> None:
    d = deployed
    _ready(d)
    _ok(d.llmgw("control", "scale", "chat", "1"), "scale")
    _ok(d.llmgw("control", "cordon", NODE), "cordon")
    _ok(d.llmgw("control", "uncordon", NODE), "uncordon")
    said = _ok(d.llmgw("control", "gpu", "reset-health", NODE, "0"), "gpu reset-health")
    assert "was healthy" in said
    _ok(d.llmgw("control", "snapshot"), "snapshot")
    _ok(d.llmgw("control", "explain", "node", NODE), "explain node")


def test_nobody_was_refused_what_their_role_allows(deployed: Deployed) -> None:
    """Run last in this module: what the server refused along the way."""
    d = deployed
    assert d.agent.poll() is None, d.agent_log.read_text()
    assert d.up.alive(), d.up.text()[-3000:]
    for log in (d.server_log, d.agent_log, d.up.log):
        lines = log.read_text().splitlines()
        refused = [x for x in lines if "violation" in x.lower() and not EXPECTED.search(x)]
        assert refused == [], f"{log.name}:\n" + "\n".join(refused)
