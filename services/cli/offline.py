"""Reading a stopped control plane: the log `llmgw up` left in its data directory.

Called by the reading commands (`status`, `view`, `history`, `explain`, `diff`,
`replay`, `preemption plan`) through `services.cli.replay.rebuild_view`, and by
`events export`, `events tail --since` and `snapshot --list`, in place of `cli.session`. When the
broker is found it is that session. When it is not (no URL recorded, or the recorded one
answers nobody) and the data directory holds a stored log that no live `llmgw up` owns
(its lock is free), it starts a temporary embedded broker on that store, on a free
port, reads through it, stops it and gives the lock back, and says so in one line on
stderr. An explicit --nats / $LLMGW_NATS is never second-guessed, and a directory with no
stored log keeps the one-line "start `llmgw up`" error: an empty broker would show an
empty cluster, which is a lie.

It must not publish: the temporary broker serves this one command's reads and nobody
else, and the directory is locked while it runs, so an `llmgw up` started meanwhile
refuses rather than sharing the store.

A data directory that cannot be written (a read-only mount, a copy without write
permission) can be neither locked nor served: nats-server writes to its store as it
starts. Its store is then copied to a temporary directory, read there, and the copy
removed; the directory itself is never written. No `llmgw up` can be writing to it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from services.bus.urls import public_url
from services.cli import app as cli


@dataclass
class Opened:
    """A session to read through, and what to call where it reads from."""

    session: cli.Session
    where: str
    offline: bool = False


def stored_log(data: Path) -> bool:
    """Whether `data` holds a JetStream store with anything in it."""
    from services.bus import broker

    store = data / broker.STORE_DIR
    try:
        return any(p.is_file() for p in store.rglob("*"))
    except OSError:
        return False


@contextlib.asynccontextmanager
async def session(args: argparse.Namespace, name: str) -> AsyncIterator[Opened]:
    """The live broker's session, else one on a temporary broker over the stored log."""
    from services.bus.errors import BrokerUnavailable

    explicit = getattr(args, "nats", None) or os.environ.get(cli.ENV_NATS)
    stack = contextlib.AsyncExitStack()
    cli.root(args)  # a bad --root is the user's mistake, not a broker that is gone
    try:
        s = await stack.enter_async_context(cli.session(args, name))
    except cli.UsageError:
        raise
    except (cli.CliError, BrokerUnavailable):
        data = cli.data_dir(args)
        opened = None if explicit or not stored_log(data) else _offline(args, name, data)
        if opened is None:
            raise
    else:
        async with stack:
            yield Opened(s, s.url)
        return
    async with opened as got:
        yield got


@contextlib.asynccontextmanager
async def _temporary(
    args: argparse.Namespace, name: str, data: Path, fd: int
) -> AsyncIterator[Opened]:
    from services.bus import broker

    before = broker.read_url(data)
    try:
        async with _served(args, name, data, data, "") as got:
            yield got
    finally:
        # The URL the stopped `up` left (stale, but its own) is put back as it was.
        if before is not None:
            broker.write_url(data, before)
        os.close(fd)


@contextlib.asynccontextmanager
async def _copied(
    args: argparse.Namespace, name: str, data: Path, why: str
) -> AsyncIterator[Opened]:
    """The stored log of a directory that cannot be written, read from a copy."""
    from services.bus import broker

    tmp = Path(tempfile.mkdtemp(prefix="llmgw-read-"))
    try:
        try:
            shutil.copytree(data / broker.STORE_DIR, tmp / broker.STORE_DIR, symlinks=True)
        except OSError as e:
            raise cli.CliError(
                f"{data} is {why}, and its stored log cannot be copied to read it: {e}"
            ) from None
        async with _served(args, name, data, tmp, f" (a copy: {data} is {why})") as got:
            yield got
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.asynccontextmanager
async def _served(
    args: argparse.Namespace, name: str, data: Path, store: Path, note: str
) -> AsyncIterator[Opened]:
    """A temporary embedded broker on the store in `store`, the stored log of `data`."""
    from services.bus import broker, connection

    b = broker.EmbeddedBroker(store, auth=True)
    try:
        b.start()
        print(
            f"{cli.PROG}: llmgw up is not running on {data}; read from its stored log{note}",
            file=sys.stderr,
        )
        nc = await connection.connect(b.url, name)
        try:
            s = cli.Session(nc, nc.jetstream(), public_url(b.url), cli.root(args))
            yield Opened(s, f"the stored log in {data}", offline=True)
        finally:
            await connection.close(nc)
    finally:
        b.stop()


# _UNWRITABLE are the errors of a lock file that cannot be made or opened for writing.
_UNWRITABLE = {errno.EROFS: "read-only", errno.EACCES: "not writable", errno.EPERM: "not writable"}


def _offline(
    args: argparse.Namespace, name: str, data: Path
) -> contextlib.AbstractAsyncContextManager[Opened] | None:
    """The temporary reading session, or None when a live `llmgw up` holds the lock."""
    from services.bus import broker

    try:
        fd = broker.lock_data_dir(data)
    except OSError as e:
        why = _UNWRITABLE.get(e.errno or 0)
        if why is None:
            raise
        return _copied(args, name, data, why)
    if fd is None:
        return None
    return _temporary(args, name, data, fd)
