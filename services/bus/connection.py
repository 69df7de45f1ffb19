"""Connecting to NATS: one call, reconnect forever once connected, one clear error if not.

Every service and CLI command connects through `connect`. It must not start a broker
(`llmgw up` does that, explicitly) and must not print tracebacks for the connection's
ordinary life (disconnects, reconnects): one log line each.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from services.bus.broker import read_url
from services.bus.errors import BrokerUnavailable

log = logging.getLogger("llmgw.bus")

ENV_URL = "LLMGW_NATS"


def resolve_url(explicit: str | None, data_dir: Path | None = None) -> str | None:
    """Where the broker is: `--nats URL`, else $LLMGW_NATS, else the URL `llmgw up` recorded."""
    if explicit:
        return explicit
    env = os.environ.get(ENV_URL)
    if env:
        return env
    if data_dir is not None:
        return read_url(data_dir)
    return None


async def connect(
    url: str,
    name: str,
    *,
    connect_timeout: float = 2.0,
    reconnect_wait_s: float = 0.5,
    **options: Any,
) -> Client:
    """A connection to the broker at `url`, or `BrokerUnavailable` if nobody answers now.

    Once connected it reconnects forever: a broker restart is a pause, not a crash.
    """
    initial = True

    async def on_error(e: Exception) -> None:
        # The initial attempt's failure is raised to the caller; logging it too is noise.
        if not initial:
            log.warning("nats %s: %s: %s", name, type(e).__name__, e)

    async def on_disconnected() -> None:
        # A disconnect we asked for (close) is not news.
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats %s: disconnected from %s", name, url)

    async def on_reconnected() -> None:
        log.info(
            "nats %s: reconnected to %s",
            name,
            nc.connected_url.geturl() if nc.connected_url else url,
        )

    nc = Client()
    try:
        # The first connect gets one retry: nats-py's own loop, with reconnect forever,
        # would retry a dead address forever instead of telling the user.
        await nc.connect(
            servers=[url],
            name=name,
            connect_timeout=connect_timeout,  # type: ignore[arg-type]
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            **options,
        )
    except (OSError, TimeoutError, nats.errors.Error) as e:
        with_reason = str(e) or type(e).__name__
        await _quiet_close(nc)
        raise BrokerUnavailable(url, with_reason) from e
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = -1
    initial = False
    return nc


async def _quiet_close(nc: Client) -> None:
    # Closing a never-opened client has nothing to report.
    with contextlib.suppress(Exception):
        await nc.close()
