"""The plane's addresses stay where its clients were told they are: after kill -9 of
`llmgw up`, the next `up` on the data directory stops the orphan broker and serves on
its port again, so an `events tail` (or anything given the old URL) attached before the
crash goes on; a port it cannot have (still taken past the bounded wait, or the default
taken by another plane) is moved off in one line naming the old and the new address.
Real processes and a real nats-server; polls with deadlines, no sleeping."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from services import up as up_service
from services.bus import broker as bus_broker
from services.gateway.config import Config as GatewayConfig
from tests.up_process import UpProcess

pytestmark = pytest.mark.timeout(120)

PLAIN = ("--no-ui", "--no-gateway")


def _wait(cond: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "data"
    yield d
    bus_broker.stop_orphan(d)  # whatever happened, no broker of this directory lives on


def _apply(up: UpProcess, tmp_path: Path, model: str) -> None:
    spec = tmp_path / f"{model}.yaml"
    spec.write_text(f"models:\n  - {{name: {model}, min: 0, profiles: [{{name: p, gpus: 1}}]}}\n")
    r = up.llmgw("apply", "-f", str(spec))
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_killed_up_comes_back_on_its_port_and_a_tail_goes_on(data: Path, tmp_path: Path) -> None:
    first = UpProcess(data, tmp_path / "up1.log", *PLAIN)
    second: UpProcess | None = None
    tail: UpProcess | None = None
    try:
        before = _port(first.wait_url())
        _wait(lambda: first.text().count(": leading") >= 2, "both leaders")
        tail = UpProcess(data, tmp_path / "tail.log", command=("events", "tail"))
        # It shows what comes after it attached: declare models until it shows one.
        tries = iter(range(1000))

        def shown() -> bool:
            if "before-crash" in tail.text():
                return True
            _apply(first, tmp_path, f"before-crash-{next(tries)}")
            return False

        _wait(shown, "the tail to show a model")

        orphan = int((data / bus_broker.PID_FILE).read_text().split()[0])
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)

        second = UpProcess(data, tmp_path / "up2.log", *PLAIN)
        _wait(lambda: "broker: nats-server on" in second.text(), "the second broker")
        _wait(lambda: second.text().count(": leading") >= 2, "both leaders again")
        assert int((data / bus_broker.PID_FILE).read_text().split()[0]) != orphan
        after = _port(bus_broker.read_url(data) or "")
        assert after == before, second.text()
        assert "moved from" not in second.text()

        # The tail, attached to the killed plane's broker, finds the new one where it was.
        _apply(second, tmp_path, "after-crash")
        _wait(lambda: "after-crash" in tail.text(), "the tail to resume", timeout=60)
        assert tail.alive(), tail.text()
        assert "Traceback" not in second.text() + tail.text()
    finally:
        for p in (tail, second):
            if p is not None:
                p.stop()
        first.stop()
    assert second is not None and second.proc.returncode == 0, second.text()


def test_a_port_still_taken_is_waited_for_then_moved_off_in_one_line(
    data: Path, tmp_path: Path
) -> None:
    first = UpProcess(data, tmp_path / "up1.log", *PLAIN)
    second: UpProcess | None = None
    holder: socket.socket | None = None
    try:
        before = _port(first.wait_url())
        _wait(lambda: "broker: nats-server on" in first.text(), "the first broker")
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        # The orphan goes, and something else takes its port before the next `up`.
        bus_broker.stop_orphan(data)
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", before))
        holder.listen()

        t0 = time.monotonic()
        second = UpProcess(data, tmp_path / "up2.log", *PLAIN)
        _wait(lambda: "broker: nats-server on" in second.text(), "the second broker", 60)
        waited = time.monotonic() - t0
        after = _port(bus_broker.read_url(data) or "")
        assert after != before
        moved = [x for x in second.text().splitlines() if "moved from" in x]
        assert len(moved) == 1, second.text()
        assert f"broker: moved from 127.0.0.1:{before} to nats://127.0.0.1:{after}" in moved[0]
        assert f"still taken after {up_service.RECORDED_PORT_WAIT_S:g}s" in moved[0]
        assert str(data / bus_broker.URL_FILE) in moved[0]
        assert waited >= up_service.RECORDED_PORT_WAIT_S, waited
    finally:
        if holder is not None:
            holder.close()
        if second is not None:
            second.stop()
        first.stop()


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_up(
    opts: up_service.UpOptions, caplog: pytest.LogCaptureFixture
) -> tuple[up_service.Running, dict[str, str]]:
    """Run `up` in this process until it is ready, then stop it: what ran, and the
    lines that said a listener moved, by listener."""
    seen: list[up_service.Running] = []

    async def main() -> int:
        stop = asyncio.Event()

        def ready(r: up_service.Running) -> None:
            seen.append(r)
            stop.set()

        return await asyncio.wait_for(up_service.run(opts, stop, ready), 60)

    with caplog.at_level(logging.INFO, logger="llmgw.up"):
        assert asyncio.run(main()) == 0
    assert seen
    moved = [r.getMessage() for r in caplog.records if "moved from" in r.getMessage()]
    by = {m.split(":")[0]: m for m in moved}
    assert len(by) == len(moved), moved  # one line each
    return seen[0], by


def test_default_addresses_taken_are_moved_off_in_one_line_each(
    data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Beside another plane: the default broker, dashboard and gateway ports are taken;
    each listener moves to a free port, and says so naming both addresses."""
    held = [_listening() for _ in range(3)]
    nats_port, ui_port, gw_port = (s.getsockname()[1] for s in held)
    opts = up_service.UpOptions(
        data=data,
        default_port=nats_port,
        projector=False,
        ui=f"127.0.0.1:{ui_port}",
        ui_any_port=True,
        gateway=GatewayConfig(listen=f"127.0.0.1:{gw_port}"),
        gateway_any_port=True,
    )
    try:
        _, moved = _run_up(opts, caplog)
    finally:
        for s in held:
            s.close()
    assert set(moved) == {"broker", "dashboard", "gateway"}, moved
    assert f"moved from 127.0.0.1:{nats_port} to nats://127.0.0.1:" in moved["broker"]
    assert f"(port {nats_port} is taken)" in moved["broker"]
    assert str(data / bus_broker.URL_FILE) in moved["broker"]
    assert f"moved from 127.0.0.1:{ui_port} to http://127.0.0.1:" in moved["dashboard"]
    assert str(data / up_service.URL_FILE) in moved["dashboard"]
    assert f"moved from 127.0.0.1:{gw_port} to http://127.0.0.1:" in moved["gateway"]
    assert str(data / up_service.GATEWAY_URL_FILE) in moved["gateway"]


def test_a_killed_up_s_moved_dashboard_and_gateway_keep_their_ports(
    data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The defaults still taken, and the addresses a killed `up` moved to left in the
    data directory: the next `up` serves there again (and says it moved off the
    defaults), not on yet another port."""
    held = [_listening() for _ in range(2)]
    ui_port, gw_port = (s.getsockname()[1] for s in held)
    ui_was, gw_was = _free(), _free()
    data.mkdir(parents=True)
    (data / up_service.URL_FILE).write_text(f"http://127.0.0.1:{ui_was}/\n")
    (data / up_service.GATEWAY_URL_FILE).write_text(f"http://127.0.0.1:{gw_was}/v1\n")
    opts = up_service.UpOptions(
        data=data,
        projector=False,
        ui=f"127.0.0.1:{ui_port}",
        ui_any_port=True,
        gateway=GatewayConfig(listen=f"127.0.0.1:{gw_port}"),
        gateway_any_port=True,
    )
    try:
        running, moved = _run_up(opts, caplog)
    finally:
        for s in held:
            s.close()
    assert running.dashboard_url == f"http://127.0.0.1:{ui_was}/"
    assert running.gateway_url == f"http://127.0.0.1:{gw_was}/v1"
    assert f"moved from 127.0.0.1:{ui_port} to http://127.0.0.1:{ui_was}" in moved["dashboard"]
    assert f"moved from 127.0.0.1:{gw_port} to http://127.0.0.1:{gw_was}" in moved["gateway"]
