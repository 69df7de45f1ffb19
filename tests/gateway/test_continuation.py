"""Streams that survive their replica, through a gateway in this process and the official
`openai` package: a stream its replica breaks midway (a reset, an end before `[DONE]`, an
error event, `finish_reason: "abort"`) goes on on another replica of its model, and the
client reads one answer under one id with one `[DONE]`, its usage, the replicas'
`replica.used` and its key's tokens those of an answer never broken; the kinds a
continuation would change (structured output, tools, n > 1, logprobs, best_of, a seed)
are cut as before; so is a stream past `--continuation-limit`. With no other replica it
waits for one; a replica whose drain is folded has its streams moved off it.

Every test runs twice: here with the gateway's fast path (`Continuations.fast`: a
stream read and written in the callback that read each chunk from the replica, its chunks
of text read only at a break), and in test_continuation_plain.py without it
(`--no-fast-path`: each chunk read whole in the request's coroutine), the plain path the
fast one is held equal to. Here its chunks of text are passed on by the compiled relay
(`--chunk-relay auto`, where it was built); test_continuation_relay.py runs them again on
the Python one.

The replicas are small aiohttp servers in the test that answer as vLLM does, one word a
token: `w0 w1 ... w11`, a continued request going on from the `wN` words it is given,
each token a moment after the one before (so that each comes in a read of its own).
Those made with `ids` give token ids when asked, as vLLM does (`wN` is the id N, a
prompt's words ids from 1000), and go on from a prompt of ids on `/v1/completions`: the
gateway continues their streams by token ids. The simulated server (services.agent.
responder) gives them too."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
from aiohttp import web

from schemas import events as ev
from services.core import continuation as rules
from services.gateway import front
from services.gateway.keys import Keys
from tests.agent.helpers import node_events, wait_for
from tests.bus.test_bus_publish import spans  # noqa: F401  (the fixture)
from tests.gateway.conftest import Plane
from tests.replay.test_explain_more import run
from tests.scenario import Scenario

pytestmark = [pytest.mark.timeout(30), pytest.mark.module_broker]

N = 12
FULL = "".join(f"w{i} " for i in range(N))
HI: list[Any] = [{"role": "user", "content": "say words"}]
PROMPT_TOKENS = 2
_W = re.compile(r"\bw\d+\b")
# PACE_S is the time between a replica's chunks.
PACE_S = 0.001


class Engine:
    """A replica that answers as vLLM does, one word a token; its first `cuts` answers
    break after `at` tokens, as `cut` says (`hold`: they wait there for ever)."""

    def __init__(
        self,
        name: str,
        created: int,
        cut: str | None,
        at: int,
        cuts: int,
        merge: int = 1,
        ids: bool = False,
    ) -> None:
        self.name, self.created = name, created
        self.cut, self.at, self.cuts = cut, at, cuts
        self.merge = merge
        self.ids = ids
        """Give token ids when asked, and read a prompt of them."""
        self.paths: list[str] = []
        """Tokens a chunk (vLLM merges what its client has not read yet)."""
        self.refuse = False
        """Answer 503 (a server that cannot take it)."""
        self.bodies: list[dict[str, Any]] = []
        self.gate: asyncio.Event | None = None
        """Set: its answers begin (their headers sent) only once it is set."""
        self.arrived = asyncio.Event()
        self.broke = asyncio.Event()
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.answer)
        app.router.add_post("/v1/completions", self.answer)
        # A client gone cancels its answer, as it does vLLM's.
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def _chunk(
        self,
        chat: bool,
        n: int,
        text: str | None,
        reason: str | None,
        usage: Any = None,
        ids: list[int] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> bytes:
        if chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if text == "":
                delta = {"role": "assistant", "content": ""}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
            kind = "text_completion"
            if prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
        choice["finish_reason"] = reason
        if ids is not None:
            choice["token_ids"] = ids
        doc: dict[str, Any] = {
            "id": f"cmpl-{self.name}-{n}",
            "object": kind,
            "created": self.created,
            "model": "m",
            "choices": [choice],
        }
        if usage is not None:
            doc["usage"] = usage
        if chat and prompt_ids is not None:
            doc["prompt_token_ids"] = prompt_ids
        return b"data: " + msgspec.json.encode(doc) + b"\n\n"

    def _usage(self, chat: bool, n: int, prompt: int, out: int) -> bytes:
        doc: dict[str, Any] = {
            "id": f"cmpl-{self.name}-{n}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": "m",
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": out,
                "total_tokens": prompt + out,
            },
        }
        return b"data: " + msgspec.json.encode(doc) + b"\n\n"

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.refuse:
            return web.Response(status=503, text="draining")
        n = len(self.bodies)
        self.paths.append(request.path)
        chat = request.path == rules.CHAT
        given = body.get("prompt")
        if self.ids and isinstance(given, list):
            # A prompt of token ids: the prompt's (from 1000), then the words' (wN is N).
            start, prompt = sum(1 for t in given if t < 1000), len(given)
        else:
            text = " ".join(m["content"] for m in body["messages"]) if chat else given
            start, prompt = len(_W.findall(text)), len(text.split())
        ids = self.ids and body.get("return_token_ids") is True
        prompt_ids = given if isinstance(given, list) else list(range(1000, 1000 + prompt))
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 10**6
        end = min(N, start + limit)
        options = body.get("stream_options") or {}
        usage = options.get("include_usage") is True
        running = options.get("continuous_usage_stats") is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = prompt_ids if ids else None
        if chat:
            await resp.write(self._chunk(chat, n, "", None, prompt_ids=first))
            first = None
        breaking = self.cut is not None and n <= self.cuts
        out = 0
        for i in range(start, end, self.merge):
            if breaking and out >= self.at:
                return await self._break(request, resp, chat, n, prompt, out, usage)
            got = list(range(i, min(i + self.merge, end)))
            words = "".join(f"w{k} " for k in got)
            out += len(got)
            so_far = {"prompt_tokens": prompt, "completion_tokens": out} if running else None
            chunk = self._chunk(chat, n, words, None, so_far, got if ids else None, first)
            await resp.write(chunk)
            await asyncio.sleep(PACE_S)
            first = None
        await resp.write(self._chunk(chat, n, None, "stop" if end == N else "length"))
        if usage:
            await resp.write(self._usage(chat, n, prompt, out))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _break(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        chat: bool,
        n: int,
        prompt: int,
        out: int,
        usage: bool,
    ) -> web.StreamResponse:
        self.broke.set()
        if self.cut == "hold":
            await asyncio.Event().wait()
        if self.cut == "reset":
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.cut == "error":
            await resp.write(b'data: {"error": {"message": "boom", "type": "x", "code": 500}}\n\n')
            await resp.write(b"data: [DONE]\n\n")
        elif self.cut == "abort":
            await resp.write(self._chunk(chat, n, None, "abort"))
            if usage:
                await resp.write(self._usage(chat, n, prompt, out))
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


Engines = Callable[..., Awaitable[Engine]]


@pytest.fixture
async def engines() -> AsyncIterator[Engines]:
    made: list[Engine] = []

    async def make(
        name: str,
        created: int = 1000,
        cut: str | None = None,
        at: int = 3,
        cuts: int = 1,
        merge: int = 1,
        ids: bool = False,
    ) -> Engine:
        e = Engine(name, created, cut, at, cuts, merge, ids)
        await e.start()
        made.append(e)
        return e

    yield make
    for e in made:
        assert e.runner is not None
        await e.runner.cleanup()


@pytest.fixture
async def client(plane: Plane) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=f"{plane.url}/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    await c.close()


async def _two(
    plane: Plane, engines: Engines, model: str, cut: str | None, **kw: Any
) -> tuple[Engine, Engine]:
    """A model with two replicas, `-a` picked first (ties go to the lower id), which
    breaks its first answer as `cut` says; `-b` answers whole."""
    ids = kw.pop("ids", False)
    a = await engines(f"{model}-a", 1000, cut, ids=ids, **kw)
    b = await engines(f"{model}-b", 2000, ids=ids)
    await plane.model(model)
    await plane.ready(f"{model}-a", model, a.url)
    await plane.ready(f"{model}-b", model, b.url)
    return a, b


async def _chat(client: openai.AsyncOpenAI, model: str, **kw: Any) -> list[Any]:
    create: Any = client.chat.completions.create
    stream = await create(model=model, messages=HI, stream=True, **kw)
    return [c async for c in stream]


def _text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# ------------------------------------------------------------------------ continued


@pytest.mark.parametrize("cut", ["reset", "eof", "error", "abort"])
async def test_a_chat_stream_broken_midway_goes_on_on_another_replica_as_one_answer(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI, cut: str
) -> None:
    model = f"co-{cut}"
    a, b = await _two(plane, engines, model, cut)
    chunks = await _chat(client, model, max_tokens=20, stream_options={"include_usage": True})
    assert _text(chunks) == FULL
    # One answer: the first replica's id and created throughout, one role delta.
    assert {c.id for c in chunks} == {f"cmpl-{model}-a-1"}
    assert {c.created for c in chunks} == {1000}
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # The usage of an answer never broken: the prompt once, every token generated.
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == PROMPT_TOKENS
    assert chunks[-1].usage.completion_tokens == N
    assert chunks[-1].usage.total_tokens == PROMPT_TOKENS + N
    # The other replica was asked to go on with the turn kept open, for what was left.
    (resumed,) = b.bodies
    assert resumed["messages"] == [*HI, {"role": "assistant", "content": "w0 w1 w2 "}]
    assert resumed["continue_final_message"] is True
    assert resumed["add_generation_prompt"] is False
    assert resumed["max_tokens"] == 20 - 3
    assert len(a.bodies) == 1


@pytest.mark.parametrize("cut", ["reset", "abort"])
async def test_a_completion_stream_goes_on_with_the_prompt_and_the_text_so_far(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI, cut: str
) -> None:
    model = f"cc-{cut}"
    _, b = await _two(plane, engines, model, cut, at=5)
    stream = await client.completions.create(
        model=model, prompt="say words ", max_tokens=N, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == FULL
    assert {c.id for c in chunks} == {f"cmpl-{model}-a-1"}
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The client did not ask for the usage chunk: it sees none.
    assert all(c.usage is None for c in chunks)
    (resumed,) = b.bodies
    assert resumed["prompt"] == "say words " + "".join(f"w{i} " for i in range(5))
    assert resumed["max_tokens"] == N - 5


async def test_a_vllm_models_stream_is_counted_by_the_servers_running_usage(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    # A server that sends two tokens a chunk: the chunks alone would count 2 of the 4
    # tokens sent, and the next replica would write 2 past max_tokens.
    a = await engines("cv-a", 1000, "reset", at=4, merge=2)
    b = await engines("cv-b", 2000, merge=2)
    await plane.say(
        ev.ModelDeclared(
            name="cv",
            min=0,
            profiles=(ev.ProfileSpec(name="p", gpus=1),),
            runtime=ev.ModelRuntime(engine="vllm"),
        )
    )
    await plane.ready("cv-a", "cv", a.url)
    await plane.ready("cv-b", "cv", b.url)
    chunks = await _chat(client, "cv", max_tokens=10)
    assert _text(chunks) == "".join(f"w{i} " for i in range(10))
    # The gateway asked for the running usage and took it out of what the client got.
    assert a.bodies[0]["stream_options"]["continuous_usage_stats"] is True
    assert all(c.usage is None for c in chunks)
    assert b.bodies[0]["max_tokens"] == 10 - 4


async def test_a_replica_that_refuses_the_resumed_request_is_passed_over_for_another(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    _, b = await _two(plane, engines, "cr", "reset")
    b.refuse = True
    c = await engines("cr-c", 3000)
    await plane.ready("cr-c", "cr", c.url)
    assert _text(await _chat(client, "cr", max_tokens=20)) == FULL
    assert len(b.bodies) == 1 and len(c.bodies) == 1
    assert c.bodies[0]["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2 "}


async def test_a_stream_whose_limit_is_spent_at_its_break_ends_there(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    _, b = await _two(plane, engines, "co-spent", "reset")
    chunks = await _chat(client, "co-spent", max_tokens=3)
    assert _text(chunks) == "w0 w1 w2 "
    assert chunks[-1].choices[0].finish_reason == "length"
    assert b.bodies == []


# ------------------------------------------------------------------------ by token ids


@pytest.mark.parametrize("cut", ["reset", "abort"])
async def test_a_chat_stream_goes_on_by_token_ids_where_the_engine_gives_them(
    plane: Plane,
    engines: Engines,
    client: openai.AsyncOpenAI,
    spans: Any,  # noqa: F811
    cut: str,
) -> None:
    model = f"ci-{cut}"
    a, b = await _two(plane, engines, model, cut, ids=True)
    chunks = await _chat(client, model, max_tokens=20, stream_options={"include_usage": True})
    assert _text(chunks) == FULL
    # The first replica was asked for the ids on the client's behalf.
    assert a.bodies[0]["return_token_ids"] is True
    # The other went on from the prompt's ids and the 3 generated, on /v1/completions,
    # for what was left: what it read is what the first one had read.
    assert b.paths == [rules.COMPLETIONS]
    (resumed,) = b.bodies
    assert resumed["prompt"] == [1000, 1001, 0, 1, 2]
    assert resumed["max_tokens"] == 20 - 3
    assert "messages" not in resumed and "continue_final_message" not in resumed
    # The client reads one chat answer: chat chunks under the first id, no ids in them.
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert {c.id for c in chunks} == {f"cmpl-{model}-a-1"}
    assert {c.created for c in chunks} == {1000}
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    # (Null, as vLLM writes them unasked.)
    for c in chunks:
        assert (c.model_extra or {}).get("prompt_token_ids") is None
        assert all((x.model_extra or {}).get("token_ids") is None for x in c.choices)
    assert plane.gateway.continuations.moved_by == {"token_ids": 1}

    async def ended() -> Any:
        return spans.get_finished_spans()

    await wait_for(ended, lambda s: any(x.name.startswith("POST") for x in s), 5)
    assert _span_of(spans, model)["llmgw.moved_by"] == "token_ids"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # The usage of an answer never broken: the resent ids are no one's output.
    assert chunks[-1].usage.prompt_tokens == PROMPT_TOKENS
    assert chunks[-1].usage.completion_tokens == N


async def test_a_client_that_asks_for_token_ids_gets_them_across_the_move(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    await _two(plane, engines, "ck", "reset", ids=True)
    chunks = await _chat(client, "ck", max_tokens=20, extra_body={"return_token_ids": True})
    assert _text(chunks) == FULL
    assert (chunks[0].model_extra or {})["prompt_token_ids"] == [1000, 1001]
    assert all((c.model_extra or {}).get("prompt_token_ids") is None for c in chunks[1:])
    got = [
        t
        for c in chunks
        if c.choices
        for t in (c.choices[0].model_extra or {}).get("token_ids") or ()
    ]
    assert got == list(range(N))


async def test_a_completion_stream_goes_on_by_token_ids(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    _, b = await _two(plane, engines, "cq", "reset", at=5, ids=True)
    stream = await client.completions.create(
        model="cq", prompt="say words ", max_tokens=N, stream=True
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == FULL
    assert {c.id for c in chunks} == {"cmpl-cq-a-1"}
    assert all(
        (c.choices[0].model_extra or {}).get("token_ids") is None for c in chunks if c.choices
    )
    (resumed,) = b.bodies
    assert resumed["prompt"] == [1000, 1001, 0, 1, 2, 3, 4]
    assert resumed["max_tokens"] == N - 5


async def test_a_chat_without_a_token_limit_goes_on_by_text(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    # Its limit is the model's length, which a completion by ids cannot be told.
    _, b = await _two(plane, engines, "cn", "reset", ids=True)
    assert _text(await _chat(client, "cn")) == FULL
    assert b.paths == [rules.CHAT]
    assert b.bodies[0]["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2 "}
    assert plane.gateway.continuations.moved_by == {"text": 1}


async def test_a_simulated_replicas_stream_moved_off_its_drain_is_the_unbroken_answer(
    plane: Plane, client: openai.AsyncOpenAI
) -> None:
    from services.agent.responder import Responder, Timing

    plane.gateway.continuations.settle_s = 0.05
    timing = Timing(ttft_s=0.0, tps=100.0)
    made = [Responder(f"cs-{x}", "cs", timing) for x in ("a", "b", "c")]
    for r in made:
        await r.start()
    try:
        await plane.model("cs")
        await plane.ready("cs-c", "cs", made[2].endpoint)
        ask = {"max_tokens": 40, "stream_options": {"include_usage": True}}
        unbroken = await _chat(client, "cs", **ask)
        await plane.drain("cs-c", "cs")
        await plane.ready("cs-a", "cs", made[0].endpoint)
        await plane.ready("cs-b", "cs", made[1].endpoint)
        answer = asyncio.create_task(_chat(client, "cs", **ask))
        await wait_for(_async(lambda: made[0].active), lambda n: n == 1, 5)
        await plane.drain("cs-a", "cs")
        chunks = await answer
    finally:
        for r in made:
            await r.close()
    # Moved by token ids: the very words of the unbroken answer, its usage.
    assert plane.gateway.continuations.moved == {"cs-a": 1}
    assert made[1].served == 1
    assert _text(chunks) == _text(unbroken)
    assert chunks[-1].usage.prompt_tokens == unbroken[-1].usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == unbroken[-1].usage.completion_tokens == 40
    assert len({c.id for c in chunks}) == 1


def _async(f: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    async def g() -> Any:
        return f()

    return g


# ------------------------------------------------------------------------ usage


def _used_of(es: list[ev.Event], rid: str) -> tuple[int, int, int]:
    us = [e.data for e in es if isinstance(e, ev.ReplicaUsedEvent) and e.data.replica == rid]
    return (
        sum(u.requests or 0 for u in us),
        sum(u.tokens_in or 0 for u in us),
        sum(u.tokens_out or 0 for u in us),
    )


@pytest.mark.parametrize("ids", [False, True], ids=["text", "token_ids"])
async def test_a_continued_streams_usage_is_an_unbroken_ones(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI, tmp_path: Path, ids: bool
) -> None:
    m = "cui" if ids else "cu"
    key = "sk-team-a-0123456789abcdef"
    p = tmp_path / "keys"
    p.write_text(f"{key} team-a tpm=1000000\n")
    p.chmod(0o600)
    plane.gateway.keys = Keys.load(p)
    plane.gateway.clock = lambda: 0.0
    keyed = openai.AsyncOpenAI(base_url=f"{plane.url}/v1", api_key=key, max_retries=0, timeout=10)
    whole = await engines(f"{m}-whole", 1000, ids=ids)
    await plane.model(f"{m}-plain")
    await plane.ready(f"{m}-whole", f"{m}-plain", whole.url)
    await _two(plane, engines, m, "reset", at=4, cuts=2, ids=ids)
    try:
        # Without include_usage (the gateway asks, and strips the chunk) and with it.
        for options in ({}, {"stream_options": {"include_usage": True}}):
            plane.gateway.admission.buckets.clear()
            assert _text(await _chat(keyed, f"{m}-plain", max_tokens=20, **options)) == FULL
            unbroken = dict(plane.gateway.admission.buckets)
            plane.gateway.admission.buckets.clear()
            assert _text(await _chat(keyed, m, max_tokens=20, **options)) == FULL
            # The key's tokens: what an unbroken answer took.
            assert plane.gateway.admission.buckets == unbroken
    finally:
        await keyed.close()
    assert plane.gateway.continuations.moved_by == {"token_ids" if ids else "text": 2}

    async def used() -> list[ev.Event]:
        return await node_events(plane.gateway.js, plane.node)

    def told(es: list[ev.Event]) -> bool:
        # Each replica's report is an event of its own, published in turn: all three read.
        return (
            _used_of(es, f"{m}-b")[2] == 2 * (N - 4)
            and _used_of(es, f"{m}-whole")[0] == 2
            and _used_of(es, f"{m}-a")[0] == 2
        )

    es = await wait_for(used, told, 10)
    plain = _used_of(es, f"{m}-whole")
    assert plain == (2, 2 * PROMPT_TOKENS, 2 * N)
    # Each replica its part; together, what the unbroken answers took.
    assert _used_of(es, f"{m}-a") == (2, 2 * PROMPT_TOKENS, 2 * 4)
    assert _used_of(es, f"{m}-b") == (0, 0, 2 * (N - 4))
    parts = [_used_of(es, r) for r in (f"{m}-a", f"{m}-b")]
    assert tuple(map(sum, zip(*parts, strict=True))) == plain


# ------------------------------------------------------------------------ never continued


def _span_of(exporter: Any, model: str) -> dict[str, Any]:
    for s in exporter.get_finished_spans():
        attrs = dict(s.attributes or {})
        if attrs.get("gen_ai.request.model") == model:
            return attrs
    raise AssertionError(f"no span of {model}")


CUT = (openai.APIError, ConnectionError, OSError)

EXCLUDED: list[tuple[str, dict[str, Any]]] = [
    ("structured_output", {"response_format": {"type": "json_object"}}),
    ("structured_output", {"extra_body": {"guided_json": {"type": "object"}}}),
    ("structured_output", {"extra_body": {"structured_outputs": {"regex": "w.*"}}}),
    (
        "tools",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ]
        },
    ),
    ("n", {"n": 2}),
    ("logprobs", {"logprobs": True, "top_logprobs": 2}),
    ("seed", {"seed": 7}),
]


@pytest.mark.parametrize("i", range(len(EXCLUDED)), ids=[w for w, _ in EXCLUDED])
async def test_a_stream_a_continuation_would_change_is_cut_as_before(
    plane: Plane,
    engines: Engines,
    client: openai.AsyncOpenAI,
    spans: Any,  # noqa: F811
    i: int,
) -> None:
    why, extra = EXCLUDED[i]
    model = f"cx-{i}"
    _, b = await _two(plane, engines, model, "reset")
    got: list[Any] = []
    create: Any = client.chat.completions.create
    with pytest.raises(CUT):
        async for c in await create(model=model, messages=HI, stream=True, max_tokens=20, **extra):
            got.append(c)
    assert _text(got) == "w0 w1 w2 "
    assert b.bodies == []

    async def ended() -> Any:
        return spans.get_finished_spans()

    await wait_for(ended, lambda s: any(x.name.startswith("POST") for x in s), 5)
    assert _span_of(spans, model)["llmgw.continuation"] == why


async def test_best_of_is_never_continued(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    _, b = await _two(plane, engines, "cx-best", "reset")
    with pytest.raises(CUT):
        stream = await client.completions.create(
            model="cx-best", prompt="say words", stream=True, best_of=2
        )
        async for _ in stream:
            pass
    assert b.bodies == []


def test_the_kinds_never_continued() -> None:
    chat = {"model": "m", "messages": HI}
    assert rules.excluded(chat, rules.CHAT) is None
    for why, extra in EXCLUDED:
        body = {**chat, **extra.get("extra_body", {}), **extra}
        body.pop("extra_body", None)
        assert rules.excluded(body, rules.CHAT) == why
    assert rules.excluded({**chat, "logprobs": False}, rules.CHAT) is None
    assert rules.excluded({**chat, "response_format": {"type": "text"}}, rules.CHAT) is None
    assert rules.excluded({**chat, "n": 1, "seed": None, "tools": []}, rules.CHAT) is None
    plain = {"model": "m", "prompt": "p"}
    assert rules.excluded(plain, rules.COMPLETIONS) is None
    assert rules.excluded({**plain, "best_of": 2}, rules.COMPLETIONS) == "best_of"
    assert rules.excluded({**plain, "logprobs": 0}, rules.COMPLETIONS) is None
    assert rules.excluded({**plain, "logprobs": 1}, rules.COMPLETIONS) == "logprobs"
    assert rules.excluded({**plain, "echo": True}, rules.COMPLETIONS) == "echo"
    assert rules.excluded({**plain, "prompt": ["a", "b"]}, rules.COMPLETIONS) == "prompt"
    assert rules.excluded(plain, "/v1/embeddings") == "path"


# ------------------------------------------------------------------------ bounds


async def test_past_the_limit_the_client_sees_the_cut_of_before(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    plane.gateway.continuations.limit = 1
    a = await engines("cl-a", 1000, "reset")
    b = await engines("cl-b", 2000, "reset")
    await plane.model("cl")
    await plane.ready("cl-a", "cl", a.url)
    await plane.ready("cl-b", "cl", b.url)
    got: list[Any] = []
    create: Any = client.chat.completions.create
    with pytest.raises(CUT):
        async for c in await create(model="cl", messages=HI, stream=True, max_tokens=20):
            got.append(c)
    # One move (to b, which broke too), then the cut.
    assert _text(got) == "".join(f"w{i} " for i in range(6))
    assert len(b.bodies) == 1 and len(a.bodies) == 1

    # Each slot freed once: nothing left in flight on either.
    async def inflight() -> dict[str, int]:
        return dict(plane.gateway.router.inflight)

    await wait_for(inflight, lambda n: n.get("cl-a", 0) == 0 and n.get("cl-b", 0) == 0, 5)


async def test_with_continuation_off_a_break_is_a_cut(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    plane.gateway.continuations.limit = 0
    _, b = await _two(plane, engines, "c0", "reset")
    with pytest.raises(CUT):
        await _chat(client, "c0", max_tokens=20)
    assert b.bodies == []


async def test_with_no_other_replica_it_waits_for_one(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    plane.gateway.min_wait_s = 10
    a = await engines("cw-a", 1000, "reset")
    b = await engines("cw-b", 2000)
    await plane.model("cw")
    await plane.ready("cw-a", "cw", a.url)
    answer = asyncio.create_task(_chat(client, "cw", max_tokens=20))
    await a.broke.wait()

    async def inflight() -> dict[str, int]:
        return dict(plane.gateway.router.inflight)

    # While it waits, the broken replica's slot is free already.
    await wait_for(inflight, lambda n: n.get("cw-a", 0) == 0, 5)
    await plane.ready("cw-b", "cw", b.url)
    assert _text(await answer) == FULL
    assert len(b.bodies) == 1 and len(a.bodies) == 1


# ------------------------------------------------------------------------ a slow client


async def test_a_client_that_reads_slowly_gets_the_whole_stream_in_order(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that answers faster than its client reads: the gateway stops passing
    chunks on while the client is behind (and stops reading the replica past its
    buffer's bound), then goes on; the client gets every chunk once, in order."""
    chunks, size = 600, 16384  # past what the kernel buffers for a socket (4 MiB)
    texts = [f"{i:05d}" + "x" * (size - 5) for i in range(chunks)]

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, text in enumerate(texts):
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
            if i == chunks - 1:
                choice["finish_reason"] = "length"
            doc = {"id": "cmpl-slow", "created": 1, "model": "m", "choices": [choice]}
            await resp.write(b"data: " + msgspec.json.encode(doc) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    behind = 0
    drain = front._Conn.drain

    async def counted(conn: front._Conn) -> None:
        nonlocal behind
        behind += 1
        await drain(conn)

    monkeypatch.setattr(front._Conn, "drain", counted)
    try:
        await plane.model("slow")
        await plane.ready("slow-a", "slow", f"http://127.0.0.1:{runner.addresses[0][1]}")

        async def count() -> int:
            return behind

        data = await _read_slowly(plane.url, "slow", chunks, count)
    finally:
        await runner.cleanup()
    events = [e for e in data.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    got = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert got == texts  # the client was behind, and the stream went on after


async def _read_slowly(
    url: str, model: str, tokens: int, behind: Callable[[], Awaitable[int]]
) -> bytes:
    """A completion streamed to a client with a small receive buffer that reads nothing
    until the gateway is behind (`behind()` counted it), then a chunk at a time: the
    body, unchunked."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    except BaseException:
        sock.close()
        raise
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 22)
    try:
        body = json.dumps({"model": model, "prompt": "hi", "stream": True, "max_tokens": tokens})
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        await wait_for(behind, lambda n: n > 0)  # not reading: the gateway's writes back up
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
        data = b""
        while n := int(await reader.readuntil(b"\r\n"), 16):
            data += (await reader.readexactly(n + 2))[:-2]
        return data
    finally:
        writer.close()


# ------------------------------------------------------------------------ drains


async def test_a_drained_replicas_streams_move_after_the_settle_time(
    plane: Plane, engines: Engines, client: openai.AsyncOpenAI
) -> None:
    plane.gateway.continuations.settle_s = 0.05
    a, b = await _two(plane, engines, "cd", "hold")
    answer = asyncio.create_task(_chat(client, "cd", max_tokens=20))
    await a.broke.wait()
    assert plane.gateway.router.inflight.get("cd-a") == 1
    await plane.drain("cd-a", "cd")
    # The stream that would have held the drain for as long as it ran moves off it: the
    # drained replica has nothing in flight through the gateway, the client one answer.
    assert _text(await answer) == FULL
    assert plane.gateway.router.inflight.get("cd-a", 0) == 0
    assert plane.gateway.continuations.moved == {"cd-a": 1}
    assert len(b.bodies) == 1

    # The move is in the drained replica's `replica.used`, for `explain replica`.
    async def used() -> list[ev.Event]:
        return await node_events(plane.gateway.js, plane.node)

    def moved(es: list[ev.Event]) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in es:
            if isinstance(e, ev.ReplicaUsedEvent) and e.data.replica == "cd-a":
                for to, k in e.data.moved_to.items():
                    out[to] = out.get(to, 0) + k
        return out

    await wait_for(used, lambda es: moved(es) == {"cd-b": 1}, 10)


async def test_a_stream_that_begins_after_its_replicas_drain_is_folded_moves_too(
    plane: Plane,
    engines: Engines,
    client: openai.AsyncOpenAI,
    spans: Any,  # noqa: F811
) -> None:
    # Picked before the drain's fold, its answer begun after it: not among the streams
    # the fold moved, it moves after the settle time from its beginning (for the drain),
    # not when its replica stalls past the upstream timeout or ends, holding the drain
    # until then as if continuation were off.
    plane.gateway.continuations.settle_s = 0.05
    a = await engines("cg-a", 1000, "hold")
    b = await engines("cg-b", 2000)
    a.gate = asyncio.Event()
    await plane.model("cg")
    await plane.ready("cg-a", "cg", a.url)
    answer = asyncio.create_task(_chat(client, "cg", max_tokens=20))
    await asyncio.wait_for(a.arrived.wait(), 5)
    await plane.ready("cg-b", "cg", b.url)
    await plane.drain("cg-a", "cg")
    await wait_for(
        _async(lambda: plane.gateway.follower.view.replicas["cg-a"].drained_by),
        lambda d: d is not None,
        5,
    )
    a.gate.set()
    assert _text(await asyncio.wait_for(answer, 5)) == FULL
    assert plane.gateway.continuations.moved == {"cg-a": 1}
    assert plane.gateway.router.inflight.get("cg-a", 0) == 0
    assert len(b.bodies) == 1

    async def ended() -> Any:
        return spans.get_finished_spans()

    await wait_for(ended, lambda s: any(x.name.startswith("POST") for x in s), 5)
    assert _span_of(spans, "cg")["llmgw.moved_why"] == "drain"


def test_explain_replica_says_how_many_streams_moved_off_it_and_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = Scenario("2026-11-29T14:00:00Z")
    s.node("n1", "4xH100-80GB")
    s.model("chat", min=0, max=4, profiles=["one:1"])
    s.replica("chat-1", "chat", on=("n1", [0]), ready="-1h")
    for moved_to in ({"chat-2": 2}, {"chat-2": 1, "chat-3": 1}):
        s.at("+1m")
        used = ev.ReplicaUsed(
            replica="chat-1", at=s.now, requests=4, tokens_in=8, tokens_out=8, moved_to=moved_to
        )
        s.emit(used, node="n1")
    path = s.write(tmp_path / "used.jsonl")
    code, out, err = run(capsys, "explain", "replica", "chat-1", "--log", str(path))
    assert code == 0, err
    assert "  streams moved off it: 4 (3 to chat-2, 1 to chat-3)" in out.splitlines()
    code, out, err = run(capsys, "explain", "replica", "chat-1", "--log", str(path), "--json")
    assert json.loads(out)["used"]["moved_to"] == {"chat-2": 3, "chat-3": 1}


def test_the_limit_is_a_flag_of_every_gateway_and_a_negative_one_is_refused() -> None:
    from services.cli import app as cli
    from services.cli.gateway import gateway_config

    made = cli.build_parser()
    assert gateway_config(made.parse_args(["gateway"])).continuation_limit == rules.LIMIT == 3
    got = gateway_config(made.parse_args(["gateway", "--continuation-limit", "0"]))
    assert got.continuation_limit == 0
    up = made.parse_args(["up", "--continuation-limit", "5"])
    assert gateway_config(up, "--gateway-listen").continuation_limit == 5
    with pytest.raises(cli.UsageError, match="--continuation-limit: -1 is not a count"):
        gateway_config(made.parse_args(["gateway", "--continuation-limit", "-1"]))


def test_the_settle_time_is_a_flag_of_every_gateway_and_what_its_drains_wait() -> None:
    from schemas import subjects
    from services.cli import app as cli
    from services.cli.gateway import gateway_config
    from services.gateway.server import Gateway

    made = cli.build_parser()
    default = gateway_config(made.parse_args(["gateway"]))
    assert default.continuation_settle_s == rules.SETTLE_S == 1.0
    got = gateway_config(made.parse_args(["gateway", "--continuation-settle", "0.25"]))
    assert got.continuation_settle_s == 0.25
    up = made.parse_args(["up", "--continuation-settle", "0"])
    assert gateway_config(up, "--gateway-listen").continuation_settle_s == 0.0
    gw = Gateway.of(None, got, root=subjects.DEFAULT_ROOT)
    assert gw.continuations.settle_s == 0.25
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            made.parse_args(["gateway", "--continuation-settle", bad])


def test_the_body_resumed_by_token_ids_and_the_bound_on_the_ids_held() -> None:
    chat = {
        "model": "m",
        "messages": HI,
        "max_completion_tokens": 20,
        "temperature": 0,
        "stop": ["\n"],
        "chat_template_kwargs": {"x": 1},
        "stream": True,
    }
    got = rules.resumed_ids(chat, rules.CHAT, [7, 8], [1, 2, 3], 3)
    assert got["prompt"] == [7, 8, 1, 2, 3] and got["max_tokens"] == 17
    assert got["temperature"] == 0 and got["stop"] == ["\n"] and got["stream"] is True
    assert got["return_token_ids"] is True and got["stream_options"]["include_usage"] is True
    assert not {"messages", "max_completion_tokens", "chat_template_kwargs"} & set(got)
    # A completion that names no limit had 16 tokens (vLLM's and OpenAI's default).
    plain = {"model": "m", "prompt": "p", "min_tokens": 5}
    got = rules.resumed_ids(plain, rules.COMPLETIONS, [7], [1, 2], 2)
    assert got["max_tokens"] == 16 - 2 and got["min_tokens"] == 3
    assert rules.exhausted(plain, 16, rules.COMPLETIONS)
    # A chat without a limit is not continued by ids (its limit is the model's length).
    assert rules.by_ids_limit({"messages": HI}, rules.CHAT) is None
    # Past `max_ids` held, a stream goes on by text.
    st = rules.Stream(chat=False, ids_wanted=True, strip_ids=True, max_ids=4)
    st.begin("a")
    first = {"id": "x", "choices": [{"index": 0, "text": "a", "prompt_token_ids": [9, 9]}]}
    first["choices"][0]["token_ids"] = [1]
    what, out = st.event(b"data: " + msgspec.json.encode(first) + b"\n\n")
    assert what == rules.PASS and b'"prompt_token_ids":null' in out and b'"token_ids":null' in out
    assert st.by_ids and st.prompt_ids == [9, 9] and st.ids == [1]
    more = {"id": "x", "choices": [{"index": 0, "text": "bc", "token_ids": [2, 3]}]}
    st.event(b"data: " + msgspec.json.encode(more) + b"\n\n")
    assert not st.by_ids and st.text == "abc"


def test_the_events_of_a_read_and_the_ids_taken_out_as_they_came() -> None:
    # Split as an SSE reader splits them, whatever ends them; what is not ended is kept.
    e = b'data: {"a": 1}\n\n'
    assert rules.events(e) == ([e], b"")
    assert rules.events(e * 3 + b"data: {") == ([e, e, e], b"data: {")
    assert rules.events(b"") == ([], b"")
    assert rules.events(b"\n\n\n\ndata: x") == ([b"\n\n", b"\n\n"], b"data: x")
    crlf = b"data: 1\r\n\r\ndata: 2\r\rdata: 3\n\ndata: 4"
    assert rules.events(crlf) == (
        [b"data: 1\r\n\r\n", b"data: 2\r\r", b"data: 3\n\n"],
        b"data: 4",
    )
    # The ids the gateway asked for are null as the server writes them unasked, the rest
    # of the chunk's bytes (its spacing too: json.dumps', the simulated server's) kept.
    st = rules.Stream(chat=True, ids_wanted=True, strip_ids=True)
    st.begin("a")
    raw = (
        b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": " the"}, '
        b'"token_ids": [0, 12]}], "prompt_token_ids": [1016]}\n\n'
    )
    what, out = st.event(raw)
    assert what == rules.PASS
    assert out == raw.replace(b"[0, 12]", b"null").replace(b"[1016]", b"null")
    assert st.ids == [0, 12] and st.prompt_ids == [1016] and st.text == " the"
