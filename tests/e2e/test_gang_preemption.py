"""A critical two-node model preempts an opportunistic two-node replica whole, on real
processes: `llmgw up --policy node-aware` on a broker of its own and two simulated agents
(`llmgw agent --simulate`) labelled into one NVLink domain, a third in another.

The opportunistic replica spans the two nodes of domain A; the critical model requires
one domain and fits none until it is stopped. Node-aware stops it as one victim: one
decision, a drain on each shard's node, the replica stopped, and the critical model
placed inside the freed domain. `llmgw explain replica` names the gang and the domain.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from nats.js.client import JetStreamContext

from schemas import codec
from schemas import events as ev
from services.bus import EmbeddedBroker, consume
from tests.agent.helpers import new_id
from tests.agent.realagent import publish
from tests.e2e.test_node_faults import SimAgent, _until
from tests.up_process import UpProcess

pytestmark = [pytest.mark.timeout(150), pytest.mark.module_broker]

NVL = ev.TopologySpec(level="nvlink_domain")
NODES = {"g-a1": "A", "g-a2": "A", "g-b1": "B"}


@pytest.fixture(scope="module")
def plane(
    module_nats_server: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpProcess]:
    base = tmp_path_factory.mktemp("gangs")
    url = module_nats_server.url
    up = UpProcess(
        base / "data",
        base / "up.log",
        *("--nats", url, "--tick", "0.2", "--policy", "node-aware"),
        *("--min-lifetime", "0", "--grace", "0", "--hold", "60", "--drain-grace", "0"),
    )
    agents: list[SimAgent] = []
    try:
        deadline = time.monotonic() + 30
        while "up: scheduler, preemption service" not in up.text():
            assert up.alive(), up.text()[-3000:]
            assert time.monotonic() < deadline, up.text()[-3000:]
            time.sleep(0.05)
        for node, domain in NODES.items():
            agents.append(
                SimAgent(
                    url,
                    node,
                    "8xH100-80GB",
                    base / f"{node}.log",
                    "--labels",
                    f"nvlink_domain={domain}",
                )
            )
        yield up
    finally:
        for a in agents:
            a.stop()
        up.stop()


async def _declare(js: JetStreamContext, data: ev.Data) -> None:
    await publish(js, ev.make(data, id=new_id(), time=datetime.now(UTC), source="test/operator"))


async def _story(js: JetStreamContext) -> str:
    """The log's decisions, placements and replica states, for a failure to show."""
    lines = []
    async for batch in consume.read_range(js, 1, None):
        for d in batch:
            e = codec.decode(d.data)
            if isinstance(e, ev.PreemptionDecidedEvent):
                lines.append(f"decided {e.data.outcome}: {e.data.reason}")
            elif isinstance(e, ev.PlacementFailedEvent):
                lines.append(f"failed {e.data.model} {e.data.reason} {e.data.why}")
            elif isinstance(e, ev.ReplicaStateEvent | ev.ReplicaDrainEvent):
                lines.append(f"{type(e).__name__} {d.subject} {e.data}")
    return "\n".join(lines[-40:])


def _pp2(level: ev.TopologySpec | None) -> tuple[ev.ProfileSpec, ...]:
    return (ev.ProfileSpec(name="pp2", gpus=8, shards=2, topology=level),)


async def test_a_critical_two_node_model_preempts_a_two_node_replica_whole(
    plane: UpProcess, js: JetStreamContext, module_nats_server: EmbeddedBroker
) -> None:
    await _until(js, "three nodes", lambda v: len(v.state.nodes) == 3)
    await _declare(
        js,
        ev.ModelDeclared(name="batch", cls="opportunistic", min=1, max=1, profiles=_pp2(NVL)),
    )
    v = await _until(
        js,
        "batch ready on both nodes of A",
        lambda v: any(r.state == "ready" for r in v.replicas_of("batch")),
        within=40,
    )
    gang = next(r for r in v.replicas_of("batch") if r.state == "ready")
    assert sorted(gang.nodes) == ["g-a1", "g-a2"]
    await _declare(js, ev.ModelDeclared(name="big", cls="critical", min=1, profiles=_pp2(NVL)))
    try:
        v = await _until(
            js,
            "big ready",
            lambda v: any(r.state == "ready" for r in v.replicas_of("big")),
            within=60,
        )
    except AssertionError:
        raise AssertionError(await _story(js)) from None
    big = next(r for r in v.replicas_of("big") if r.state == "ready")
    assert sorted(big.nodes) == ["g-a1", "g-a2"]  # inside the freed domain
    # None of the gang left running: stopped, GPUs free for big.
    assert v.state.replicas[gang.id].state == "stopped"
    out = plane.llmgw("explain", "replica", gang.id, "--nats", module_nats_server.url)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "preempted" in text and "policy     node-aware" in text, text
    assert "gang       stopped whole: every shard drained, on g-a1, g-a2" in text, text
    assert "domain     big goes to nvlink_domain=A" in text, text


async def test_each_shard_got_its_drain_from_one_decision(
    plane: UpProcess, js: JetStreamContext
) -> None:
    drains: list[tuple[str, str]] = []
    decisions: list[ev.PreemptionDecidedEvent] = []
    async for batch in consume.read_range(js, 1, None):
        for d in batch:
            e = codec.decode(d.data)
            if isinstance(e, ev.ReplicaDrainEvent) and e.data.reason == "preempted":
                drains.append((e.data.replica, d.subject))
            if isinstance(e, ev.PreemptionDecidedEvent) and e.data.outcome == "preempted":
                decisions.append(e)
    assert len(decisions) == 1, decisions
    (gang,) = decisions[0].data.spans
    assert decisions[0].data.spans[gang] == ("g-a1", "g-a2")
    subjects = sorted(s for r, s in drains if r == gang)
    assert len(subjects) == 2 and ".g-a1." in subjects[0] and ".g-a2." in subjects[1], subjects


async def test_big_was_placed_only_once_both_shards_had_stopped(js: JetStreamContext) -> None:
    """Each shard's agent said its own `stopped` (naming its node); the freed domain was
    given to big only after the last of them, and none of big's starts failed."""
    stops: dict[str, int] = {}
    placed: list[int] = []
    failed: list[str] = []
    gang = None
    async for batch in consume.read_range(js, 1, None):
        for d in batch:
            e = codec.decode(d.data)
            if isinstance(e, ev.PreemptionDecidedEvent) and e.data.outcome == "preempted":
                (gang,) = e.data.spans
            elif isinstance(e, ev.ReplicaStateEvent) and e.data.replica == gang:
                if e.data.state == "stopped":
                    assert e.data.node is not None, e
                    stops[e.data.node] = d.seq
            elif isinstance(e, ev.PlacementDecidedEvent) and e.data.model == "big":
                placed.append(d.seq)
            elif isinstance(e, ev.ReplicaStateEvent) and e.data.state == "failed":
                failed.append(f"{e.data.replica} ({e.data.model}): {e.data.reason}")
    assert sorted(stops) == ["g-a1", "g-a2"], stops
    assert placed and min(placed) > max(stops.values()), (placed, stops)
    assert failed == []
