"""Tenants through the official `openai` package: a key's owner in its request's span, in
replica.used (`by_owner`) and in /metrics; a key over its rpm or tpm refused with 429,
Retry-After and a reason in words (the package raises RateLimitError), and admitted again
once its clock says the minute paid it back; a stream's tokens counted whether its client
asked for the usage chunk or not, and the client that did not sees none. The gateway
runs in this process on the module's broker; its limits' clock is the test's."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from schemas import events as ev
from services.agent.responder import Responder
from services.gateway.errors import GatewayError
from services.gateway.keys import Keys
from services.gateway.server import Gateway
from tests.agent.helpers import node_events, wait_for
from tests.bus.test_bus_publish import spans  # noqa: F401  (the fixture)
from tests.gateway.conftest import Plane

pytestmark = [pytest.mark.timeout(30), pytest.mark.module_broker]

A = "sk-team-a-0123456789abcdef"
B = "sk-team-b-0123456789abcdef"
C = "sk-equipe-0123456789abcdef"
HI = [{"role": "user", "content": "hi"}]


def _keys(tmp_path: Path, text: str) -> Keys:
    p = tmp_path / "keys"
    p.write_text(text)
    p.chmod(0o600)
    return Keys.load(p)


@pytest.fixture
async def client(plane: Plane) -> AsyncIterator[Callable[[str], openai.AsyncOpenAI]]:
    """`client(KEY)`: the openai package's client of the gateway with that key, no retries
    (a 429 raises at once), closed at the end."""
    made: list[openai.AsyncOpenAI] = []

    def make(key: str) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=f"{plane.url}/v1", api_key=key, max_retries=0, timeout=10)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


Client = Callable[[str], openai.AsyncOpenAI]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _served(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], model: str, replica: str
) -> Responder:
    await plane.model(model)
    s = await servers(replica, model)
    await plane.ready(replica, model, s.endpoint)
    return s


async def _used(plane: Plane, replica: str, requests: int) -> list[ev.ReplicaUsed]:
    async def got() -> list[ev.ReplicaUsed]:
        es = await node_events(plane.gateway.js, plane.node)
        return [
            e.data for e in es if isinstance(e, ev.ReplicaUsedEvent) and e.data.replica == replica
        ]

    return await wait_for(got, lambda u: sum(d.requests or 0 for d in u) >= requests, 5)


async def test_a_key_over_its_rpm_is_429_with_retry_after_until_its_minute_pays_it_back(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], tmp_path: Path, client: Client
) -> None:
    await _served(plane, servers, "limited", "lim-1")
    clock = Clock()
    plane.gateway.clock = clock
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a rpm=2\n{B} team-b\n{C} équipe rpm=0\n")
    a, b = client(A), client(B)
    for _ in range(2):
        await a.chat.completions.create(model="limited", messages=HI, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        await a.chat.completions.create(model="limited", messages=HI, max_tokens=1)
    h = e.value.response.headers
    # Two a minute: one back every 30 s, none yet.
    assert h["retry-after"] == "30"
    assert h["x-llmgw-reason"] == (
        "rate_limit_exceeded: the key of team-a is over its 2 requests a minute (rpm=2); "
        "try again in 30s"
    )
    err = e.value.body
    assert isinstance(err, dict) and err["code"] == "rate_limit_exceeded"
    assert err["type"] == "requests" and err["message"].startswith("rate limit: the key of team-a")
    # The client is not told where the keys file is, nor which line of it is its key's.
    assert str(tmp_path) not in err["message"] and "keys:" not in err["message"]
    # An owner's name in other letters is escaped in the header, kept in the message.
    with pytest.raises(openai.RateLimitError) as e:
        await client(C).chat.completions.create(model="limited", messages=HI, max_tokens=1)
    assert e.value.response.headers["x-llmgw-reason"] == (
        "rate_limit_exceeded: the key of \\xe9quipe is over its 0 requests a minute (rpm=0); "
        "it may send none"
    )
    assert e.value.response.headers["retry-after"] == "3600"
    assert isinstance(e.value.body, dict) and "équipe" in e.value.body["message"]
    # Another key is its own: no limit on team-b's.
    for _ in range(5):
        await b.chat.completions.create(model="limited", messages=HI, max_tokens=1)
    # A refused request took nothing: 29 s on, still refused; at 30 s, admitted once.
    clock.now += 29
    with pytest.raises(openai.RateLimitError):
        await a.chat.completions.create(model="limited", messages=HI, max_tokens=1)
    clock.now += 1
    await a.chat.completions.create(model="limited", messages=HI, max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        await a.chat.completions.create(model="limited", messages=HI, max_tokens=1)
    async with plane.http.get(f"{plane.url}/metrics") as r:
        text = await r.text()
    assert 'llmgw_gateway_rate_limited_total{limit="rpm",owner="team-a"} 3.0' in text
    assert 'llmgw_gateway_owner_requests_total{owner="team-a",status="429"} 3.0' in text
    assert 'llmgw_gateway_owner_requests_total{owner="team-b",status="200"} 5.0' in text
    # Refused before its body was read, the model was never known: not "(unknown)", a
    # name nobody declared, but "(not read)".
    assert 'llmgw_gateway_requests_total{model="(not read)",status="429"} 4.0' in text
    assert 'model="(unknown)",status="429"' not in text


async def test_a_key_over_its_tpm_waits_until_the_refill_has_paid_for_its_tokens(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], tmp_path: Path, client: Client
) -> None:
    await _served(plane, servers, "tokened", "tok-1")
    clock = Clock()
    plane.gateway.clock = clock
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a tpm=60\n")
    a = client(A)
    # One answer of 100 completion tokens (and a few of prompt): past the minute's 60.
    got = await a.chat.completions.create(model="tokened", messages=HI, max_tokens=100)
    assert got.usage is not None
    spent = got.usage.prompt_tokens + got.usage.completion_tokens
    with pytest.raises(openai.RateLimitError) as e:
        await a.chat.completions.create(model="tokened", messages=HI, max_tokens=1)
    # 60 tokens a minute is one a second: the debt and what the next request may take
    # (its max_tokens and its prompt, estimated from its body: a quarter of its bytes).
    body = json.dumps({"messages": HI, "model": "tokened", "max_tokens": 1}, separators=(",", ":"))
    retry = int(e.value.response.headers["retry-after"])
    assert spent - 60 + 1 < retry <= spent - 60 + 1 + len(body) // 4
    assert "over its 60 tokens a minute (tpm=60)" in e.value.response.headers["x-llmgw-reason"]
    assert isinstance(e.value.body, dict) and e.value.body["type"] == "tokens"
    clock.now += retry - 1
    with pytest.raises(openai.RateLimitError):
        await a.chat.completions.create(model="tokened", messages=HI, max_tokens=1)
    clock.now += 1
    await a.chat.completions.create(model="tokened", messages=HI, max_tokens=1)
    # Its tpm is known once its body is read: the refusals count under the model.
    async with plane.http.get(f"{plane.url}/metrics") as r:
        text = await r.text()
    assert 'llmgw_gateway_requests_total{model="tokened",status="429"} 2.0' in text


async def test_the_owner_is_in_the_span_in_replica_used_and_in_metrics(
    plane: Plane,
    servers: Callable[..., Awaitable[Responder]],
    tmp_path: Path,
    client: Client,
    spans: Any,  # noqa: F811
) -> None:
    await _served(plane, servers, "owned", "own-1")
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a\n{B} team-b\n")
    a, b = client(A), client(B)
    out = {"team-a": 0, "team-b": 0}
    for client, owner, n in ((a, "team-a", 2), (b, "team-b", 1)):
        for _ in range(n):
            got = await client.chat.completions.create(model="owned", messages=HI, max_tokens=3)
            assert got.usage is not None
            out[owner] += got.usage.completion_tokens
    reports = await _used(plane, "own-1", 3)
    by: dict[str, list[int]] = {}
    for d in reports:
        for owner, u in d.by_owner.items():
            n = by.setdefault(owner, [0, 0])
            n[0] += u.requests
            n[1] += u.tokens_out
    assert by == {"team-a": [2, out["team-a"]], "team-b": [1, out["team-b"]]}
    assert sum(d.tokens_out or 0 for d in reports) == sum(out.values())
    mine = [s for s in spans.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    assert [dict(s.attributes or {}).get("llmgw.owner") for s in mine] == [
        "team-a",
        "team-a",
        "team-b",
    ]
    async with plane.http.get(f"{plane.url}/metrics") as r:
        text = await r.text()
    assert 'llmgw_gateway_owner_requests_total{owner="team-a",status="200"} 2.0' in text
    assert (
        f'llmgw_gateway_owner_tokens_total{{direction="out",owner="team-b"}} {out["team-b"]}.0'
        in text
    )


async def test_a_streams_tokens_count_whether_its_client_asked_for_the_usage_chunk_or_not(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], tmp_path: Path, client: Client
) -> None:
    await _served(plane, servers, "streamed", "st-1")
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a\n")
    a = client(A)
    asked = await a.chat.completions.create(
        model="streamed",
        messages=HI,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in asked]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3
    # A client that did not ask sees no usage chunk: every chunk has its choice.
    plain = await a.completions.create(model="streamed", prompt="x", max_tokens=4, stream=True)
    chunks2 = [c async for c in plain]
    assert chunks2 and all(c.choices and c.usage is None for c in chunks2)
    assert "".join(c.choices[0].text for c in chunks2).split() and len(chunks2) == 4 + 1
    reports = await _used(plane, "st-1", 2)
    assert sum(d.tokens_out or 0 for d in reports) == 3 + 4
    assert sum(d.by_owner["team-a"].tokens_out for d in reports if "team-a" in d.by_owner) == 7


async def test_a_key_whose_owner_is_not_in_the_folded_quota_tree_stops_the_gateway(
    plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await plane.say(
        ev.QuotaSet(owners=(ev.OwnerQuota(name="research"), ev.OwnerQuota(name="team-a")))
    )
    keys = _keys(tmp_path, f"# keys\n{A} team-a\n{B} reserch rpm=5\n")
    gw = Gateway(plane.gateway.js, listen="127.0.0.1:0", keys=keys)
    with pytest.raises(GatewayError) as e:
        await asyncio.wait_for(gw.run(asyncio.Event()), 20)
    assert str(e.value) == (
        f"{keys.path}:3: `reserch` is not an owner in the quota tree: did you mean "
        "`research`? (its requests would be counted for an owner nobody declared: fix the "
        "owner, or add it to the quota tree)"
    )
    assert A not in str(e.value) and B not in str(e.value)
    # The owner of a declared model is one the operator declared too: then it starts.
    await plane.say(
        ev.ModelDeclared(
            name="research-model",
            min=0,
            owner="reserch",
            profiles=(ev.ProfileSpec(name="p", gpus=1),),
        )
    )
    ready, stop = asyncio.Event(), asyncio.Event()
    gw = Gateway(plane.gateway.js, listen="127.0.0.1:0", keys=keys)
    task = asyncio.create_task(gw.run(stop, on_ready=lambda _: ready.set()))
    await asyncio.wait_for(ready.wait(), 20)
    # A tree set once it serves that leaves an owner out is said once in its log.
    with caplog.at_level(logging.WARNING, logger="llmgw.gateway"):
        await plane.say(ev.QuotaSet(owners=(ev.OwnerQuota(name="research"),)))

        async def said() -> list[str]:
            return [r.getMessage() for r in caplog.records if "quota tree" in r.getMessage()]

        got = await wait_for(said, bool, 5)
    assert got == [
        f"gateway: {keys.path}:2: `team-a` is not an owner in the quota tree (its requests "
        "would be counted for an owner nobody declared: fix the owner, or add it to the "
        "quota tree)"
    ]
    stop.set()
    await asyncio.wait_for(task, 10)


async def test_with_stream_usage_off_a_stream_passes_untouched_and_counts_its_chunks(
    plane: Plane, servers: Callable[..., Awaitable[Responder]]
) -> None:
    await _served(plane, servers, "untouched", "un-1")
    plane.gateway.stream_usage = False
    body = {"model": "untouched", "prompt": "p", "stream": True, "max_tokens": 3}
    raw = json.dumps(body).encode()
    status, _, through = await plane.post("/v1/completions", raw=raw)
    assert status == 200 and b'"usage"' not in through
    reports = await _used(plane, "un-1", 1)
    # No usage chunk: a chunk a token (3, and the one that ends the stream), the prompt
    # estimated from the body.
    assert (
        sum(d.requests or 0 for d in reports),
        sum(d.tokens_in or 0 for d in reports),
        sum(d.tokens_out or 0 for d in reports),
    ) == (1, len(raw) // 4, 3 + 1)


async def _raw(url: str, head: bytes, body: bytes) -> bytes:
    """`head` and `body` written to the gateway at `url` on a connection of their own (the
    body only if the answer has not come first, within 2 s); its answer's status line."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        try:
            line = await asyncio.wait_for(reader.readline(), 2)
        except TimeoutError:
            writer.write(body)
            line = await asyncio.wait_for(reader.readline(), 5)
        return line
    finally:
        writer.close()


async def test_a_key_over_its_rpm_is_429_however_its_body_comes(
    plane: Plane, servers: Callable[..., Awaitable[Responder]], tmp_path: Path, client: Client
) -> None:
    """Over its rpm, a key is refused before its body is read when the body is still to
    come, and when it came whole with its head, before anything its body would be refused
    for (JSON that does not parse): 429 either way, counted under no model."""
    await _served(plane, servers, "limited", "lim-2")
    plane.gateway.clock = Clock()
    plane.gateway.keys = _keys(tmp_path, f"{A} team-a rpm=1\n")
    await client(A).chat.completions.create(model="limited", messages=HI, max_tokens=1)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {A}\r\n"
        "Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    )
    good = json.dumps({"model": "limited", "messages": HI}).encode()
    # The body held back: answered before it is sent.
    line = await _raw(plane.url, head.replace("{n}", str(len(good))).encode(), good)
    assert line.startswith(b"HTTP/1.1 429 ")
    # A body that does not parse, whole with its head: its rpm first, not a 400.
    bad = b'{"model": "limited", "messages": ['
    line = await _raw(plane.url, head.replace("{n}", str(len(bad))).encode() + bad, b"")
    assert line.startswith(b"HTTP/1.1 429 ")
    # A good body whole with its head: 429 as well.
    line = await _raw(plane.url, head.replace("{n}", str(len(good))).encode() + good, b"")
    assert line.startswith(b"HTTP/1.1 429 ")
    async with plane.http.get(f"{plane.url}/metrics") as r:
        text = await r.text()
    assert 'llmgw_gateway_requests_total{model="(not read)",status="429"} 3.0' in text
    assert 'llmgw_gateway_rate_limited_total{limit="rpm",owner="team-a"} 3.0' in text
