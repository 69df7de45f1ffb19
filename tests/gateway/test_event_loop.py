"""The event loop a gateway process of its own runs on (`--event-loop`,
`services.gateway.loop`): uvloop where it is installed unless told otherwise, asyncio's
own when asked or when uvloop is not there; asking for uvloop where it is not installed
is one line and exit 2, never a traceback. `llmgw up` does not offer it (its loop is the
whole plane's)."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.bus import EmbeddedBroker
from services.gateway.errors import GatewayError
from services.gateway.loop import loop_factory

ROOT = Path(__file__).resolve().parents[2]
HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None

pytestmark = pytest.mark.timeout(30)


def test_the_loop_is_a_flag_of_the_gateway_and_not_of_up() -> None:
    from services.cli import app as cli
    from services.cli.gateway import gateway_config
    from services.gateway.__main__ import parser

    made = cli.build_parser()
    assert gateway_config(made.parse_args(["gateway"])).event_loop == "auto"
    assert gateway_config(made.parse_args(["gateway", "--event-loop", "asyncio"])).event_loop == (
        "asyncio"
    )
    assert parser().parse_args(["--event-loop", "uvloop"]).event_loop == "uvloop"
    with pytest.raises(SystemExit):
        made.parse_args(["up", "--event-loop", "asyncio"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--event-loop", "trio"])


def test_auto_is_uvloop_where_installed_and_asyncio_is_asyncio_s_own() -> None:
    assert loop_factory("asyncio") is None
    auto = loop_factory("auto")
    if HAS_UVLOOP:
        assert auto is not None
        loop = auto()
        try:
            assert type(loop).__module__.startswith("uvloop")
        finally:
            loop.close()
    else:
        assert auto is None


@pytest.mark.skipif(HAS_UVLOOP, reason="uvloop is installed here")
def test_uvloop_asked_for_where_it_is_not_installed_is_one_line(
    nats_server: EmbeddedBroker,
) -> None:
    with pytest.raises(GatewayError, match="uvloop is not installed"):
        loop_factory("uvloop")
    out = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--nats", nats_server.url,
         "--listen", "127.0.0.1:0", "--event-loop", "uvloop"],
        capture_output=True, text=True, cwd=ROOT, timeout=20,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "--event-loop asyncio" in out.stderr


@pytest.mark.parametrize("loop", ["asyncio", "auto"])
def test_a_gateway_process_says_the_loop_it_serves_on(
    nats_server: EmbeddedBroker, loop: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.gateway", "--nats", nats_server.url,
         "--listen", f"127.0.0.1:{port}", "--event-loop", loop],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    want = "uvloop" if loop == "auto" and HAS_UVLOOP else "asyncio"
    assert f", on {want}\n" in out, out
    assert proc.returncode == 0 and "Traceback" not in out


def test_the_asyncio_loop_is_asyncio_s_own() -> None:
    with asyncio.Runner(loop_factory=loop_factory("asyncio")) as r:
        assert isinstance(r.get_loop(), asyncio.BaseEventLoop)
