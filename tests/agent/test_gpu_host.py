"""The README's "Running on GPU hosts" tour with real processes: `llmgw up`, and a real
`llmgw agent` whose NVML is the fake `pynvml` (tests/agent/fakenvml). The GPUs come from
NVML, a model with a runtime is scaled up and its server pinned to its GPU by uuid,
served requests become `replica.used`, a critical XID takes the GPU out (the replica on it
fails, the scheduler places the next one on the other GPU; an application XID changes
nothing), `llmgw gpu reset-health` brings it back, and scaling to 0 stops every server.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas import events as ev
from services.bus import Publisher, connect
from services.clock import new_id
from services.core.view import View
from services.plane.follower import ViewFollower
from tests.agent import realagent as ra
from tests.agent.test_process_runtime import _ports, _post
from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(90)

NODE = "gpu-t1"
UUIDS = ("GPU-11111111-2222-3333-4444-000000000000", "GPU-11111111-2222-3333-4444-000000000001")


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[tuple[str, ViewFollower, Publisher]]:
    """`llmgw up` as a process (the control plane, no simulated agents): its broker's URL,
    a follower of its log and a publisher."""
    up = UpProcess(
        tmp_path / "up",
        tmp_path / "up.log",
        "--no-ui", "--tick", "0.2", "--node-timeout", "30",
        "--drain-grace", "2",
    )  # fmt: skip
    try:
        url = await asyncio.to_thread(up.wait_url)
        nc = await connect(url, "gpu-tour")
        js = nc.jetstream()
        follower = ViewFollower(js, consumer="gpu-tour")
        follower.start()
        try:
            yield url, follower, Publisher(js)
        finally:
            await follower.stop()
            await nc.close()
    finally:
        assert await asyncio.to_thread(up.stop) == 0, up.text()[-3000:]


async def _until(view: Callable[[], View], what: str, cond: Callable[[View], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + 30
    while not cond(view()):
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line)


def _cli(url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *argv, "--nats", url],
        cwd=ra.REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


async def test_gpu_host_tour(plane: tuple[str, ViewFollower, Publisher], tmp_path: Path) -> None:
    url, follower, pub = plane
    nvml = tmp_path / "nvml.json"
    nvml.write_text(
        json.dumps(
            {
                "gpus": [
                    {"uuid": u, "name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559} for u in UUIDS
                ]
            }
        )
    )
    events = Path(str(nvml) + ".events")
    agent = ra.RealAgent(
        url,
        NODE,
        tmp_path,
        "--ports",
        _ports(4),
        "--used-interval",
        "0.2",
        "--scrape",
        "0.1",
        gpus=None,
        env={
            "PYTHONPATH": os.pathsep.join([ra.FAKE_NVML_DIR, str(ra.REPO)]),
            "FAKE_NVML": str(nvml),
        },
    )

    def view() -> View:
        return follower.view

    async def publish(data: ev.Data) -> None:
        await pub.publish(ev.make(data, id=new_id(), time=datetime.now(UTC), source="test/op"))

    def gpus() -> tuple[ev.GpuInfo, ...]:
        n = view().state.nodes.get(NODE)
        return n.report.gpus if n is not None else ()

    def live() -> list:
        return [r for r in view().replicas.values() if r.model == "chat"]

    try:
        # The GPUs, from NVML.
        await _until(view, "the node's inventory", lambda v: len(gpus()) == 2)
        assert [(g.uuid, g.model, g.memory_gb, g.healthy) for g in gpus()] == [
            (u, "H100", 79.6, True) for u in UUIDS
        ]
        # A model whose server is the fake one, scaled to 1.
        await publish(
            ev.ModelDeclared(
                name="chat",
                min=0,
                max=2,
                profiles=(ev.ProfileSpec(name="tp1", gpus=1, gpu_model="H100"),),
                runtime=ra.fake_runtime("--load-s", "0.3"),
            )
        )
        await publish(ev.ScaleDesired(model="chat", replicas=1))
        await _until(view, "chat ready", lambda v: [r.state for r in live()] == ["ready"])
        first = live()[0]
        idx = first.shards[0].gpus[0]
        srv = ra.servers(tmp_path, NODE)[first.id]
        env = dict(
            x.split("=", 1) for x in ra.text(f"/proc/{srv['pid']}/environ").split("\0") if "=" in x
        )
        assert env["CUDA_VISIBLE_DEVICES"] == UUIDS[idx]  # pinned by uuid

        # A served request becomes use.
        assert await asyncio.to_thread(_post, srv["port"]) == 200
        await _until(view, "chat used", lambda v: v.replicas[first.id].last_used_at is not None)

        # An application XID changes nothing; a critical one takes the GPU out.
        await asyncio.to_thread(_append, events, f"{idx} xid 13\n")
        await asyncio.to_thread(_append, events, f"{idx} xid 79\n")
        await _until(view, "GPU unhealthy", lambda v: not gpus()[idx].healthy)
        await _until(view, "its replica failed", lambda v: v.replicas[first.id].state == "failed")
        assert "GPU " + str(idx) + " unhealthy: XID 79" in (view().replicas[first.id].reason or "")
        await _until(
            view,
            "a new replica on the other GPU",
            lambda v: any(r.state == "ready" and r.id != first.id for r in live()),
        )
        again = next(r for r in live() if r.state == "ready")
        assert again.shards[0].gpus == (1 - idx,)

        # Brought back by hand.
        out = await asyncio.to_thread(_cli, url, "gpu", "reset-health", NODE, str(idx))
        assert out.returncode == 0, out.stderr
        assert f"GPU {idx} of {NODE} is healthy again (was: XID 79)" in out.stdout
        await _until(view, "GPU healthy", lambda v: gpus()[idx].healthy)

        # Scaled to 0: drained, stopped, nothing left.
        await publish(ev.ScaleDesired(model="chat", replicas=0))
        await _until(
            view,
            "chat stopped",
            lambda v: all(r.state in ("stopped", "failed") for r in live()),
        )
        assert ra.leftovers(NODE) == {}
    finally:
        agent.stop()
        left = ra.sweep(NODE)
        assert not left, f"processes left behind: {left}\n{agent.text()}"
