"""The prompt tokens an engine served from its prefix cache, read from its answers'
`usage.prompt_tokens_details.cached_tokens` (vLLM with `--enable-prompt-tokens-details`)
for `replica.used`: whole answers, a stream's usage chunk left for its client, and one
taken out of a stream whose client did not ask (pure: no server, no clock)."""

from __future__ import annotations

import pytest

from services.gateway import server, streams

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
    assert server._usage(ANSWER) == (1199, 2)
    assert server._cached(ANSWER) == 1152
    # An engine that does not say (no details, details null, no usage): None, not 0.
    assert server._cached(b'{"usage":{"prompt_tokens":3,"completion_tokens":1}}') is None
    plain = b'{"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}'
    assert server._cached(plain) is None
    assert server._cached(b'{"choices":[]}') is None
    assert server._cached(b"not json") is None


def test_a_streams_cached_tokens_from_its_usage_chunk() -> None:
    assert server._stream_usage(STREAM) == (10, 4)
    assert server._stream_cached(STREAM) == 0
    assert (
        server._stream_cached(STREAM.replace(b'"cached_tokens":0', b'"cached_tokens":128')) == 128
    )
    assert server._stream_cached(b"data: [DONE]\n\n") is None


def test_a_usage_chunk_taken_out_of_a_stream_is_kept_for_its_cached_tokens() -> None:
    cut = streams.Strip()
    out = cut.feed(STREAM)
    assert CHUNK not in out
    assert cut.tokens == (10, 4)
    assert cut.event is not None and server._stream_cached(cut.event) == 0
