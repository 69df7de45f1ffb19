"""Crash the preemption service for real between publishing and acking, restart it, and
check that each victim was asked to stop exactly once.

The service runs as a subprocess (`python -m services.preemption`) with a crash point
armed through `LLMGW_FAULT`; it exits with status 137 at that point, once (a marker file
keeps the restarted process from crashing again). The broker redelivers the unacked
trigger to the restarted process after the ack wait.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
from nats.js.client import JetStreamContext

from schemas import events as ev
from services.bus import EmbeddedBroker
from services.preemption import fault
from tests.preemption_service.conftest import (
    acked_through,
    failed,
    full_cluster,
    of_type,
    publish,
    stored,
    until,
)

pytestmark = pytest.mark.timeout(40)

ROOT = Path(__file__).resolve().parents[2]


def start(url: str, point: str, marker: Path, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, LLMGW_FAULT=f"{point}:{marker}")
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.preemption",
                "--nats",
                url,
                "--holder",
                "p1",
                "--ack-wait",
                "1",
                "--lease-ttl",
                "2",
                "--tick",
                "0.2",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def exited(proc: subprocess.Popen[bytes], within: float) -> int:
    await until(lambda: proc.poll() is not None, within)
    rc = proc.returncode
    assert rc is not None
    return rc


@pytest.mark.parametrize(
    ("point", "stored_before_restart"),
    [
        pytest.param(fault.CRASH_BEFORE_ACK, 2, id="after every output, before the ack"),
        pytest.param(fault.CRASH_AFTER_DECIDED, 0, id="after the decision, before the drains"),
    ],
)
async def test_crash_between_publish_and_ack_stops_each_victim_once(
    nats_server: EmbeddedBroker,
    js: JetStreamContext,
    tmp_path: Path,
    point: str,
    stored_before_restart: int,
) -> None:
    s = full_cluster(datetime.now(UTC))
    trigger = failed(s)
    n = await publish(js, s)
    marker, log = tmp_path / "crashed", tmp_path / "preemption.log"

    first = start(nats_server.url, point, marker, log)
    try:
        rc = await exited(first, 20)
    finally:
        if first.poll() is None:
            first.kill()
    assert rc == fault.EXIT_STATUS, log.read_text()
    assert marker.exists()
    assert not await acked_through(js, n)
    before = await stored(js)
    assert len(of_type(before, ev.PreemptionDecidedEvent)) == 1
    assert len(of_type(before, ev.ReplicaDrainEvent)) == stored_before_restart

    second = start(nats_server.url, point, marker, log)
    try:
        await until(lambda: acked_through(js, n), 20)
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            await exited(second, 10)
        finally:
            if second.poll() is None:
                second.kill()
    assert second.returncode == 0, log.read_text()
    # The restarted process found the decision rather than deciding again.
    assert f"trigger {trigger.id} came back" in log.read_text()

    after = await stored(js)
    decided = of_type(after, ev.PreemptionDecidedEvent)
    assert [x.event.causation for x in decided] == [trigger.id]
    drains = Counter(x.event.data.replica for x in of_type(after, ev.ReplicaDrainEvent))  # type: ignore[union-attr]
    assert drains == {"b1": 1, "b2": 1}
    assert len(of_type(after, ev.HoldCreatedEvent)) == 1


def test_fault_spec_names_known_points() -> None:
    with pytest.raises(fault.FaultError):
        fault.Fault("preemption.nowhere")
    f = fault.Fault(f"{fault.CRASH_BEFORE_ACK}:/tmp/m, {fault.CRASH_AFTER_DECIDED}")
    assert f.points == {fault.CRASH_BEFORE_ACK: Path("/tmp/m"), fault.CRASH_AFTER_DECIDED: None}
    assert not fault.Fault(None)


def test_fault_is_armed_only_by_the_environment_and_crashes_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(fault.ENV, raising=False)
    unarmed = fault.Fault.from_env()
    assert not unarmed and unarmed.points == {}
    for point in sorted(fault.POINTS):
        unarmed.hit(point)  # returns: the process goes on
    # Armed with a marker that is already there (it crashed here once), it goes on too:
    # the restarted service must get on with its work.
    marker = tmp_path / "crashed"
    marker.write_text("")
    monkeypatch.setenv(fault.ENV, f"{fault.CRASH_BEFORE_ACK}:{marker}")
    armed = fault.Fault.from_env()
    assert armed and set(armed.points) == {fault.CRASH_BEFORE_ACK}
    armed.hit(fault.CRASH_BEFORE_ACK)
    armed.hit(fault.CRASH_AFTER_DECIDED)  # not armed
    assert marker.read_text() == ""
