"""Kill -9 the broker mid-run and restart it on the same store: services reconnect,
nothing stored before the kill is lost, and the cluster converges to what is desired."""

from __future__ import annotations

import asyncio

import pytest

from schemas import events as ev
from tests.e2e.test_tour import Cluster, cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


async def _ids(c: Cluster) -> list[tuple[int, str]]:
    from schemas import codec
    from services.bus import consume

    out = []
    async for batch in consume.read_range(c.js, 1, None):
        out.extend((d.seq, codec.decode(d.data).id) for d in batch)
    return out


async def test_broker_killed_mid_run(cluster: Cluster) -> None:  # noqa: F811
    broker = cluster.running.broker
    assert broker is not None
    await cluster.publish(
        ev.ModelDeclared(
            name="web",
            cls="standard",
            min=1,
            max=12,
            profiles=(ev.ProfileSpec(name="tp1", gpus=1),),
        )
    )
    await cluster.publish(ev.ScaleDesired(model="web", replicas=4))
    await cluster.until(
        "4 web replicas ready",
        lambda v: sum(1 for r in v.replicas_of("web") if r.state == "ready") == 4,
    )
    # Ask for more and kill the broker while the scheduler and agents are at work.
    await cluster.publish(ev.ScaleDesired(model="web", replicas=10))
    await cluster.until(
        "the scheduler at work on the scale", lambda v: sum(1 for _ in v.replicas_of("web")) > 4
    )
    before = await _ids(cluster)
    broker.kill()
    # Down until the clients have seen it go (not for some time), then back on its store.
    deadline = asyncio.get_running_loop().time() + 10
    while cluster.nc.is_connected:
        assert asyncio.get_running_loop().time() < deadline, "no client saw the broker go"
        await asyncio.sleep(0.02)
    await asyncio.to_thread(broker.start)

    await cluster.until(
        "10 web replicas ready after the restart",
        lambda v: sum(1 for r in v.replicas_of("web") if r.state == "ready") == 10,
        within=60,
    )
    after = await _ids(cluster)
    assert after[: len(before)] == before, "an event stored before the kill was lost"
    seqs = [s for s, _ in after]
    assert seqs == list(range(1, len(after) + 1)), "the log has a hole"
    view = cluster.view
    assert view.live_count("web") == 10
    # Exactly ten replicas hold GPUs: none placed twice across the restart.
    holding = [r for r in view.replicas_of("web") if r.holds_capacity]
    assert len(holding) == 10, [(r.id, r.state) for r in holding]
