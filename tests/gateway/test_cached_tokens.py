"""The prompt tokens an engine served from its prefix cache, read from its answers'
`usage.prompt_tokens_details.cached_tokens` (vLLM with `--enable-prompt-tokens-details`)
for `replica.used`: whole answers, a stream's usage chunk left for its client, and one
taken out of a stream whose client did not ask; then through a gateway in this process
to its `replica.used`, from an upstream that answers as vLLM does."""

from __future__ import annotations

import pytest
from aiohttp import web

from schemas import events as ev
from services.gateway import streams, use
from tests.agent.helpers import node_events, wait_for
from tests.gateway.conftest import Plane

pytestmark = pytest.mark.timeout(30)

# vLLM 0.32.0's answer to a completion whose 1,199-token prompt it had seen before.
ANSWER = (
    b'{"id":"cmpl-9","object":"text_completion","model":"tiny","choices":[{"index":0,'
    b'"text":"ab","finish_reason":"length"}],"usage":{"prompt_tokens":1199,"total_tokens":1201,'
    b'"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1152,'
    b'"created_cache_tokens":null,"multimodal_tokens":null},"completion_tokens_details":null}}'
)
# Its streamed chat's last chunk, with include_usage.
CHUNK = (
    b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","model":"tiny","choices":[],'
    b'"usage":{"prompt_tokens":10,"total_tokens":14,"completion_tokens":4,'
    b'"prompt_tokens_details":{"cached_tokens":0,"created_cache_tokens":0}}}\n\n'
)
STREAM = (
    b'data: {"id":"chatcmpl-a","choices":[{"index":0,"delta":{"content":"x"}}],"usage":null}\n\n'
    + CHUNK
    + b"data: [DONE]\n\n"
)


def test_a_whole_answers_cached_tokens() -> None:
    assert use.usage(ANSWER) == (1199, 2)
    assert use.cached(ANSWER) == 1152
    # An engine that does not say (no details, details null, no usage): None, not 0.
    assert use.cached(b'{"usage":{"prompt_tokens":3,"completion_tokens":1}}') is None
    plain = b'{"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}'
    assert use.cached(plain) is None
    assert use.cached(b'{"choices":[]}') is None
    assert use.cached(b"not json") is None


def test_a_streams_cached_tokens_from_its_usage_chunk() -> None:
    assert use.stream_usage(STREAM) == (10, 4)
    assert use.stream_cached(STREAM) == 0
    assert use.stream_cached(STREAM.replace(b'"cached_tokens":0', b'"cached_tokens":128')) == 128
    assert use.stream_cached(b"data: [DONE]\n\n") is None


def test_a_usage_chunk_taken_out_of_a_stream_is_kept_for_its_cached_tokens() -> None:
    cut = streams.Strip()
    out = cut.feed(STREAM)
    assert CHUNK not in out
    assert cut.tokens == (10, 4)
    assert cut.event is not None and use.stream_cached(cut.event) == 0


# ---------------------------------------------------------------------- through the gateway


async def _vllm_like() -> tuple[web.AppRunner, str]:
    """An upstream answering as vLLM with --enable-prompt-tokens-details does: a whole
    completion (1,152 of its 1,199 prompt tokens cached) and a streamed chat (0 cached)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STREAM)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_replica_used_carries_the_engines_cached_tokens(plane: Plane) -> None:
    runner, endpoint = await _vllm_like()
    try:
        await plane.model("cached")
        await plane.ready("ca-1", "cached", endpoint)
        status, _, _ = await plane.post(
            "/v1/completions", {"model": "cached", "prompt": "x", "max_tokens": 2}
        )
        assert status == 200
        # A stream whose client asked for its usage, and one whose client did not (the
        # gateway asks, and takes the chunk out).
        for options in ({"stream_options": {"include_usage": True}}, {}):
            status, _, _ = await plane.chat("cached", stream=True, max_tokens=4, **options)
            assert status == 200

        async def used() -> list[ev.ReplicaUsedEvent]:
            es = await node_events(plane.gateway.js, plane.node)
            return [e for e in es if isinstance(e, ev.ReplicaUsedEvent)]

        reports = await wait_for(used, lambda u: sum(e.data.requests or 0 for e in u) == 3, 5)
        assert sum(e.data.tokens_in or 0 for e in reports) == 1199 + 10 + 10
        assert sum(e.data.tokens_cached or 0 for e in reports) == 1152
        assert all(e.data.tokens_cached is not None for e in reports)
    finally:
        await runner.cleanup()
