"""An agent across a broker restart: it says its inventory and its replicas' states again
after the reconnect, and stops a replica the log failed with its node meanwhile (lost
past the grace while the agent was cut off), so its server frees GPUs given to others."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.agent import SimulatedRuntime
from services.agent.agent import LOST_PAST_GRACE
from services.bus import EmbeddedBroker, Publisher, Unanswered, consume
from services.bus.stream import ensure_stream
from tests.agent.helpers import (
    by_replica,
    new_id,
    node_events,
    running_agent,
    sim_agent,
    start_cmd,
    states,
    wait_for,
)

pytestmark = pytest.mark.timeout(30)

NODE = "gpu-r1"


async def test_after_a_reconnect_the_agent_says_it_all_again_and_stops_what_the_log_failed(
    nats_server: EmbeddedBroker, nc: Client, js: JetStreamContext
) -> None:
    await ensure_stream(js)
    runtime = SimulatedRuntime(0.02, 0.05, 0.05)
    async with running_agent(sim_agent(nc, js, NODE, "2xH100-80GB", runtime=runtime)):
        pub = Publisher(js)
        await pub.publish(start_cmd("r-kept", NODE, (0,)))
        await wait_for(
            lambda: states(js, NODE), lambda s: by_replica(s).get("r-kept", [""])[-1] == "ready"
        )
        # The scheduler's second node.lost (the grace passed) while the agent is cut off:
        # stored before the broker goes, read by the agent once it is back.
        lost = ev.make(
            ev.NodeLost(node=NODE, reason="not heard from within the grace"),
            id=new_id(),
            time=datetime.now(UTC),
            source="scheduler",
        )
        await pub.publish(lost)
        inventories = len(await node_events(js, NODE, "inventory"))
        nats_server.kill()
        await asyncio.to_thread(nats_server.start)

        got = await wait_for(
            lambda: states(js, NODE),
            lambda s: by_replica(s).get("r-kept", [""])[-1] == "failed",
            within_s=15,
        )
        (failed,) = [e for e in got if e.data.state == "failed"]
        assert failed.data.reason == LOST_PAST_GRACE
        assert "r-kept" not in runtime.running()
        assert len(await node_events(js, NODE, "inventory")) > inventories


async def test_a_background_task_that_fails_is_said_in_one_line(
    nats_server: EmbeddedBroker, nc: Client, js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-announce cut short by an election (its reset of the agent's reader not answered)
    was left for asyncio to report as an exception nobody retrieved, with a traceback; it
    is one line naming the node and the task."""
    agent = sim_agent(nc, js, NODE, "1xH100-80GB")

    async def cut_short() -> None:
        raise TimeoutError("nats: timeout")

    agent._background(cut_short())
    await asyncio.sleep(0)  # the task runs to its end
    await asyncio.sleep(0)
    said = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert said == [f"{NODE}: {cut_short.__qualname__} failed: TimeoutError: nats: timeout"]


async def test_an_agent_whose_history_is_not_answered_in_time_reads_it_again(
    nc: Client,
    js: JetStreamContext,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A cluster's server stopping as the agent starts leaves its reader's reset
    # unanswered (`Unanswered`, after 5 s): the agent reads its history again, it does
    # not end (and `llmgw up` with it). The first two reads fail as that server's would.
    await ensure_stream(js)
    real = consume.read_pulled
    failed: list[int] = []

    def flaky(*a: Any, **kw: Any) -> AsyncGenerator[list[consume.Delivery], None]:
        if len(failed) < 2:
            failed.append(1)
            return _unanswered()
        return real(*a, **kw)

    monkeypatch.setattr(consume, "read_pulled", flaky)
    caplog.set_level(logging.INFO, "llmgw.agent")
    async with running_agent(sim_agent(nc, js, "gpu-r2", "1xH100-80GB")):
        await Publisher(js).publish(start_cmd("r-after", "gpu-r2", (0,)))
        await wait_for(
            lambda: states(js, "gpu-r2"),
            lambda s: by_replica(s).get("r-after", [""])[-1] == "ready",
        )
    said = [r.getMessage() for r in caplog.records if "history" in r.getMessage()]
    assert len(failed) == 2
    assert said == [
        "gpu-r2: its history in the log not read yet (consumer x: reset to 1 not answered: "
        "nats: timeout); reading it again",
        "gpu-r2: its history in the log read",
    ]


async def _unanswered() -> AsyncGenerator[list[consume.Delivery], None]:
    raise Unanswered("consumer x: reset to 1 not answered: nats: timeout")
    yield []
