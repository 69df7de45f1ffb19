"""`llmgw gateway` and `python -m services.gateway` as an operator runs them: off loopback
without --no-auth is refused in one line (exit 2); the module alone serves from a real
broker and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from services.bus import EmbeddedBroker
from tests.up_process import llmgw

pytestmark = pytest.mark.timeout(30)


def test_off_loopback_without_keys_is_refused_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {"LLMGW_DATA": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = llmgw("gateway", "--listen", "0.0.0.0:8322", env=env)
    assert out.returncode == 2 and "--no-auth" in out.stderr and out.stderr.count("\n") == 1
    out = llmgw("gateway", "--listen", "nowhere", env=env)
    assert out.returncode == 2 and "is not HOST:PORT" in out.stderr


def test_the_module_alone_serves_and_stops_on_sigterm(nats_server: EmbeddedBroker) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.gateway",
            "--nats",
            nats_server.url,
            "--listen",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                    assert json.loads(r.read()) == {"object": "list", "data": []}
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out
    assert "Traceback" not in out


@pytest.mark.parametrize(("setting", "frozen"), [("1", True), ("0", False)])
def test_a_gateway_process_freezes_its_heap_unless_told_not_to(setting: str, frozen: bool) -> None:
    code = (
        "import gc; from services.gateway.server import freeze_heap; "
        "print(freeze_heap(), gc.get_freeze_count() > 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"LLMGW_GC_FREEZE": setting, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    assert out.stdout.split() == [str(frozen), str(frozen)]


@pytest.mark.parametrize(
    ("freeze", "tune", "given", "middle", "settled"),
    [
        ("1", "1", "", 1000, True),
        ("1", "1", "20000,10,10", 10, True),
        ("1", "1", "7,x,1", 1000, True),
        ("1", "0", "", 10, False),
        ("0", "1", "", 10, False),
    ],
)
def test_a_gateway_process_collects_its_middle_generation_rarely_and_freezes_again_once_serving(
    freeze: str, tune: str, given: str, middle: int, settled: bool
) -> None:
    # A stream's objects live seconds: a young collection promotes them, and with
    # CPython's 10 the middle generation, every open stream, was walked every few
    # seconds (docs/gateway.md).
    code = (
        "import gc; from services.gateway.server import freeze_heap, settle_heap; "
        "freeze_heap(); n = gc.get_freeze_count(); x = [[] for _ in range(100)]; "
        "print(gc.get_threshold()[1], settle_heap(), gc.get_freeze_count() > n)"
    )
    env = {"LLMGW_GC_FREEZE": freeze, "LLMGW_GC_TUNE": tune, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env | ({"LLMGW_GC_THRESHOLDS": given} if given else {}),
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    assert out.stdout.split() == [str(middle), str(settled), str(settled)]
    # A setting that is not three positive integers is one line, and the defaults.
    assert out.stderr.count("\n") == (1 if given == "7,x,1" else 0), out.stderr
    assert "Traceback" not in out.stderr
