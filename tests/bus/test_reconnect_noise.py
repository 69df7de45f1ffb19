"""A broker that goes away is said once, not twice a second: one line when the connection
is lost, at most one per RECONNECT_REPORT_S while it tries to come back, one when back.
And the long-running commands' log lines carry their date and time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from services.bus import EmbeddedBroker, connect, connection, ensure_streams, follow
from services.bus.connection import Outage
from services.plane.lease import Lease

pytestmark = pytest.mark.timeout(60)


async def until(cond, within: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within:g}s")
        await asyncio.sleep(0.05)


def said(caplog: pytest.LogCaptureFixture, reader: str | None = None) -> list[str]:
    """What a person would read: our connection's lines, and anything nats-py says at
    WARNING or above; with `reader`, only that wire reader's lines."""
    return [
        r.getMessage()
        for r in caplog.records
        if (_of(r, reader) if reader is not None else r.name == "llmgw.bus")
        or (reader is None and r.name.startswith("nats") and r.levelno >= logging.WARNING)
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


async def test_each_reader_says_its_fault_once_a_period_naming_itself(
    nats_server: EmbeddedBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `up` runs: several readers of the stream on one client's connection (the
    # projector's, the scheduler's, ...). Each says its fault once, then at most once per
    # period while it lasts, each line naming it; a short period here, so that two
    # seconds away hold a few periods.
    monkeypatch.setattr(connection, "RECONNECT_REPORT_S", 0.5)
    caplog.set_level(logging.INFO)
    nc = await connect(nats_server.url, "tail", reconnect_wait_s=0.1)
    stop = asyncio.Event()
    names = ("tail a", "tail b")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        readers = [
            asyncio.create_task(
                follow.follow(js, position=lambda: 0, on_batch=lambda b: None, stop=stop, name=n)
            )
            for n in names
        ]
        # Both read (their connections are up) before the broker goes.
        await until(lambda: sum(c.startswith("llmgw-reader") for c in _conns(nats_server)) == 2)
        await asyncio.to_thread(nats_server.stop)
        down = time.monotonic()
        await until(lambda: time.monotonic() - down > 2.0)
        await asyncio.to_thread(nats_server.start)
        await until(lambda: nc.is_connected and nc.stats["reconnects"] >= 1)
        await until(lambda: all(any("reading again" in x for x in said(caplog, n)) for n in names))
        stop.set()
        await asyncio.gather(*(asyncio.wait_for(r, 10) for r in readers))
    finally:
        stop.set()
        await nc.close()
    for n in names:
        lines = said(caplog, n)
        stamps = [r.created for r in caplog.records if _of(r, n)]
        # It began once, said it was still failing a few times, and that it reads again.
        assert lines[0].startswith(f"wire reader ({n}): recreating the consumer from seq 1"), lines
        assert 1 <= sum("still cannot connect" in x for x in lines) <= 5, lines
        assert lines[-1].startswith(f"wire reader ({n}): reading again from seq 1"), lines
        # The rule: no two lines of one fault within a period (its end is said at once).
        gaps = [b - a for a, b in itertools.pairwise(stamps[:-1])]
        assert all(g >= 0.45 for g in gaps), (gaps, lines)
    # No line of a reader that does not say which.
    assert not [x for x in said(caplog) if x.startswith("wire reader:")]


def _of(r: logging.LogRecord, reader: str) -> bool:
    return r.name == "llmgw.bus" and r.getMessage().startswith(f"wire reader ({reader}): ")


def _conns(broker: EmbeddedBroker) -> list[str]:
    url = f"http://127.0.0.1:{broker.monitor_port}/connz"
    with urllib.request.urlopen(url, timeout=5) as r:
        return [str(c.get("name")) for c in json.load(r).get("connections") or []]


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


async def test_a_lease_says_a_broker_away_once_a_period(
    nats_server: EmbeddedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    # A lease tries every ttl/3; with the broker away each try fails. Ninety seconds of
    # them after the first, on the lease's clock, are its first failure, one line per
    # 30 s, and its end.
    caplog.set_level(logging.INFO, "llmgw.lease")
    clock = FakeClock()
    nc = await connect(nats_server.url, "lease", reconnect_wait_s=0.1)
    try:
        lease = Lease(nc.jetstream(timeout=0.2), name="noise", holder="h", ttl_s=3, clock=clock)
        assert await lease.acquire()
        await asyncio.to_thread(nats_server.stop)
        await until(lambda: not nc.is_connected)
        for _ in range(10):  # a try every 10 s on the lease's clock: 100 s away
            clock.now += 10.0
            await lease.acquire()
        await asyncio.to_thread(nats_server.start)
        await until(lambda: nc.is_connected)

        def faults() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.name == "llmgw.lease"
                and " leads" not in r.getMessage()
                and " stands by" not in r.getMessage()
            ]

        deadline = time.monotonic() + 10
        while not any("answers again" in x for x in faults()):
            assert time.monotonic() < deadline, faults()
            await lease.acquire()
    finally:
        await nc.close()
    lines = faults()
    assert len(lines) == 1 + 3 + 1, lines
    assert lines[0].startswith("lease noise: ")
    assert lines[1].startswith("lease noise: still failing after 30s: 3 attempt(s) since the last")
    assert lines[-1] == "lease noise: the broker answers again after 90.0s"


async def test_a_lease_whose_first_try_finds_the_broker_away_waits_for_it(
    nats_server: EmbeddedBroker,
) -> None:
    # The broker goes away before the lease has ever looked for its bucket (a broker
    # restarted as the plane starts): the try fails like any other, and the service that
    # runs the lease lives on to lead once the broker answers.
    nc = await connect(nats_server.url, "lease", reconnect_wait_s=0.1)
    try:
        await asyncio.to_thread(nats_server.stop)
        await until(lambda: not nc.is_connected)
        lease = Lease(nc.jetstream(timeout=0.2), name="first", holder="h", ttl_s=3)
        assert await lease.acquire() is False
        assert lease.failing_since is not None
        await asyncio.to_thread(nats_server.start)
        await until(lambda: nc.is_connected)
        deadline = time.monotonic() + 10
        while not await lease.acquire():
            assert time.monotonic() < deadline, "the lease never led once the broker answered"
            await asyncio.sleep(0.1)
        assert lease.failing_since is None
    finally:
        await nc.close()
