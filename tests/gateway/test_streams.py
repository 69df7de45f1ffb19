"""A stream's usage asked for on the client's behalf and taken out of what it gets: the
body touched only where it must be, the stream the server's bytes minus the usage chunk
however the bytes are cut into chunks (pure: no server, no clock)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway import streams

pytestmark = pytest.mark.timeout(30)

USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
EVENTS = [
    b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"the usage"}}]}\n\n',
    b'data: {"id":"c","choices":[{"index":0,"finish_reason":"length"}],"usage":null}\n\n',
]
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("body", "want"),
    [
        pytest.param(
            b'{"model":"m","stream":true}',
            b'{"stream_options":{"include_usage":true},"model":"m","stream":true}',
            id="no stream_options: the field written after the brace, the rest as it was",
        ),
        pytest.param(
            b' \n{ "model" : "m",\t"stream": true }',
            b' \n{"stream_options":{"include_usage":true}, "model" : "m",\t"stream": true }',
            id="spaces and layout kept",
        ),
    ],
)
def test_a_body_without_stream_options_is_written_into_not_reencoded(
    body: bytes, want: bytes
) -> None:
    got = streams.ask_for_usage(body, msgspec.UNSET)
    assert got == want
    assert json.loads(got)["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        pytest.param(None, {}, id="null"),
        pytest.param({"include_usage": False}, {}, id="include_usage false"),
        pytest.param(
            {"continuous_usage_stats": False},
            {"continuous_usage_stats": False},
            id="other options kept",
        ),
    ],
)
def test_a_body_whose_stream_options_say_otherwise_says_include_usage(
    options: object, kept: dict[str, object]
) -> None:
    body = json.dumps({"model": "m", "stream": True, "stream_options": options}).encode()
    doc = json.loads(streams.ask_for_usage(body, options))
    assert doc == {"model": "m", "stream": True, "stream_options": {**kept, "include_usage": True}}
    assert not streams.asked(options) and streams.asked({"include_usage": True})


@pytest.mark.parametrize(
    ("event", "tokens"),
    [
        pytest.param(USAGE, (3, 4), id="the usage chunk"),
        pytest.param(USAGE.replace(b"data: ", b"data:"), (3, 4), id="no space after data:"),
        pytest.param(EVENTS[2], None, id="usage null on a chunk with choices"),
        pytest.param(
            b'data: {"choices":[{"index":0}],"usage":{"prompt_tokens":1}}\n\n',
            None,
            id="usage on a chunk with choices is not the usage chunk",
        ),
        pytest.param(DONE, None, id="done"),
        pytest.param(b": keep-alive\n\n", None, id="a comment"),
        pytest.param(b'data: {"choices":[],"usage":\n\n', None, id="broken JSON"),
    ],
)
def test_the_usage_chunk_is_told_from_the_others(
    event: bytes, tokens: tuple[int, int] | None
) -> None:
    assert streams.usage_of(event) == tokens


def _through(chunks: list[bytes]) -> tuple[bytes, streams.Strip]:
    s = streams.Strip()
    return b"".join(s.feed(c) for c in chunks) + s.end(), s


@given(st.lists(st.integers(min_value=1, max_value=len(b"".join(EVENTS)) + 120), max_size=12))
def test_however_the_stream_is_cut_the_client_gets_it_minus_the_usage_chunk(
    cuts: list[int],
) -> None:
    whole = b"".join(EVENTS) + USAGE + DONE
    points = sorted({min(c, len(whole)) for c in cuts})
    chunks = [whole[a:b] for a, b in zip([0, *points], [*points, len(whole)], strict=True)]
    got, s = _through([c for c in chunks if c])
    assert got == b"".join(EVENTS) + DONE
    assert s.tokens == (3, 4)


def test_a_stream_without_a_usage_chunk_passes_whole_and_crlf_events_too() -> None:
    whole = b"".join(EVENTS) + DONE
    got, s = _through([whole[:10], whole[10:]])
    assert got == whole and s.tokens is None
    crlf = USAGE.replace(b"\n\n", b"\r\n\r\n") + DONE.replace(b"\n\n", b"\r\n\r\n")
    got, s = _through([crlf])
    assert got == b"data: [DONE]\r\n\r\n" and s.tokens == (3, 4)


def test_only_the_part_of_an_event_not_ended_yet_is_held() -> None:
    s = streams.Strip()
    assert s.feed(EVENTS[0] + EVENTS[1][:5]) == EVENTS[0]
    assert s.feed(EVENTS[1][5:]) == EVENTS[1]
    # An event longer than any usage chunk is not held to its end.
    big = b"data: " + b"x" * (streams.MAX_HELD + 1)
    assert s.feed(big) == big
    assert s.end() == b""
