"""A broker that goes away is said once, not twice a second: one line when the connection
is lost, at most one per RECONNECT_REPORT_S while it tries to come back, one when back.
And the long-running commands' log lines carry their date and time.
"""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import time

import pytest

from services.bus import EmbeddedBroker, connect, ensure_streams, follow
from services.bus.connection import Outage

pytestmark = pytest.mark.timeout(60)


async def until(cond, within: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within:g}s")
        await asyncio.sleep(0.05)


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What a person would read: our connection's lines, and anything nats-py says at
    WARNING or above."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "llmgw.bus" or (r.name.startswith("nats") and r.levelno >= logging.WARNING)
    ]


async def test_a_stopped_broker_is_two_lines_however_many_attempts(
    nats_server: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    nc = await connect(nats_server.url, "tail", reconnect_wait_s=0.1)
    try:
        await nc.flush()
        await asyncio.to_thread(nats_server.stop)
        # About two seconds down: some twenty attempts at a tenth of a second each.
        down = time.monotonic()
        await until(lambda: not nc.is_connected)
        await until(lambda: time.monotonic() - down > 2.0)
        await asyncio.to_thread(nats_server.start)
        await until(lambda: nc.is_connected and nc.stats["reconnects"] >= 1)
        await nc.flush()
    finally:
        await nc.close()
    lines = said(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"nats tail: lost the connection to {nats_server.url}")
    m = re.fullmatch(
        r"nats tail: reconnected to \S+ after [\d.]+s \((\d+) failed attempt\(s\)\)", lines[1]
    )
    assert m is not None, lines[1]
    assert int(m.group(1)) >= 3


async def test_a_reader_following_the_log_adds_one_line(
    nats_server: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    # What `events tail` runs: a reader of the stream on the client's connection.
    caplog.set_level(logging.INFO)
    nc = await connect(nats_server.url, "tail", reconnect_wait_s=0.1)
    stop = asyncio.Event()
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        reader = asyncio.create_task(
            follow.follow(js, position=lambda: 0, on_batch=lambda b: None, stop=stop, name="tail")
        )
        await asyncio.to_thread(nats_server.stop)
        down = time.monotonic()
        await until(lambda: time.monotonic() - down > 2.0)
        await asyncio.to_thread(nats_server.start)
        await until(lambda: nc.is_connected and nc.stats["reconnects"] >= 1)
        await until(lambda: any("reconnected" in x for x in said(caplog)))
        stop.set()
        await asyncio.wait_for(reader, 10)
    finally:
        stop.set()
        await nc.close()
    lines = said(caplog)
    # Lost, the follow loop's one "read failed" or the reader's "recreating the
    # consumer", reconnected.
    assert len(lines) <= 3, lines


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_hour_away_is_a_line_per_period(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "llmgw.bus")
    clock = FakeClock()
    o = Outage("agent", "nats://h:4222", every_s=30.0, clock=clock)
    o.lost()
    for _ in range(2 * 90):  # 90 s of attempts, two a second
        clock.now += 0.5
        o.failed(ConnectionRefusedError(111, "refused"))
    o.back("nats://h:4222")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 + 3 + 1, lines
    assert lines[1] == (
        "nats agent: still reconnecting to nats://h:4222 after 30s: 60 attempt(s) failed "
        "since the last line (ConnectionRefusedError: [Errno 111] refused)"
    )
    assert (
        lines[-1] == "nats agent: reconnected to nats://h:4222 after 90.0s (180 failed attempt(s))"
    )
    assert not o.ongoing


def test_long_running_commands_log_with_date_and_time() -> None:
    code = (
        "import logging; from services.cli import app; app.setup_logging(); "
        "logging.getLogger('llmgw.bus').warning('nats agent: lost the connection')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d llmgw\.bus +nats agent: lost the connection\n", r.stderr
    ), r.stderr
