"""The whole cluster under the shipped deploy/nats permissions, every part as its own
process and user: `llmgw up --nats` (projector, scheduler, preemption service) and the
operator's CLI as `control`, two `llmgw agent` processes as `gpu-a1` and `gpu-a2`, and
`llmgw events export` as `viewer`. The tour's cluster fills, `llmgw scale chat 2` makes
room by preemption, and the server refused nobody anything along the way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.natsconf import (
    CONTROL_PASSWORD,
    ROOT,
    VIEWER_PASSWORD,
    agent_password,
    render_single,
    server,
    stop,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)

NODES = ["gpu-a1", "gpu-a2"]
TOUR = ROOT / "deploy" / "examples" / "tour.yaml"


def _llmgw(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=30,
        start_new_session=True,
    )


class Procs:
    """Long-running `llmgw` processes, each with its log; all stopped at the end."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs, self.env = logs, env
        self.procs: list[tuple[subprocess.Popen[Any], Path]] = []

    def start(self, name: str, *args: str) -> Path:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            p = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=ROOT,
                start_new_session=True,
            )
        self.procs.append((p, log))
        return log

    def check_alive(self) -> None:
        for p, log in self.procs:
            assert p.poll() is None, f"{log.name} exited {p.returncode}:\n{log.read_text()}"

    def stop_all(self) -> None:
        for p, _ in reversed(self.procs):
            stop(p, signal.SIGINT)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLMGW_NATS", "LLMGW_DATA")}
    env["LLMGW_DATA"] = str(tmp_path / "data")
    p = Procs(tmp_path, env)
    try:
        yield p
    finally:
        p.stop_all()


def test_cluster_converges_and_preempts_under_the_shipped_permissions(
    tmp_path: Path, procs: Procs
) -> None:
    r = render_single(tmp_path / "nats", NODES)
    server_log = tmp_path / "nats-server.log"
    with server(r, server_log):
        control = r.url("control", CONTROL_PASSWORD)
        up_log = procs.start(
            "up", "up", "--nats", control, "--min-lifetime", "0", "--hold", "20", "--tick", "0.2"
        )
        wait_for(
            "llmgw up to run its services",
            lambda: procs.check_alive() or "preemption service" in up_log.read_text(),
        )
        for node in NODES:
            procs.start(
                node,
                "agent",
                "--nats",
                r.url(node, agent_password(node)),
                "--simulate",
                "--node",
                node,
                "--gpus",
                "8xH100-80GB",
                "--start-delay",
                "0.05",
                "--load-delay",
                "0.2",
                "--stop-delay",
                "0.05",
            )
        op = {**procs.env, "LLMGW_NATS": control}
        applied = _llmgw(op, "apply", "-f", str(TOUR))
        assert applied.returncode == 0, applied.stderr

        def status() -> dict[str, Any]:
            procs.check_alive()
            out = _llmgw(op, "status", "--json")
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)  # type: ignore[no-any-return]

        def model(s: dict[str, Any], name: str) -> dict[str, Any]:
            return next((m for m in s["models"] if m["model"] == name), {"states": {}})

        full = wait_for(
            "the tour's cluster full: chat 1 and batch 6 ready on gpu-a1 and gpu-a2",
            lambda: (
                (s := status())
                and model(s, "chat")["states"] == {"ready": 1}
                and model(s, "batch")["states"] == {"ready": 6}
                and s
            ),
            within=40,
            every=0.2,
        )
        assert sorted(n["node"] for n in full["nodes"]) == NODES
        assert full["gpus"] == {"total": 16, "used": 16, "lost": 0}

        scaled = _llmgw(op, "scale", "chat", "2")
        assert scaled.returncode == 0, scaled.stderr
        done = wait_for(
            "chat at 2 ready after a preemption",
            lambda: (
                (s := status())
                and model(s, "chat")["states"] == {"ready": 2}
                and any(
                    d["type"] == "preemption.decided" and d["outcome"] == "preempted"
                    for d in s["decisions"]
                )
                and s
            ),
            within=40,
            every=0.2,
        )
        # The room came from two batch replicas (2 GPUs each) the preemption stopped.
        assert model(done, "batch")["states"] == {"ready": 4}
        assert done["gpus"] == {"total": 16, "used": 16, "lost": 0}

        # A viewer reads the whole log, the agents' reports and the decisions among it.
        viewer = {**procs.env, "LLMGW_NATS": r.url("viewer", VIEWER_PASSWORD)}
        bundle = tmp_path / "log.jsonl"
        exported = _llmgw(viewer, "events", "export", "--out", str(bundle))
        assert exported.returncode == 0, exported.stderr
        assert "violation" not in exported.stderr.lower(), exported.stderr
        lines = [json.loads(x) for x in bundle.read_text().splitlines()]
        types = {(x["subject"].split(".")[1], x["type"]) for x in lines}
        assert ("node", "replica.state") in types and ("preemption", "preemption.decided") in types
        assert {x["source"] for x in lines if x["type"] == "node.inventory"} == {
            f"agent/{n}" for n in NODES
        }
        procs.check_alive()
        procs.stop_all()  # while the broker is still there: a clean stop, quickly

    # Nobody was refused anything, but for one thing a viewer may not do: delete a
    # consumer. Its readers' consumers (llmgw_<random>) expire on their own instead.
    expected = re.compile(
        r'"\$G/user:viewer" - Publish Violation - '
        r'Subject "\$JS\.API\.CONSUMER\.DELETE\.LLMGW\.llmgw_[0-9a-f]+"$'
    )
    for log in [server_log] + [log for _, log in procs.procs]:
        lines = log.read_text().splitlines()
        refused = [x for x in lines if "violation" in x.lower() and not expected.search(x)]
        assert refused == [], f"{log.name}:\n" + "\n".join(lines)
        assert not any("Traceback" in x for x in lines), f"{log.name}:\n" + "\n".join(lines)
