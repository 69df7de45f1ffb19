"""The adversarial suite, a tenant's boundary: what the holder of one API key may try
against the gateway (a real one, on a real broker, its replicas simulated servers),
through the official `openai` package, to take more than its key and its tenant give it:
- tpm-concurrent: 20 requests of 100 tokens at once under `tpm=100`: admitted within
  the minute and one request's `max_tokens`, not all 20;
- stream-as-string: `"stream": "true"`, which a server reads as true and streams, is a
  400 naming `stream` (not an answer streamed and charged nothing);
- stream-cut: a stream its client closes after a few chunks is counted in
  `replica.used` and charged to the key for the chunks the client was sent;
- waiting-room-flood: team-b fills a model's line; team-c's request is still let in
  (team-b's newest pushed out, 429 naming team-b's share) and served;
- foreign-model: team-a's key asks for team-b's on-demand model: 404 exactly as for a
  name nobody declared, absent from its `/v1/models`, and the model is not woken.
Each is its own test id; after each the gateway still serves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from schemas import events as ev
from services.agent.responder import Responder, Timing
from services.core import ratelimit
from services.gateway.keys import Keys
from tests.agent.helpers import node_events, wait_for
from tests.gateway.conftest import Plane, plane, servers  # noqa: F401  (the fixtures)

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]

A = "sk-team-a-0123456789abcdef"
B = "sk-team-b-0123456789abcdef"
C = "sk-team-c-0123456789abcdef"
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
TPM = 100
MAX_TOKENS = 100

Servers = Callable[..., Awaitable[Responder]]


class Clock:
    """The keys' limits' clock, still: no refill while a test runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _keys(tmp_path: Path, text: str) -> Keys:
    p = tmp_path / "keys"
    p.write_text(text)
    p.chmod(0o600)
    return Keys.load(p)


class Tenants:
    """The test's clients, one a key, closed at the end."""

    def __init__(self, on: Plane) -> None:
        self.plane = on
        self.made: list[openai.AsyncOpenAI] = []

    def __call__(self, key: str, timeout: float = 10) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(
            base_url=f"{self.plane.url}/v1", api_key=key, max_retries=0, timeout=timeout
        )
        self.made.append(c)
        return c


@pytest.fixture
async def tenants(plane: Plane) -> AsyncIterator[Tenants]:  # noqa: F811
    t = Tenants(plane)
    yield t
    for c in t.made:
        await c.close()


async def _model(plane: Plane, name: str, owner: str = "default", **extra: Any) -> None:  # noqa: F811
    await plane.say(
        ev.ModelDeclared(
            name=name, owner=owner, min=0, profiles=(ev.ProfileSpec(name="p", gpus=1),), **extra
        )
    )


async def _served(
    plane: Plane,  # noqa: F811
    servers: Servers,  # noqa: F811
    name: str,
    timing: Timing | None = None,
    owner: str = "default",
) -> Responder:
    await _model(plane, name, owner)
    s = await (servers(f"{name}-1", name) if timing is None else servers(f"{name}-1", name, timing))
    await plane.ready(f"{name}-1", name, s.endpoint)
    return s


async def _used(plane: Plane, replica: str, done: Callable[[list[ev.ReplicaUsed]], bool]) -> Any:  # noqa: F811
    async def got() -> list[ev.ReplicaUsed]:
        es = await node_events(plane.gateway.js, plane.node)
        return [
            e.data for e in es if isinstance(e, ev.ReplicaUsedEvent) and e.data.replica == replica
        ]

    return await wait_for(got, done, 5)


# ---------------------------------------------------------------------------- attacks


async def tpm_concurrent(plane: Plane, servers: Servers, tmp_path: Path, t: Tenants) -> None:  # noqa: F811
    await _served(plane, servers, "tpm-model", Timing(0.05, 0.0))
    plane.gateway.clock = Clock()
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a tpm={TPM}\n")
    a = t(A)

    async def one() -> int | None:
        try:
            got = await a.chat.completions.create(
                model="tpm-model", messages=HI, max_tokens=MAX_TOKENS
            )
        except openai.RateLimitError as e:
            assert "over its 100 tokens a minute (tpm=100)" in e.response.headers["x-llmgw-reason"]
            return None
        assert got.usage is not None
        return got.usage.total_tokens

    took = [n for n in await asyncio.gather(*(one() for _ in range(20))) if n is not None]
    # Admitted within the minute and one request's max_tokens (its prompt a few more).
    assert took and sum(took) <= TPM + MAX_TOKENS + 20, took


async def stream_as_string(plane: Plane, servers: Servers, tmp_path: Path, t: Tenants) -> None:  # noqa: F811
    s = await _served(plane, servers, "string-model")
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a tpm=100000\n")
    a = t(A)
    for value in ("true", 1, {"on": True}):
        with pytest.raises(openai.BadRequestError) as e:
            await a.chat.completions.create(
                model="string-model", messages=HI, max_tokens=5, extra_body={"stream": value}
            )
        body = e.value.body
        assert isinstance(body, dict) and body["param"] == "stream", body
        assert body["code"] == "invalid_type" and "`stream`" in body["message"]
    assert s.served == 0
    # `max_tokens` as a string would be a reservation of nothing: refused the same way.
    with pytest.raises(openai.BadRequestError) as e:
        await a.chat.completions.create(
            model="string-model", messages=HI, extra_body={"max_tokens": "100000"}
        )
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "max_tokens"
    # A boolean, or null (the server's default), is taken.
    got = await a.chat.completions.create(
        model="string-model", messages=HI, max_tokens=2, extra_body={"stream": None}
    )
    assert got.usage is not None and got.usage.completion_tokens == 2


async def stream_cut(plane: Plane, servers: Servers, tmp_path: Path, t: Tenants) -> None:  # noqa: F811
    # 20 tokens a second: the client has read its few chunks long before the answer ends.
    await _served(plane, servers, "cut-model", Timing(0.0, 20.0))
    plane.gateway.clock = Clock()
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a tpm=100000\n")
    key = next(iter(plane.gateway.keys._keys.values()))
    a = t(A)
    stream = await a.chat.completions.create(
        model="cut-model", messages=HI, max_tokens=200, stream=True
    )
    read = 0
    async for _ in stream:
        read += 1
        if read == 4:
            break
    await stream.close()
    reports = await _used(
        plane,
        "cut-model-1",
        lambda u: sum(d.requests or 0 for d in u) >= 1 and sum(d.tokens_out or 0 for d in u) > 0,
    )
    out = sum(d.tokens_out or 0 for d in reports)
    # What the client was sent: at least what it read, far from the 200 asked for.
    assert read <= out < 200, out
    assert sum(d.by_owner["team-a"].tokens_out for d in reports if "team-a" in d.by_owner) == out

    # The key's bucket was charged for it (its reservation settled to what it took).
    async def level() -> float:
        b = plane.gateway._buckets.get(key.digest, ratelimit.Buckets())
        return ratelimit.level(b.tokens, 100000, plane.gateway.clock())

    left = await wait_for(level, lambda v: v < 100000 - read, 5)
    assert left > 100000 - 200 - 50


async def waiting_room_flood(plane: Plane, servers: Servers, tmp_path: Path, t: Tenants) -> None:  # noqa: F811
    plane.gateway.room.per_model = 8
    await _model(plane, "flooded", target_inflight=1)
    plane.gateway.keys = _keys(tmp_path, f"{B} team-b\n{C} team-c\n")
    b, c = t(B), t(C)

    async def ask(client: openai.AsyncOpenAI) -> int | str:
        try:
            await client.chat.completions.create(model="flooded", messages=HI, max_tokens=1)
        except openai.RateLimitError as e:
            return str(e.response.headers["x-llmgw-reason"])
        return 200

    flood = [asyncio.create_task(ask(b)) for _ in range(8)]
    await wait_for(
        lambda: asyncio.sleep(0, plane.gateway.room.waiting("flooded")), lambda n: n == 8
    )
    # team-b at the whole line: one more of its own is refused, its share named.
    more = await ask(b)
    assert isinstance(more, str) and more.startswith("queue_full: the share of team-b"), more
    # team-c is let in: team-b's newest request makes room for it.
    mine = asyncio.create_task(ask(c))
    pushed = await asyncio.wait_for(asyncio.shield(flood[-1]), 5)
    assert isinstance(pushed, str) and "the share of team-b" in pushed, pushed
    await wait_for(
        lambda: asyncio.sleep(0, plane.gateway.room.waiting("flooded")), lambda n: n == 8
    )
    s = await servers("flooded-1", "flooded")
    await plane.ready("flooded-1", "flooded", s.endpoint)
    assert await asyncio.wait_for(mine, 10) == 200
    assert [await x for x in flood[:-1]] == [200] * 7


async def foreign_model(plane: Plane, servers: Servers, tmp_path: Path, t: Tenants) -> None:  # noqa: F811
    await plane.say(
        ev.QuotaSet(
            owners=(
                ev.OwnerQuota(name="team-a"),
                ev.OwnerQuota(name="team-b"),
                ev.OwnerQuota(name="team-b-vision", parent="team-b"),
            )
        )
    )
    await _model(plane, "b-critical", owner="team-b-vision", cls="critical")
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a\n{B} team-b\n")
    # A short timeout: a request held for the model would be answered within it.
    a, b = t(A, timeout=2), t(B)
    demanded = plane.gateway.counts.demanded
    with pytest.raises(openai.NotFoundError) as theirs:
        await a.chat.completions.create(model="b-critical", messages=HI, max_tokens=1)
    with pytest.raises(openai.NotFoundError) as nobodys:
        await a.chat.completions.create(model="b-critica", messages=HI, max_tokens=1)
    # The same answer as for a name nobody declared, and no did-you-mean to it.
    assert theirs.value.body == {
        **nobodys.value.body,  # type: ignore[dict-item]
        "message": "the model 'b-critical' does not exist",
    }
    assert nobodys.value.body["message"] == "the model 'b-critica' does not exist"  # type: ignore[index]
    # Not woken: nothing waits, nothing demanded.
    assert plane.gateway.room.waiting("b-critical") == 0
    assert plane.gateway.counts.demanded == demanded
    # A model its owner declares shared is everyone's.
    await _served(plane, servers, "b-shared", owner="team-b")
    await plane.say(
        ev.ModelDeclared(
            name="b-shared",
            owner="team-b",
            min=0,
            shared=True,
            profiles=(ev.ProfileSpec(name="p", gpus=1),),
        )
    )
    listed = {m.id for m in (await a.models.list()).data}
    assert "b-critical" not in listed and "b-shared" in listed
    # Its owner's subtree sees it; a shared model is everyone's.
    assert "b-critical" in {m.id for m in (await b.models.list()).data}
    got = await a.chat.completions.create(model="b-shared", messages=HI, max_tokens=1)
    assert got.choices


ATTACKS: dict[str, Callable[[Plane, Servers, Path, Tenants], Awaitable[None]]] = {
    "tpm-concurrent": tpm_concurrent,
    "stream-as-string": stream_as_string,
    "stream-cut": stream_cut,
    "waiting-room-flood": waiting_room_flood,
    "foreign-model": foreign_model,
}


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_a_tenant_takes_no_more_than_its_key_gives(
    attack: str,
    plane: Plane,  # noqa: F811
    servers: Servers,  # noqa: F811
    tmp_path: Path,
    tenants: Tenants,
) -> None:
    await ATTACKS[attack](plane, servers, tmp_path, tenants)
    # The gateway still serves, with no key, after each.
    plane.gateway.keys = None
    s = await _served(plane, servers, f"after-{attack}")
    status, _, body = await plane.chat(f"after-{attack}", max_tokens=1)
    assert status == 200 and json.loads(body)["choices"], body
    assert s.served == 1
