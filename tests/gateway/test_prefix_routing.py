"""Prefix-aware routing through a real gateway (`--routing prefix`), the official `openai`
package as its client, simulated servers with a prefix cache: a group's shared system
prompt goes to the replica that has it cached, which says so (`cached_tokens`); the
answer says why (`x-llmgw-route`); a cache reset behind the gateway's back is corrected
by the engine's report; a drained replica's prefixes go elsewhere at once; `/metrics`
has the predicted and reported hit rates."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import openai
import pytest
from nats.js.client import JetStreamContext

from schemas import subjects
from services.agent.responder import Responder, Timing
from services.core.prefix import Prefix
from services.gateway.config import Config
from services.gateway.server import Gateway
from tests.gateway.conftest import Plane, serving

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]

CACHED = Timing(0.0, 0.0, cache_tokens=65_536)


@pytest.fixture
async def prefixed(plane: Plane, js: JetStreamContext) -> AsyncIterator[Gateway]:
    """A second gateway on the same log, `--routing prefix`."""
    gw = Gateway.of(js, Config(listen="127.0.0.1:0", routing="prefix"), root=subjects.DEFAULT_ROOT)
    assert isinstance(gw.router, Prefix) and gw.rule == "prefix"
    async with serving(gw):
        yield gw


def _system(group: int) -> str:
    return f"You are assistant number {group}. " + "Answer briefly and politely, citing. " * 40


async def _ask(
    client: openai.AsyncOpenAI, group: int, question: str
) -> tuple[str, str, int | None]:
    """(replica, x-llmgw-route, cached_tokens) of one chat of `group`."""
    raw = await client.chat.completions.with_raw_response.create(
        model="pfx",
        messages=[
            {"role": "system", "content": _system(group)},
            {"role": "user", "content": question},
        ],
        max_tokens=1,
    )
    done = raw.parse()
    details = done.usage.prompt_tokens_details if done.usage else None
    cached = None if details is None else details.cached_tokens
    return raw.headers["x-llmgw-replica"], raw.headers.get("x-llmgw-route", ""), cached


async def test_shared_prefixes_go_to_the_warm_replica_and_the_engine_corrects_the_index(
    plane: Plane, prefixed: Gateway, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await plane.model("pfx")
    made: dict[str, Responder] = {}
    for rid in ("pfx-1", "pfx-2"):
        made[rid] = s = await servers(rid, "pfx", CACHED)
        await plane.ready(rid, "pfx", s.endpoint)
    await prefixed.follower.wait_for(plane.gateway.follower.seq, 5)
    router = prefixed.router
    assert isinstance(router, Prefix)
    client = openai.AsyncOpenAI(base_url=f"{prefixed.url}/v1", api_key="unused", max_retries=0)
    try:
        went: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
        warm_cached = []
        for i in range(12):
            rid, why, cached = await _ask(client, i % 3, f"question {i}")
            went[i % 3].add(rid)
            if i >= 3:  # each group's first was cold
                assert why.startswith("warm; matched="), why
                warm_cached.append(cached)
        assert all(len(w) == 1 for w in went.values()), went
        assert set().union(*went.values()) == {"pfx-1", "pfx-2"}
        # The engine served the shared system prompt from its cache: most of the prompt.
        assert all(c is not None and c >= 300 for c in warm_cached), warm_cached

        # Its cache reset behind the gateway's back: the next warm request's answer says
        # 0 cached, and the replica's entry is cleared but for what it just computed.
        home = next(iter(went[0]))
        others = [g for g in (1, 2) if went[g] == {home}]
        made[home].clear_cache()
        assert router.corrections == 0
        rid, why, cached = await _ask(client, 0, "after the reset")
        assert (rid, cached) == (home, 0) and why.startswith("warm")
        assert router.corrections == 1
        for g in others:  # the groups it had besides are no longer warm there
            _, why, _ = await _ask(client, g, "after the reset too")
            assert not why.startswith("warm"), why

        async with plane.http.get(f"{prefixed.url}/metrics") as r:
            text = await r.text()
        assert 'llmgw_gateway_prefix_hit_rate{model="pfx",source="predicted"}' in text
        assert 'llmgw_gateway_prefix_hit_rate{model="pfx",source="reported"}' in text

        # The warm replica drained: forgotten at once, its groups go to the other.
        await plane.drain(home, "pfx")
        await prefixed.follower.wait_for(plane.gateway.follower.seq, 5)
        assert home not in router.index and home not in router.kept()
        for i in range(3):
            rid, _, _ = await _ask(client, i, "after the drain")
            assert rid != home
    finally:
        await client.close()
