"""The gateway in front of a real agent: `llmgw agent` (the process runtime) as a process,
running the fake model server as real processes, each ready replica's endpoint the port
the agent gave it. The openai package's requests reach them through the gateway; once a
drain of one is folded, none reaches it, while its server is still up and draining."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from nats.js.client import JetStreamContext

from services.bus import EmbeddedBroker
from tests.agent import realagent as ra
from tests.agent.helpers import drain_cmd, placement_of, start_cmd, wait_for
from tests.agent.test_process_runtime import _agent, _ports, run_agent  # noqa: F401
from tests.gateway.conftest import Plane

pytestmark = pytest.mark.timeout(60)


async def _known(plane: Plane, node: str) -> None:
    """Until the node's inventory is in the gateway's view: a scheduler places only on a
    node it knows, and only a placement makes a replica."""
    nodes = plane.gateway.follower.view.state.nodes
    await wait_for(lambda: asyncio.sleep(0, node in nodes), bool)


async def test_requests_reach_real_servers_and_leave_one_once_its_drain_is_folded(
    nats_server: EmbeddedBroker,
    js: JetStreamContext,
    plane: Plane,
    tmp_path: Path,
    run_agent: list,  # noqa: F811
) -> None:
    node = "gw-real"
    await ra.publish(js, ra.declared("real", ra.fake_runtime("--drain-s", "3")))
    _agent(run_agent, nats_server.url, node, tmp_path, "--ports", _ports(4))
    await _known(plane, node)
    for rid, gpu in (("rr-1", 0), ("rr-2", 1)):
        start = start_cmd(rid, node, (gpu,), model="real")
        await ra.publish(js, placement_of(start))
        await ra.publish(js, start)
    ready = [await ra.until_state(js, node, rid, "ready") for rid in ("rr-1", "rr-2")]
    ports = {s["port"] for s in ra.servers(tmp_path, node).values()}
    assert {es[-1].data.endpoint for es in ready} == {f"http://127.0.0.1:{p}" for p in ports}
    await plane.gateway.follower.caught_up(5)

    client = openai.AsyncOpenAI(base_url=f"{plane.url}/v1", api_key="unused", max_retries=0)
    served = set()
    for _ in range(4):
        r = await client.chat.completions.with_raw_response.create(
            model="real", messages=[{"role": "user", "content": "hi"}]
        )
        assert r.parse().choices[0].message.content == "hi"
        served.add(r.headers["x-llmgw-replica"])
    assert served == {"rr-1", "rr-2"}

    drain = drain_cmd("rr-1", model="real", grace_s=5.0)
    p = await plane.pub.publish(drain, node=node)
    await plane.gateway.follower.wait_for(p.seq, 5)
    retries = plane.gateway.counts.retries
    for _ in range(6):
        r = await client.chat.completions.with_raw_response.create(
            model="real", messages=[{"role": "user", "content": "hi"}]
        )
        assert r.headers["x-llmgw-replica"] == "rr-2"
    # Not one was tried on rr-1 and refused: the folded drain kept them away.
    assert plane.gateway.counts.retries == retries
    await client.close()
    await ra.publish(js, drain_cmd("rr-2", model="real", grace_s=0.5), node=node)
    for rid in ("rr-1", "rr-2"):
        await ra.until_state(js, node, rid, "stopped")


@pytest.mark.parametrize("wait", [True, False], ids=["waits for the gateway", "does not wait"])
async def test_a_real_agents_drain_waits_for_a_request_in_flight_through_the_gateway(
    nats_server: EmbeddedBroker,
    js: JetStreamContext,
    plane: Plane,
    tmp_path: Path,
    run_agent: list,  # noqa: F811
    wait: bool,
) -> None:
    """A server that exits at SIGTERM, cutting what it answers: the real agent sends it
    only once the gateway has nothing in flight there, so a request begun before the
    drain is answered whole (and with the agent not waiting, it is cut: a 502)."""
    node = f"gw-term-{int(wait)}"
    model = f"term{int(wait)}"
    await ra.publish(
        js, ra.declared(model, ra.fake_runtime("--request-s", "0.8", "--exit-on-term"))
    )
    extra = () if wait else ("--no-gateway-wait",)
    _agent(run_agent, nats_server.url, node, tmp_path, "--ports", _ports(2), *extra)
    rid = f"{model}-1"
    start = start_cmd(rid, node, (0,), model=model)
    await _known(plane, node)
    await ra.publish(js, placement_of(start))
    await ra.publish(js, start)
    await ra.until_state(js, node, rid, "ready")
    await wait_for(
        lambda: asyncio.sleep(0, plane.gateway.follower.view.replicas.get(rid)),
        lambda r: r is not None and r.endpoint is not None,
    )
    # A request of 0.8 s (the gateway's upstream timeout here is 1 s), being answered by
    # the server (its metrics say so) when the drain is sent.
    endpoint = plane.gateway.follower.view.replicas[rid].endpoint
    asked = asyncio.create_task(plane.chat(model))

    async def running() -> bytes:
        async with plane.http.get(f"{endpoint}/metrics") as r:
            return await r.read()

    await wait_for(running, lambda text: b'num_requests_running{model_name="fake"} 1.0' in text)
    await ra.publish(js, drain_cmd(rid, model=model, grace_s=10.0), node=node)
    status, headers, _ = await asyncio.wait_for(asked, 10)
    await ra.until_state(js, node, rid, "stopped")
    assert (status == 200) is wait, (status, headers.get("x-llmgw-reason"))
