"""Running one service as its own process: `python -m services.scheduler|preemption|projector`.

Each of those modules parses its own flags and hands `run_service` a `build(nc, js)`
that makes the service; this module does what they share: find the broker, connect,
make sure the streams exist, keep the heap settled (`services.plane.heap`), turn SIGTERM and Ctrl-C into a clean stop, log lines a
person can follow, and turn a failure a user can act on into one line and an exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol

from services.bus import (
    BrokerUnavailable,
    BusError,
    connect,
    connection,
    ensure_streams,
    resolve_url,
    tracing,
)
from services.plane import heap
from services.plane.process import Config


class Service(Protocol):
    async def run(self, stop: asyncio.Event) -> None: ...


def run_service(
    name: str,
    nats: str | None,
    root: str,
    build: Callable[[Any, Any], Service],
    *,
    failures: tuple[type[BaseException], ...] = (),
    process: Config | None = None,
    ensure: bool = True,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    echo: bool = True,
) -> int:
    """Run the service `build` makes until SIGTERM/SIGINT; returns the exit code.

    `failures` are the service's own errors a user can act on (printed as one line);
    `process`, the process's own settings (`--no-gc-freeze`, `--no-wire-reader`);
    `ensure` False: the streams are not made or checked (a process `llmgw up` starts
    after making them with its own settings: `services.gateway.processes`); `loop_factory`,
    what makes its event loop (None: asyncio's own); `echo` False: the broker delivers
    none of the process's own messages back to it (a service that reads none of them).
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)-17s %(message)s", datefmt="%H:%M:%S"
    )
    logging.getLogger("nats").setLevel(logging.WARNING)
    tracer_provider = tracing.setup_from_env(f"llmgw-{name}")
    url = resolve_url(nats)
    if url is None:
        print(f"{name}: no broker: pass --nats URL or set LLMGW_NATS", file=sys.stderr)
        return 2
    catch: tuple[type[BaseException], ...] = (BrokerUnavailable, BusError, *failures)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_serve(name, url, root, build, process or Config(), ensure, echo))
    except catch as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flushes the spans still batched


async def _serve(
    name: str,
    url: str,
    root: str,
    build: Callable[[Any, Any], Service],
    process: Config,
    ensure: bool = True,
    echo: bool = True,
) -> int:
    nc = await connect(url, name, wire_reader=process.wire_reader, no_echo=not echo)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        js = nc.jetstream()
        if ensure:
            await ensure_streams(js, root)
        keeper = asyncio.create_task(heap.keep(stop, freeze=process.gc_freeze), name="heap")
        try:
            await build(nc, js).run(stop)
        finally:
            stop.set()
            await keeper
        return 0
    finally:
        # A broker gone as the service stops (its host's plane stopping first) makes
        # the close's last flush fail: nothing is left to say to it.
        await connection.close(nc)
