"""The heads the gateway reads and writes, compiled (`services.gateway._relay`, chosen with
the chunk relay: `OnHeader` and `Head` for the lean server, `OnAnswerHeader` and
`RequestHead` for the lean client) are the rules in Python (`front._Conn.on_header`,
`front.answer_head`, `upstream._Conn`'s `setdefault` and `upstream.request_head`): on
random heads, the same headers kept, the same refusal past `MAX_HEADERS` (the same
words in `_bad`, the same error), the same bytes of a head or the same error, for every
kind of value the rule takes (not only the str the fast way takes).
tests/gateway/test_front.py runs the lean server against aiohttp's on both, and
tests/gateway/test_upstream_client.py the lean client against aiohttp's."""

from __future__ import annotations

import random
from typing import Any

import pytest
from multidict import CIMultiDict

from services.gateway import front
from services.gateway.front import _REASONS, MAX_HEADERS, answer_head
from services.gateway.upstream import request_head

pytestmark = pytest.mark.timeout(60)


def _built() -> Any:
    """The compiled module: built as the project installs (a failure here, not a skip)."""
    import services.gateway._relay as built

    return built


class _Conn:
    """What `on_header` reads and writes of a connection."""

    def __init__(self) -> None:
        self._pairs: list[tuple[str, str]] = []
        self._bad: str | None = None


def _python(conn: _Conn) -> Any:
    return lambda name, value: front._Conn.on_header(conn, name, value)  # type: ignore[arg-type]


def _compiled(conn: _Conn) -> Any:
    return _built().OnHeader(conn, conn._pairs, MAX_HEADERS)


def _outcome(call: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", call(*args)
    except Exception as e:  # the same kind, in the same words
        return type(e).__name__, str(e)


def _field(rng: random.Random) -> bytes:
    n = rng.choice([0, 1, 5, 30, 300])
    return bytes(rng.choice(b"abcXYZ-_:; \t\x00\x7f\x80\xe9\xff") for _ in range(n))


@pytest.mark.parametrize("seed", range(20))
def test_a_heads_headers_are_kept_as_the_rule_keeps_them(seed: int) -> None:
    rng = random.Random(seed)
    py, c = _Conn(), _Conn()
    on_py, on_c = _python(py), _compiled(c)
    for _ in range(rng.choice([0, 3, MAX_HEADERS - 1, MAX_HEADERS + 5])):
        name, value = _field(rng), _field(rng)
        assert _outcome(on_py, name, value) == _outcome(on_c, name, value)
        assert py._pairs == c._pairs
        assert py._bad == c._bad
    assert all(type(k) is str and type(v) is str for k, v in c._pairs)


def test_past_the_most_headers_both_refuse_in_the_same_words() -> None:
    py, c = _Conn(), _Conn()
    on_py, on_c = _python(py), _compiled(c)
    for _ in range(MAX_HEADERS):
        on_py(b"a", b"b")
        on_c(b"a", b"b")
    got = _outcome(on_c, b"one", b"more")
    assert got == _outcome(on_py, b"one", b"more") == ("ValueError", f"over {MAX_HEADERS} headers")
    assert c._bad == py._bad == f"over {MAX_HEADERS} headers"
    assert len(c._pairs) == MAX_HEADERS
    c._pairs.clear()  # a new head (`on_message_begin`): counted again from none
    assert _outcome(on_c, b"x", b"y") == ("ok", None)


class _Text(str):
    """A str of a subclass: the rule formats it; the fast way leaves it to the rule."""


class _Odd:
    def __format__(self, spec: str) -> str:
        return "odd"


def _value(rng: random.Random) -> Any:
    kind = rng.random()
    if kind < 0.7:
        n = rng.choice([0, 1, 8, 40])
        return "".join(rng.choice("abc XYZ-/;=.é€\u00ff") for _ in range(n))
    if kind < 0.78:
        return rng.choice(["a\nb", "a\rb", "\r\n", "x\n"])  # a line broken inside
    if kind < 0.84:
        return "bad \udc80"  # not UTF-8: the rule's own error
    if kind < 0.90:
        return rng.randrange(-5, 10**6)
    if kind < 0.95:
        return _Text("sub")
    return _Odd()


def _headers(rng: random.Random) -> Any:
    n = rng.choice([0, 1, 3, 8])
    if rng.random() < 0.05:
        return {rng.choice(["a", "B-c"]) + str(i): "v" for i in range(n)}.items().mapping
    return {
        (rng.choice(["Content-Type", "x-llmgw-replica", "ä", "k"]) + str(i))
        if rng.random() < 0.95
        else "bad\nname": _value(rng)
        for i in range(n)
    }


@pytest.mark.parametrize("seed", range(20))
def test_an_answers_head_is_the_same_bytes_compiled(seed: int) -> None:
    rng = random.Random(seed)
    compiled = _built().Head(_REASONS, answer_head)
    for _ in range(300):
        args = (
            rng.choice(["1.1", "1.0", "0.9", _Text("1.1")]),
            rng.choice([True, False, 0, 1]),
            rng.choice([200, 201, 404, 499, 503, 599, 0, 1000, True, 2**70]),
            _headers(rng),
            rng.choice([None, -1, 0, 17, 2**40, 2**70, True]),
            rng.choice([b"Date: Mon, 07 Dec 2026 21:00:00 GMT\r\n\r\n", b""]),
        )
        assert _outcome(compiled, *args) == _outcome(answer_head, *args), args


def test_the_head_of_a_usual_answer_is_what_http_says() -> None:
    compiled = _built().Head(_REASONS, answer_head)
    date = b"Date: Mon, 07 Dec 2026 21:00:00 GMT\r\n\r\n"
    headers = {"Content-Type": "application/json", "x-llmgw-replica": "r-1"}
    for head in (compiled, answer_head):
        assert head("1.1", True, 200, headers, 2, date) == (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-llmgw-replica: r-1\r\n"
            b"Content-Length: 2\r\n" + date
        )
        assert head("1.0", True, 503, {}, None, date) == (
            b"HTTP/1.0 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: keep-alive\r\n" + date
        )
        assert head("1.1", False, 200, {}, -1, date) == (
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + date
        )


# ---- the lean client's side (services.gateway.upstream)


@pytest.mark.parametrize("seed", range(10))
def test_an_answers_headers_are_kept_as_the_rule_keeps_them(seed: int) -> None:
    """`OnAnswerHeader` decodes as each header comes and keeps the first value of a name
    said twice; the rule keeps the bytes (`setdefault`) and decodes them after the head:
    the same headers either way."""
    rng = random.Random(seed)
    plain: dict[bytes, bytes] = {}
    said: dict[str, str] = {}
    on = _built().OnAnswerHeader(said)
    for _ in range(rng.choice([0, 1, 5, 40])):
        name = rng.choice([b"Content-Type", b"content-type", b"X-A", b"\xe9t\xe9", b""])
        value = _field(rng)
        plain.setdefault(name, value)
        assert on(name, value) is None
    rule = CIMultiDict([(k.decode("latin-1"), v.decode("latin-1")) for k, v in plain.items()])
    assert list(CIMultiDict(said).items()) == list(rule.items())


def _request_headers(rng: random.Random) -> Any:
    if rng.random() < 0.05:
        return {"X-A": "b"}.items().mapping  # not a dict: the rule's own way
    out: dict[Any, Any] = {}
    for _ in range(rng.choice([0, 1, 2, 4])):
        name = rng.choice(["Content-Type", "Accept", "X-Request-Id", "ä", "bad \udc80", "accept"])
        value = rng.choice(
            ["application/json", "*/*", "", "é€", "lone \udc80", "high \ud800", 7, _Text("s")]
        )
        out[name] = value
    return out


@pytest.mark.parametrize("seed", range(10))
def test_a_requests_head_is_the_same_bytes_compiled(seed: int) -> None:
    rng = random.Random(seed)
    compiled = _built().RequestHead(request_head)
    for _ in range(300):
        args = (
            rng.choice([b"POST /v1/chat/completions HTTP/1.1\r\nHost: r:8000", b""]),
            _request_headers(rng),
            rng.choice([0, 1, 4096, 2**40, -1, 2**70, True]),
        )
        assert _outcome(compiled, *args) == _outcome(request_head, *args), args


def test_a_usual_requests_head_is_what_http_says() -> None:
    start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r:8000"
    for head in (_built().RequestHead(request_head), request_head):
        assert head(start, {"Content-Type": "application/json"}, 12) == (
            start + b"\r\nContent-Type: application/json\r\nAccept: */*"
            b"\r\nContent-Length: 12\r\n\r\n"
        )
        assert head(start, {"Accept": "text/event-stream"}, 0) == (
            start + b"\r\nAccept: text/event-stream\r\nContent-Length: 0\r\n\r\n"
        )
