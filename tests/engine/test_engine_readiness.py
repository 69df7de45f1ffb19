"""Readiness is a completion answered: vLLM's CPU build with a model it cannot run (a
head size under 32) starts, answers /health 200 and fails its first request; the
replica is failed with the engine's own error, and nothing of its server is left.

The process runtime on its own (no broker): what is tested is what it reports.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import events as ev
from services.agent import procs, spec
from services.agent.process import ProcessRuntime
from tests.agent import realagent as ra
from tests.agent.test_process_runtime import _ports
from tests.agent.test_process_units import Reports
from tests.engine import engine

pytestmark = pytest.mark.engine

NODE = "cpu-broken"


@pytest.fixture
def node() -> Iterator[str]:
    yield NODE
    left = ra.sweep(NODE)
    assert not left, f"processes left behind: {left}"


@pytest.mark.timeout(engine.READY_S + 60)
async def test_a_model_the_engine_cannot_run_fails_readiness_with_the_engines_error(
    node: str, engine_python: Path, tmp_path: Path
) -> None:
    broken = engine.make_model(engine_python, tmp_path / "head16", "--head-dim", "16")
    low, high = (int(p) for p in _ports(2).split("-"))
    rt = ProcessRuntime(
        node=node,
        data=tmp_path / "agent",
        gpus=spec.gpu_inventory(node, spec.parse_gpus("1xCPU-8GB")),
        ports=range(low, high + 1),
    )
    got = Reports()
    t0 = time.monotonic()
    await rt.start(
        "r-1",
        model="tiny",
        profile="cpu",
        shards=(ev.ShardSpec(node=node, gpus=(0,)),),
        report=got,
        runtime=engine.runtime(engine_python, broken),
    )
    print(f"\nhead size 16: {got.states()[-1]} after {time.monotonic() - t0:.1f}s")
    assert got.states() == ["starting", "loading", "failed"]
    reason = got.got[-1][1] or ""
    # Its /health said 200; the completion asked of it failed, and why is the engine's.
    assert reason.startswith("server answers /health but failed a completion: HTTP 500: "), reason
    assert (
        "first error: RuntimeError: Unsupported CPU attention configuration: head_dim=16" in reason
    ), reason
    log = (tmp_path / "agent" / "logs" / "r-1.log").read_text()
    assert '"GET /health HTTP/1.0" 200' in log
    assert rt._servers == {}
    assert procs.tagged(f"llmgw/{node}/") == {}
    # Nothing listens on its ports (a bind would also find another process's outgoing
    # connection there: the range is drawn beside the ephemeral ports).
    assert not [p for p in range(low, high + 1) if _listens(p)]


def _listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex(("127.0.0.1", port)) == 0
