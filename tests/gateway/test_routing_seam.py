"""The routing seam (services.core.routing): a scorer is one `Picker` and one
registration. The stand-in below, a prefix-affinity rule written here and nowhere else,
plugs into a real gateway through `Gateway.of`'s `pickers` and the `routing` setting
alone, and the official `openai` package's requests with the same prompt prefix then go
to the same replica, where the plain rule spreads them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field

import openai
import pytest
from nats.js.client import JetStreamContext

from schemas import subjects
from services.agent.responder import Responder
from services.core import catalog, routing
from services.core.pickers import PICKERS
from services.core.view import ReplicaRecord, View
from services.gateway.config import Config
from services.gateway.server import Gateway
from tests.gateway.conftest import Plane, serving

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]

# PREFIX is how much of a prompt the stand-in keys on.
PREFIX = 200


@dataclass
class PrefixStandIn(routing.LeastInflight):
    """A request goes to the replica that last served a prompt with its first `PREFIX`
    characters, while that replica may take it; else the plain rule. Forgets a replica's
    prefixes as it leaves routing."""

    by_prefix: dict[tuple[str, str], str] = field(default_factory=dict)

    def choose(
        self, view: View, m: catalog.Model, route: routing.Route | None, found: list[ReplicaRecord]
    ) -> ReplicaRecord:
        if route is not None:
            rid = self.by_prefix.get((m.name, route.leading(PREFIX)))
            for r in found:
                if r.id == rid:
                    return r
        return super().choose(view, m, route, found)

    def pick(
        self,
        view: View,
        m: catalog.Model,
        route: routing.Route | None = None,
        *,
        avoid: Collection[str] = (),
        limit: int | None = None,
    ) -> ReplicaRecord | None:
        r = super().pick(view, m, route, avoid=avoid, limit=limit)
        if r is not None and route is not None:
            self.by_prefix[(m.name, route.leading(PREFIX))] = r.id
        return r

    def forget(self, gone: Iterable[str]) -> None:
        gone = set(gone)
        super().forget(gone)
        self.by_prefix = {k: v for k, v in self.by_prefix.items() if v not in gone}


@pytest.fixture
async def prefixed(plane: Plane, js: JetStreamContext) -> AsyncIterator[Gateway]:
    """A second gateway on the same log, told `routing = "prefix"` with the stand-in
    registered under that name."""
    config = Config(listen="127.0.0.1:0", routing="prefix")
    gw = Gateway.of(
        js, config, root=subjects.DEFAULT_ROOT, pickers={**PICKERS, "prefix": PrefixStandIn}
    )
    assert isinstance(gw.router, PrefixStandIn)
    async with serving(gw):
        yield gw


@pytest.fixture
async def plain(plane: Plane, js: JetStreamContext) -> AsyncIterator[Gateway]:
    """A third gateway on the same log, told `routing = "least-inflight"`: the plane's
    own routes by the default rule, prefix-aware, which would keep a group together
    too; the comparison is with the plain rule's spreading."""
    config = Config(listen="127.0.0.1:0", routing="least-inflight")
    gw = Gateway.of(js, config, root=subjects.DEFAULT_ROOT)
    assert type(gw.router) is routing.LeastInflight
    async with serving(gw):
        yield gw


def _system(group: int) -> str:
    return f"You are assistant number {group}. " + "Answer briefly and politely. " * 10


async def _replicas(url: str) -> dict[int, set[str]]:
    """Three groups of four chats each, interleaved, one at a time: each group's system
    prompt is its own, each chat's question its own. The replicas each group went to."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    went: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
    try:
        for i in range(12):
            group = i % 3
            raw = await client.chat.completions.with_raw_response.create(
                model="pfx",
                messages=[
                    {"role": "system", "content": _system(group)},
                    {"role": "user", "content": f"question {i}"},
                ],
                max_tokens=1,
            )
            raw.parse()
            went[group].add(raw.headers["x-llmgw-replica"])
    finally:
        await client.close()
    return went


async def test_a_prefix_scorer_in_a_test_file_sends_a_shared_prefix_to_one_replica(
    plane: Plane,
    prefixed: Gateway,
    plain: Gateway,
    servers: Callable[..., Awaitable[Responder]],
) -> None:
    await plane.model("pfx")
    for rid in ("pfx-1", "pfx-2"):
        s = await servers(rid, "pfx")
        await plane.ready(rid, "pfx", s.endpoint)
    await prefixed.follower.wait_for(plane.gateway.follower.seq, 5)
    await plain.follower.wait_for(plane.gateway.follower.seq, 5)

    # The plain rule spreads a group over both replicas (least in flight, ties to the
    # one picked longest ago: one at a time, they take turns).
    spread = await _replicas(plain.url)
    assert all(len(got) == 2 for got in spread.values()), spread

    stuck = await _replicas(prefixed.url)
    assert all(len(got) == 1 for got in stuck.values()), stuck
    assert set().union(*stuck.values()) == {"pfx-1", "pfx-2"}  # and still spread by group
    assert prefixed.router.inflight == {}

    # A replica drained is forgotten by the scorer as by the plain rule: its groups go to
    # the other.
    gone = next(iter(stuck[0]))
    await plane.drain(gone, "pfx")
    await prefixed.follower.wait_for(plane.gateway.follower.seq, 5)
    router = prefixed.router
    assert isinstance(router, PrefixStandIn)
    assert gone not in router.by_prefix.values() and gone not in router.kept()
    after = await _replicas(prefixed.url)
    assert set().union(*after.values()) == {"pfx-1", "pfx-2"} - {gone}
