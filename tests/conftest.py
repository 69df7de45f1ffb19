"""Fixtures shared by every test: a real nats-server, connections to it, a seeded RNG.

The broker is started by the same code as `llmgw up` (`services.bus.EmbeddedBroker`) on a
free loopback port and a temporary store, waited for until JetStream answers, and stopped
at the end. No test mocks the broker.
"""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from services.bus import EmbeddedBroker, connect, ensure_streams

# ----------------------------------------------------------------------------- broker


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


@pytest.fixture(scope="session")
def nats_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One broker for the whole run, for tests that only read what they wrote.

    Tests sharing it must not kill it, and must not assume the stream is empty.
    """
    broker = EmbeddedBroker(tmp_path_factory.mktemp("broker-session"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
async def nc(nats_server: EmbeddedBroker) -> AsyncIterator[Client]:
    """A connection to this test's broker, closed at the end (unclosed ones warn, and
    warnings are errors)."""
    conn = await connect(nats_server.url, "test")
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
