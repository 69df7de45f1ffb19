"""The gateway's edge in itself (`services.gateway.guard`): the rule of one line per
cause, then one per 30 s, on a clock of the test's own; what aiohttp's parser refuses as
one line each; the budget of bodies held. The edge against real requests is
`tests/adversarial/test_boundary_http.py`'s."""

from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.test_utils import make_mocked_request

from services.gateway.guard import Boundary, Budget, Lines, ParserLog, shown

pytestmark = [pytest.mark.timeout(10)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_cause_then_one_per_30_s(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    lines = Lines(logging.getLogger("llmgw.gateway"), clock=clock)
    with caplog.at_level(logging.INFO, "llmgw.gateway"):
        said = [lines.say(logging.WARNING, "a", "fault %s", "a") for _ in range(1000)]
        said.append(lines.say(logging.WARNING, "b", "fault %s", "b"))  # another cause: said
        clock.now = 29.9
        said.append(lines.say(logging.WARNING, "a", "fault %s", "a"))
        clock.now = 30.0
        said.append(lines.say(logging.WARNING, "a", "fault %s", "a"))
        clock.now = 3600.0  # an hour on: said again, with what it stands for
        said.append(lines.say(logging.WARNING, "a", "fault %s", "a"))
    assert said.count(True) == 4
    assert [r.getMessage() for r in caplog.records] == [
        "fault a",
        "fault b",
        "fault a (and 1001 more in 30s)",
        "fault a (and 1 more in 30s)",
    ]


def test_a_parser_refusal_is_one_line_without_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = ParserLog(Lines(logging.getLogger("llmgw.gateway"), clock=clock), logging.getLogger("x"))
    with caplog.at_level(logging.DEBUG):
        for _ in range(1000):
            log.exception(
                "Error handling request from %s",
                "127.0.0.1",
                exc_info=BadHttpMessage("Bad header:\n\n  b'X\\x00: 1'\n     ^"),
            )
        log.exception(
            "Error handling request from %s", "127.0.0.1", exc_info=LineTooLong("a" * 9000, "8190")
        )
    said = [r for r in caplog.records if r.name == "llmgw.gateway"]
    assert len(said) == 2 and all(r.exc_info is None for r in said)
    assert all("\n" not in r.getMessage() and len(r.getMessage()) < 300 for r in said)
    assert said[0].getMessage().startswith("gateway: 400 from 127.0.0.1: HTTP it cannot parse:")


def test_shown_is_one_printable_line() -> None:
    assert shown("a\nb\x1b[31m\tc") == "a b\\x1b[31m c"
    assert len(shown("x" * 10_000)) == 120


def test_the_budget_holds_what_fits_and_gives_it_back() -> None:
    b = Budget(100)
    assert b.take(60) and not b.take(41) and b.take(40)
    assert b.held == 100 and b.refused == 1
    b.give(60)
    assert b.take(60) and b.held == 100


def _code(b: Boundary, **headers: str) -> int | None:
    request = make_mocked_request("POST", "/v1/chat/completions", headers=headers)
    why = b.refusal(request)
    return None if why is None else why[0]


JSON = "application/json"


def test_the_host_is_checked_on_loopback_and_origin_and_type_everywhere() -> None:
    here = Boundary("127.0.0.1", ("gw.example",))
    there = Boundary("0.0.0.0", ("gw.example",))
    service = "llmgw-gateway.llmgw.svc:8322"
    for host in ("127.0.0.1:8322", "localhost", "[::1]:8322", "gw.example:8322"):
        assert _code(here, Host=host, **{"Content-Type": JSON}) is None, host
    for host in (service, "evil.example", "10.0.0.5:8322", "127.0.0.1.evil.example"):
        assert _code(here, Host=host, **{"Content-Type": JSON}) == 421, host
        # Off loopback a key is asked for, and the names are the Services' and proxies'.
        assert _code(there, Host=host, **{"Content-Type": JSON}) is None, host
    for b, host in ((here, "127.0.0.1:8322"), (there, service)):
        assert _code(b, Host=host, Origin="http://evil.example", **{"Content-Type": JSON}) == 403
        assert _code(b, Host=host, Origin=f"http://{host}", **{"Content-Type": JSON}) is None
        assert _code(b, Host=host, **{"Content-Type": "text/plain"}) == 415
        assert _code(b, Host=host) == 415
