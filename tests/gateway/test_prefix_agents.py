"""The prefix rule in front of a real agent: `llmgw agent` (the process runtime) as a
process, its replicas' servers real processes. A group's prefix goes to one replica; its
server killed (kill -9), the agent reports the replica failed, and the gateway's index
holds nothing of it the instant that is folded: the group goes to the other replica,
cold there, never back to the failed one; a replica started again on the failed one's
GPU is a new replica, warm for nothing; a drain does the same."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from nats.js.client import JetStreamContext

from schemas import subjects
from services.agent import procs
from services.bus import EmbeddedBroker
from services.core.prefix import Prefix
from services.gateway.config import Config
from services.gateway.server import Gateway
from tests.agent import realagent as ra
from tests.agent.helpers import drain_cmd, placement_of, start_cmd, wait_for
from tests.agent.test_process_runtime import _ports, run_agent  # noqa: F401
from tests.gateway.conftest import Plane, serving

pytestmark = pytest.mark.timeout(90)

RESTARTED = "pr-4"
SYSTEM = "You are the assistant of the prefix group. " + "Answer in one short line. " * 40


@pytest.fixture
async def prefixed(plane: Plane, js: JetStreamContext) -> AsyncIterator[Gateway]:
    """A second gateway on the same log, `--routing prefix`."""
    gw = Gateway.of(js, Config(listen="127.0.0.1:0", routing="prefix"), root=subjects.DEFAULT_ROOT)
    async with serving(gw):
        yield gw


async def _ask(client: openai.AsyncOpenAI, question: str) -> tuple[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model="pfxreal",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    )
    raw.parse()
    return raw.headers["x-llmgw-replica"], raw.headers.get("x-llmgw-route", "")


async def test_a_failed_or_drained_replica_is_never_picked_for_its_old_prefixes(
    nats_server: EmbeddedBroker,
    js: JetStreamContext,
    plane: Plane,
    prefixed: Gateway,
    tmp_path: Path,
    run_agent: list[ra.RealAgent],  # noqa: F811
) -> None:
    node = "gw-pfx-real"
    await ra.publish(js, ra.declared("pfxreal", ra.fake_runtime("--drain-s", "1")))
    run_agent.append(
        ra.RealAgent(nats_server.url, node, tmp_path, "--ports", _ports(6), gpus="4xH100-80GB", n=0)
    )
    nodes = prefixed.follower.view.state.nodes
    await wait_for(lambda: asyncio.sleep(0, node in nodes), bool)
    rids = ("pr-1", "pr-2", "pr-3")
    for gpu, rid in enumerate(rids):
        start = start_cmd(rid, node, (gpu,), model="pfxreal")
        await ra.publish(js, placement_of(start))
        await ra.publish(js, start)
    for rid in rids:
        await ra.until_state(js, node, rid, "ready")
    await prefixed.follower.caught_up(5)
    router = prefixed.router
    assert isinstance(router, Prefix)

    client = openai.AsyncOpenAI(base_url=f"{prefixed.url}/v1", api_key="unused", max_retries=0)
    try:
        went = {(await _ask(client, f"q{i}"))[0] for i in range(4)}
        assert len(went) == 1, went
        warm = went.pop()

        # Its server killed: the agent reports the replica failed; at that fold the
        # index drops it, before any request.
        pids = {p for tag, ps in ra.leftovers(node).items() if warm in tag for p in ps}
        assert pids
        procs.kill(pids)
        await ra.until_state(js, node, warm, "failed")
        await wait_for(
            lambda: asyncio.sleep(0, prefixed.follower.view.replicas[warm].state), "failed".__eq__
        )
        assert warm not in router.index and warm not in router.kept()
        after = [await _ask(client, f"after {i}") for i in range(4)]
        assert all(rid != warm for rid, _ in after), after
        assert after[0][1].startswith("cold"), after  # nothing stale said warm
        assert len({rid for rid, _ in after}) == 1 and after[1][1].startswith("warm")

        # Restarted: a replica started again on the failed one's GPU is a new replica,
        # with nothing of the old one's prefixes.
        restart = start_cmd(RESTARTED, node, (rids.index(warm),), model="pfxreal")
        await ra.publish(js, placement_of(restart))
        await ra.publish(js, restart)
        await ra.until_state(js, node, RESTARTED, "ready")
        await prefixed.follower.caught_up(5)
        assert RESTARTED not in router.index

        # Drained: the same at the drain's fold, its server still up and draining.
        second = after[0][0]
        p = await plane.pub.publish(drain_cmd(second, model="pfxreal", grace_s=2.0), node=node)
        await prefixed.follower.wait_for(p.seq, 5)
        assert second not in router.index and second not in router.kept()
        last = [await _ask(client, f"last {i}") for i in range(3)]
        assert all(rid not in (warm, second) for rid, _ in last), last
        # Cold wherever it went, the restarted replica among the candidates.
        assert last[0][1].startswith("cold"), last
    finally:
        await client.close()
    # Every server stopped by its agent, none left behind.
    for rid in (*rids, RESTARTED):
        if rid != warm:
            await ra.publish(js, drain_cmd(rid, model="pfxreal", grace_s=0.5), node=node)
    for rid in (*rids, RESTARTED):
        if rid != warm:
            await ra.until_state(js, node, rid, "stopped")
