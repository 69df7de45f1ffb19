"""Crash the preemption service for real between publishing and acking, restart it, and
check that each victim was asked to stop exactly once.

The service runs as a subprocess (`python -m tests.preemption_service.faulty`, the
service's own `main` with a crash point armed: only a test can arm one); it exits with status 137 at that point, once (a marker file
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
from tests.scenario import Scenario

pytestmark = pytest.mark.timeout(40)

ROOT = Path(__file__).resolve().parents[2]


def start(url: str, point: str, marker: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.preemption_service.faulty",
                "--fault",
                f"{point}:{marker}",
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
                *args,
            ],
            cwd=ROOT,
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

    rc = await _crashed(start(nats_server.url, point, marker, log))
    assert rc == fault.EXIT_STATUS, log.read_text()
    assert marker.exists()
    assert not await acked_through(js, n)
    before = await stored(js)
    assert len(of_type(before, ev.PreemptionDecidedEvent)) == 1
    assert len(of_type(before, ev.ReplicaDrainEvent)) == stored_before_restart

    back = await _restarted(js, n, start(nats_server.url, point, marker, log))
    assert back == 0, log.read_text()
    # The restarted process found the decision rather than deciding again.
    assert f"trigger {trigger.id} came back" in log.read_text()

    after = await stored(js)
    decided = of_type(after, ev.PreemptionDecidedEvent)
    assert [x.event.causation for x in decided] == [trigger.id]
    drains = Counter(x.event.data.replica for x in of_type(after, ev.ReplicaDrainEvent))  # type: ignore[union-attr]
    assert drains == {"b1": 1, "b2": 1}
    assert len(of_type(after, ev.HoldCreatedEvent)) == 1


def gang_cluster(t0: datetime) -> Scenario:
    """One NVLink domain of two nodes, all of both held by a two-node opportunistic
    replica g1; a critical two-node model `big` fits only once g1 stops (node-aware)."""
    s = Scenario(t0)
    for n in ("a1", "a2"):
        s.node(n, 8, labels={"nvlink_domain": "A"})
    s.model("batch", cls="opportunistic", min=0, max=2, profiles=[PP2])
    s.model("big", cls="critical", min=1, profiles=[PP2])
    s.replica("g1", "batch", on=[("a1", range(8)), ("a2", range(8))], ready="-3h", used="-1h")
    return s


PP2 = ev.ProfileSpec(name="pp2", gpus=8, shards=2, topology=ev.TopologySpec(level="nvlink_domain"))


async def test_a_crash_between_a_gangs_drains_sends_the_rest_after_the_restart(
    nats_server: EmbeddedBroker, js: JetStreamContext, tmp_path: Path
) -> None:
    """Killed after the decision and the drain of the gang's first node, the restarted
    service completes the decision with the drain of its second node (and the hold), and
    sends the first node's drain not again."""
    s = gang_cluster(datetime.now(UTC))
    trigger = s.emit(
        ev.PlacementFailed(model="big", profiles=("pp2",), live=0, desired=1, reason="no_fit")
    )
    n = await publish(js, s)
    marker, log = tmp_path / "crashed", tmp_path / "preemption.log"
    point = fault.CRASH_AFTER_FIRST_DRAIN

    rc = await _crashed(start(nats_server.url, point, marker, log, "--policy", "node-aware"))
    assert rc == fault.EXIT_STATUS, log.read_text()
    before = of_type(await stored(js), ev.ReplicaDrainEvent)
    assert [(x.event.data.replica, x.subject.split(".")[2]) for x in before] == [("g1", "a1")]  # type: ignore[union-attr]

    back = await _restarted(
        js, n, start(nats_server.url, point, marker, log, "--policy", "node-aware")
    )
    assert back == 0, log.read_text()
    assert f"trigger {trigger.id} came back" in log.read_text()

    after = await stored(js)
    decided = of_type(after, ev.PreemptionDecidedEvent)
    assert [x.event.causation for x in decided] == [trigger.id]
    assert decided[0].event.data.spans == {"g1": ("a1", "a2")}  # type: ignore[union-attr]
    drains = Counter(
        (x.event.data.replica, x.subject.split(".")[2])  # type: ignore[union-attr]
        for x in of_type(after, ev.ReplicaDrainEvent)
    )
    assert drains == {("g1", "a1"): 1, ("g1", "a2"): 1}
    assert len(of_type(after, ev.HoldCreatedEvent)) == 1


def test_fault_spec_names_known_points() -> None:
    with pytest.raises(fault.FaultError):
        fault.Fault("preemption.nowhere")
    f = fault.Fault(f"{fault.CRASH_BEFORE_ACK}:/tmp/m, {fault.CRASH_AFTER_DECIDED}")
    assert f.points == {fault.CRASH_BEFORE_ACK: Path("/tmp/m"), fault.CRASH_AFTER_DECIDED: None}
    assert not fault.Fault(None)


def test_fault_is_armed_only_by_a_test_and_crashes_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The variable that once armed it arms nothing: production code reads no
    # environment for the hook, and a service built without one has none armed.
    monkeypatch.setenv("LLMGW_FAULT", f"{fault.CRASH_BEFORE_ACK}")
    assert not hasattr(fault, "ENV") and not hasattr(fault.Fault, "from_env")
    unarmed = fault.Fault(None)
    assert not unarmed and unarmed.points == {}
    for point in sorted(fault.POINTS):
        unarmed.hit(point)  # returns: the process goes on
    # Armed with a marker that is already there (it crashed here once), it goes on too:
    # the restarted service must get on with its work.
    marker = tmp_path / "crashed"
    marker.write_text("")
    armed = fault.Fault(f"{fault.CRASH_BEFORE_ACK}:{marker}")
    assert armed and set(armed.points) == {fault.CRASH_BEFORE_ACK}
    armed.hit(fault.CRASH_BEFORE_ACK)
    armed.hit(fault.CRASH_AFTER_DECIDED)  # not armed
    assert marker.read_text() == ""


def test_the_service_entry_point_takes_no_fault_from_the_environment(tmp_path: Path) -> None:
    """`python -m services.preemption` with the old variable set (to a point that does
    not exist) is not armed by it: it gets as far as needing a broker (its one line,
    exit 2), not to a fault's parse. The test's own entry point parses the spec."""
    env = dict(os.environ, LLMGW_FAULT="preemption.nowhere", LLMGW_DATA=str(tmp_path))
    env["HOME"] = str(tmp_path)
    env.pop("LLMGW_NATS", None)
    done = subprocess.run(
        [sys.executable, "-m", "services.preemption"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stderr
    assert "no broker" in done.stderr and "fault" not in done.stderr, done.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "tests.preemption_service.faulty", "--fault", "nowhere"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "unknown fault point 'nowhere'" in bad.stderr


async def _restarted(js: JetStreamContext, n: int, second: subprocess.Popen[bytes]) -> int | None:
    """The restarted service acks the log through `n`, then stops on SIGTERM: its exit
    status."""
    try:
        await until(lambda: acked_through(js, n), 20)
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            await exited(second, 10)
        finally:
            if second.poll() is None:
                second.kill()
    return second.returncode


async def _crashed(first: subprocess.Popen[bytes]) -> int | None:
    """The service started at a crash point, once it exits (killed if it does not within
    20 s): its exit status."""
    try:
        return await exited(first, 20)
    finally:
        if first.poll() is None:
            first.kill()
