"""`tracing.enabled`, asked for each request a gateway serves: what it says follows the
provider in use (the bus's own, then the global one), and asking does not read the
environment each time (OpenTelemetry's lookup did: 2% of a gateway's request)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import pytest
from opentelemetry.sdk.trace import TracerProvider

from services.bus import tracing

pytestmark = pytest.mark.timeout(30)


class _Unread(Mapping[str, str]):
    """An environment that may not be read."""

    def __getitem__(self, key: str) -> str:
        raise AssertionError(f"the environment read for {key}")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("the environment read")

    def __len__(self) -> int:
        raise AssertionError("the environment read")


def test_enabled_follows_the_provider_and_reads_the_environment_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    provider = TracerProvider()  # which reads its own settings from the environment
    tracing.use_provider(None)
    try:
        first = tracing.enabled()  # the environment read here, at most
        with monkeypatch.context() as m:
            m.setattr(os, "environ", _Unread())
            assert tracing.enabled() is first
            assert tracing.enabled() is first
            tracing.use_provider(provider)
            assert tracing.enabled()
            tracing.use_provider(None)
            assert tracing.enabled() is first
    finally:
        tracing.use_provider(None)
