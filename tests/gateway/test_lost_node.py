"""A model whose replicas sit on a lost node within its grace: the plane counts them live
(their agent may still serve them) and places no other, and the gateway sends them
nothing. A request for it is told so at once, 503 naming the node and when a replica
should be there again, not held 30 s and refused with "ready in about 1s" while demand
the plane cannot act on is published every second. The node back, it is served again.
And the router forgets a replica once it is gone."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import pytest

from schemas import events as ev
from services.agent.responder import Responder
from tests.gateway.conftest import Plane

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]


async def test_a_model_stranded_on_a_lost_node_is_503_naming_it_at_once(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.inventory(plane.node, 8)
    await plane.model("stranded")
    s = await servers("stranded-1", "stranded")
    await plane.ready("stranded-1", "stranded", s.endpoint)
    status, _, _ = await plane.chat("stranded", max_tokens=1)
    assert status == 200

    await plane.say(ev.NodeLost(node=plane.node, reason="no heartbeat for 16s", grace_s=60))
    t = time.monotonic()
    status, headers, body = await plane.chat("stranded", max_tokens=1)
    assert time.monotonic() - t < 2, "told at once, not held"
    assert status == 503, body
    assert headers["x-llmgw-reason"].startswith("node_lost: ")
    message = json.loads(body)["error"]["message"]
    assert f"node {plane.node}, lost (no heartbeat for 16s)" in message, message
    assert "unless" in message and "should be ready about" in message
    # The grace's rest (60 s) and a start: not "about 1s".
    assert int(headers["Retry-After"]) >= 59
    assert plane.gateway.counts.demanded == 0

    await plane.say(ev.NodeFound(node=plane.node, reason="heartbeat heard again"))
    status, _, _ = await plane.chat("stranded", max_tokens=1)
    assert status == 200


async def test_a_replica_gone_is_forgotten_by_the_router(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    """When a replica was last picked is kept while it serves, and dropped once it has
    stopped: one entry per replica ever picked would grow for as long as the gateway runs."""
    await plane.inventory(plane.node, 8)
    await plane.model("forgotten")
    s = await servers("forgotten-1", "forgotten")
    await plane.ready("forgotten-1", "forgotten", s.endpoint)
    status, _, _ = await plane.chat("forgotten", max_tokens=1)
    assert status == 200
    assert "forgotten-1" in plane.gateway.router.kept()
    await plane.drain("forgotten-1", "forgotten")
    r = plane.gateway.follower.view.replicas["forgotten-1"]
    await plane.say(
        ev.ReplicaState(
            replica="forgotten-1",
            model="forgotten",
            profile="p",
            state="stopped",
            shards=r.shards,
        ),
        node=plane.node,
    )
    assert "forgotten-1" not in plane.gateway.router.kept()


async def test_a_replica_drained_or_on_a_node_removed_or_lost_is_forgotten_at_once(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    """Every way out of routing for good, not only a replica's own stop: its drain (it is
    never routed to again), its node removed, its node lost past any grace (the fold fails
    what the node held; no `replica.state` of it ever comes)."""
    await plane.model("leaving")
    nodes = {
        "leaving-1": plane.node,
        "leaving-2": f"{plane.node}-b",
        "leaving-3": f"{plane.node}-c",
    }
    for rid, node in nodes.items():
        await plane.inventory(node, 8)
        s = await servers(rid, "leaving")
        await plane.ready(rid, "leaving", s.endpoint, node=node)
    for _ in nodes:
        status, _, _ = await plane.chat("leaving", max_tokens=1)
        assert status == 200
    router = plane.gateway.router
    assert set(router.kept()) >= set(nodes)
    await plane.drain("leaving-1", "leaving")
    assert "leaving-1" not in router.kept()
    await plane.say(ev.NodeRemoved(node=nodes["leaving-2"], reason="decommissioned"))
    assert "leaving-2" not in router.kept()
    await plane.say(ev.NodeLost(node=nodes["leaving-3"], reason="no heartbeat"))
    assert not set(nodes) & set(router.kept())
    assert router.inflight == {}
