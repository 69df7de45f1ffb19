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
from pathlib import Path

import pytest

from services.bus import EmbeddedBroker
from tests.up_process import llmgw

ROOT = Path(__file__).resolve().parents[2]

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
    # Told no rule, it routes by the prefix-aware one, and says so as it starts serving.
    assert "routing by prefix" in out, out


# The collector's variables of the rounds before are set in every case, and ignored:
# only the flags count (docs/operating.md's table of switches).
OLD_VARIABLES = {"LLMGW_GC_FREEZE": "0", "LLMGW_GC_TUNE": "0", "LLMGW_GC_THRESHOLDS": "5,5,5"}


@pytest.mark.parametrize(("given", "frozen"), [([], True), (["--no-gc-freeze"], False)])
def test_a_gateway_process_freezes_its_heap_unless_told_not_to(
    given: list[str], frozen: bool
) -> None:
    code = (
        "import gc, sys; from services.gateway.__main__ import parser; "
        "from services import flags; from services.gateway.config import Config; "
        "from services.gateway.server import freeze_heap; "
        "c = flags.build(Config, parser().parse_args(sys.argv[1:])); "
        "print(freeze_heap(c), gc.get_freeze_count() > 0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *given],
        env={**OLD_VARIABLES, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    assert out.stdout.split() == [str(frozen), str(frozen)]


@pytest.mark.parametrize(
    ("given", "middle", "settled"),
    [
        ([], 1000, True),
        (["--gc-thresholds", "20000,10,10"], 10, True),
        (["--no-gc-tune"], 10, False),
        (["--no-gc-freeze"], 10, False),
    ],
)
def test_a_gateway_process_collects_its_middle_generation_rarely_and_freezes_again_once_serving(
    given: list[str], middle: int, settled: bool
) -> None:
    # A stream's objects live seconds: a young collection promotes them, and with
    # CPython's 10 the middle generation, every open stream, was walked every few
    # seconds (docs/gateway.md).
    code = (
        "import gc, sys; from services.gateway.__main__ import parser; "
        "from services import flags; from services.gateway.config import Config; "
        "from services.gateway.server import Gateway, freeze_heap, settle_heap; "
        "c = flags.build(Config, parser().parse_args(sys.argv[1:])); "
        "g = Gateway.of(None, c, root='llmgw', own_process=True); "
        "freeze_heap(c); n = gc.get_freeze_count(); x = [[] for _ in range(100)]; "
        "s = g.settle_heap and settle_heap(); "
        "print(gc.get_threshold()[1], s, gc.get_freeze_count() > n)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *given],
        env={**OLD_VARIABLES, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    assert out.stdout.split() == [str(middle), str(settled), str(settled)]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("text", ["7,x,1", "1,2", "0,10,10"])
def test_collector_thresholds_that_are_not_three_positive_integers_are_one_line(
    text: str,
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--gc-thresholds", text],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 2
    assert "--gc-thresholds" in out.stderr and "three positive integers" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_fast_path_is_a_flag_and_no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.cli import app as cli
    from services.cli.gateway import gateway_config
    from services.gateway.server import Gateway

    monkeypatch.setenv("LLMGW_GATEWAY_FASTPATH", "0")  # the round before's switch: ignored
    parser = cli.build_parser()
    for argv, fast in ((["gateway"], True), (["gateway", "--no-fast-path"], False)):
        config = gateway_config(parser.parse_args(argv))
        assert Gateway.of(None, config, root="llmgw").fast_path is fast
    up = parser.parse_args(["up", "--no-fast-path"])
    assert gateway_config(up, "--gateway-listen").fast_path is False


def test_the_three_ways_to_run_a_gateway_take_one_config_with_the_same_defaults() -> None:
    from services import flags
    from services.cli import app as cli
    from services.cli.gateway import gateway_config
    from services.gateway.__main__ import parser
    from services.gateway.config import Config

    made = cli.build_parser()
    alone = flags.build(Config, parser().parse_args([]))
    assert gateway_config(made.parse_args(["gateway"])) == Config() == alone
    assert gateway_config(made.parse_args(["up"]), "--gateway-listen") == Config()
    given = ["--listen", "127.0.0.1:0", "--max-body", "10", "--body-budget", "20"]
    given += ["--used-interval", "2", "--keepalive-interval", "3", "--no-stream-usage"]
    given += ["--queue-per-model", "4", "--upstream-timeout", "5", "--allow-host", "a.b"]
    alone = flags.build(Config, parser().parse_args(given), allow_hosts=("a.b",))
    assert gateway_config(made.parse_args(["gateway", *given])) == alone
    assert alone == Config(
        listen="127.0.0.1:0",
        max_body=10,
        body_budget=20,
        used_interval_s=2.0,
        keepalive_s=3.0,
        stream_usage=False,
        queue_per_model=4,
        upstream_timeout_s=5.0,
        allow_hosts=("a.b",),
    )
