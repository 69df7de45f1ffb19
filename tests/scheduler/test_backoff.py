"""Failed starts against a real broker: a scheduler and an agent whose runtime fails every
start of a model. The scheduler backs off, so the log grows by a few events per try and
the tries grow further apart, where without it a try followed every failure at once."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.agent import Agent, SimulatedRuntime
from services.core import scheduling as planner
from tests.agent.helpers import running_agent, sim_agent
from tests.scheduler.conftest import FAST, Cluster
from tests.scheduler.helpers import eventually

pytestmark = pytest.mark.timeout(30)

NODE = "gpu-a1"
MODEL = "m"
CONFIG = dataclasses.replace(FAST, start_backoff_s=0.2, start_backoff_max_s=0.8, failed_quiet_s=0.5)


@pytest.fixture
async def refusing_agent(nc: Client, js: JetStreamContext) -> AsyncIterator[Agent]:
    """The agent of NODE (8 H100), on a simulated runtime that fails every start of MODEL."""
    runtime = SimulatedRuntime(0.01, 0.01, 0.01, fail_models={MODEL})
    async with running_agent(sim_agent(nc, js, NODE, runtime=runtime)) as agent:
        yield agent


async def test_failed_starts_back_off_and_the_log_stays_bounded(
    cluster: Cluster, start_scheduler, refusing_agent: Agent
) -> None:
    tries = 5
    s = start_scheduler(CONFIG)
    await eventually(lambda: s.scheduler.view.state.nodes.get(NODE) is not None, within=5)
    first = s.scheduler.view.seq
    await cluster.declare(MODEL, gpus=1, min=1)
    decided: list[ev.Event] = []

    async def tried() -> bool:
        decided[:] = await cluster.of(ev.PlacementDecidedEvent, MODEL)
        return len(decided) >= tries

    await eventually(tried, within=15)
    events = [e for seq, _, e in await cluster.events() if seq > first]
    # The tries come after the backoff: 0.2 s, 0.4 s, then the 0.8 s cap.
    times = [e.time for e in decided]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    want = [planner.start_delay_s(n, CONFIG) for n in range(1, tries)]
    assert want == [0.2, 0.4, 0.8, 0.8]
    assert all(g >= w - 0.02 for g, w in zip(gaps, want, strict=True)), (gaps, want)
    # Each try: the decision, its start, the agent's starting, loading and failed, and at
    # most one placement.failed while the node backs off. Nothing else in the log.
    kinds = [type(e) for e in events]
    assert kinds.count(ev.ReplicaStartEvent) == len(decided)
    assert kinds.count(ev.PlacementFailedEvent) <= len(decided)
    assert len(events) <= 6 * len(decided) + 1  # + the declaration
    print(f"{len(events)} events for {len(decided)} tries, gaps {gaps}")
    failed = [e for e in events if isinstance(e, ev.PlacementFailedEvent)]
    assert failed and all(f.data.avoid == (NODE,) for f in failed)
    # Never two reports of the model within the quiet period.
    report_gaps = [(b.time - a.time).total_seconds() for a, b in itertools.pairwise(failed)]
    assert all(g >= CONFIG.failed_quiet_s - 0.02 for g in report_gaps), report_gaps
