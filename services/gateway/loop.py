"""The event loop a gateway process of its own runs on (`--event-loop`).

Used by `python -m services.gateway` and `llmgw gateway` (not `llmgw up`, whose loop is
the whole plane's). uvloop is libuv's loop for asyncio, written in Cython: the same
interface, the reference being the standard library's loop, which stays one flag away
(`--event-loop asyncio`). Measured with tests/bench/bench_peers.py on one 2-core host,
the gateway's CPU per request is lower on uvloop (docs/performance.md, "The gateway's
cost per request"). `auto`, the default, is uvloop where it is installed (a dependency
of llmgw where it builds), else asyncio.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from typing import cast

from services.gateway.errors import GatewayError

# EVENT_LOOPS are what --event-loop may say.
EVENT_LOOPS = ("auto", "uvloop", "asyncio")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def loop_factory(name: str) -> LoopFactory | None:
    """What makes the loop `name` (None: asyncio's own); `GatewayError` with one line
    when `uvloop` is asked for and not installed."""
    if name == "asyncio":
        return None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        if name == "uvloop":
            raise GatewayError(
                "--event-loop uvloop: uvloop is not installed (pip install uvloop, or "
                "--event-loop asyncio)"
            ) from None
        return None
    return cast(LoopFactory, uvloop.new_event_loop)


def loop_name() -> str:
    """The running loop's name, as the gateway says it serves: uvloop or asyncio."""
    return (
        "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    )
