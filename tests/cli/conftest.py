"""Fixtures of the CLI tests: no ambient broker, and a second broker when a test needs one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.bus import EmbeddedBroker


@pytest.fixture(autouse=True)
def _no_ambient_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A developer's own LLMGW_* settings must not point these tests at their cluster.
    for name in ("LLMGW_NATS", "LLMGW_ROOT", "LLMGW_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMGW_DATA", str(tmp_path / "no-llmgw-up-here"))


@pytest.fixture
def second_server(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    broker = EmbeddedBroker(tmp_path / "broker-2")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
