"""Fixtures shared by every test: a real nats-server, connections to it, a seeded RNG.

The broker is started by the same code as `llmgw up` (`services.bus.EmbeddedBroker`) on a
free loopback port and a temporary store, waited for until JetStream answers, and stopped
at the end: one per test, or one per module for a module marked `module_broker` whose
tests keep to their own names. No test mocks the broker.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from services.bus import EmbeddedBroker, connect, ensure_streams

# ----------------------------------------------------------------------------- options


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here, not in tests/engine/conftest.py: pytest reads options only from the
    # conftest files it loads at its start.
    parser.addoption(
        "--engine-python",
        default=str(Path(__file__).resolve().parents[1] / ".venv-engine" / "bin" / "python"),
        help="the interpreter of the engine environment (vLLM's CPU build) that the "
        "engine tier (tests/engine, marked `engine`) runs vLLM with "
        "(default: .venv-engine/bin/python in the repository)",
    )


# ----------------------------------------------------------------------------- the engine tier

# _BEGAN: when the session began (time.monotonic), kept in the config's stash.
_BEGAN = pytest.StashKey[float]()
# TIER_LIMIT_S is what the engine tier must take at most on 2 cores, its environment
# installed (CONTRIBUTING.md): said beside its time.
TIER_LIMIT_S = 480


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_BEGAN] = time.monotonic()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The engine tier's time, when its tests ran (`pytest -m engine`): its own line."""
    ran = [
        r
        for kind in ("passed", "failed", "error")
        for r in terminalreporter.stats.get(kind, [])
        if getattr(r, "when", "") == "call" and "engine" in getattr(r, "keywords", {})
    ]
    if not ran:
        return
    took = time.monotonic() - config.stash[_BEGAN]
    failed = sum(1 for r in ran if not r.passed)
    terminalreporter.write_line(
        f"engine tier: {len(ran)} tests ({failed} failed) in {took:.0f} s "
        f"({took / 60:.1f} min; at most {TIER_LIMIT_S // 60} min on 2 cores)"
    )


# ----------------------------------------------------------------------------- broker


def pytest_configure(config: pytest.Config) -> None:
    # A suite started where Ctrl-C is ignored (a shell's background job, `cmd &`) would
    # pass that on to every process it starts, and the tests that stop one with Ctrl-C
    # would fail for it: the processes the tests start get Ctrl-C's default back.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers",
        "module_broker: `nc` and `js` use one broker shared by the module's tests "
        "(`module_nats_server`) instead of one per test",
    )


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A broker of this test's own: `.url`, `.kill()`, `.start()` (same store and port),
    `.stop()`. Use it for fault tests and anything that needs an empty stream."""
    broker = EmbeddedBroker(tmp_path / "broker")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def module_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One broker for every test of a module marked `module_broker`, fresh for the module.

    Its tests share a stream, so each keeps to names of its own (node, replica, consumer)
    and reads only those; none kills or stops it, and none assumes the stream is empty.
    The stream's configuration is put back at every test's start by `js`.
    """
    broker = EmbeddedBroker(tmp_path_factory.mktemp("broker-module"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def js_broker(request: pytest.FixtureRequest) -> EmbeddedBroker:
    """The broker `nc` and `js` talk to: the module's (`module_nats_server`) in a module
    marked `module_broker`, else this test's own (`nats_server`)."""
    shared = request.node.get_closest_marker("module_broker") is not None
    if shared and "nats_server" in request.fixturenames:
        pytest.fail(
            "a test on its module's broker cannot also ask for `nats_server`: "
            "give it a module of its own or drop the `module_broker` mark",
            pytrace=False,
        )
    found: EmbeddedBroker = request.getfixturevalue(
        "module_nats_server" if shared else "nats_server"
    )
    return found


@pytest.fixture
async def nc(js_broker: EmbeddedBroker) -> AsyncIterator[Client]:
    """A connection to `js_broker`, closed at the end (unclosed ones warn, and warnings are
    errors)."""
    conn = await connect(js_broker.url, "test")
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    """JetStream on `nc`, with the event stream and the dead-letter stream in place."""
    ctx = nc.jetstream()
    await ensure_streams(ctx)
    return ctx


# ----------------------------------------------------------------------------- randomness

_SEED_KEY = pytest.StashKey[int]()


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """A `random.Random` whose seed is printed when the test fails.

    Set LLMGW_SEED to replay a failure with the same seed.
    """
    env = os.environ.get("LLMGW_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(2**32)
    request.node.stash[_SEED_KEY] = seed
    return random.Random(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    seed = item.stash.get(_SEED_KEY, None)
    if seed is not None and report.failed:
        report.sections.append(("rng seed", f"reproduce with LLMGW_SEED={seed}"))
    return report
