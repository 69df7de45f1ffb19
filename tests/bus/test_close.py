"""`connection.close`: a client closed whatever became of its broker. nats-py's wait for
its socket's close can end in a `CancelledError` that is not the caller's when a
cluster's server is killed as a command ends (seen in the operator's elections test: a
traceback instead of the command's answer); the caller's own cancellation still goes on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.bus import EmbeddedBroker, connection

pytestmark = pytest.mark.timeout(20)


class _Closing:
    """A client whose close ends as nats-py's did there: its inner waiter cancelled."""

    def __init__(self, then: BaseException | None = None, hang: bool = False) -> None:
        self.then, self.hang, self.closed = then, hang, False

    async def close(self) -> None:
        self.closed = True
        if self.hang:
            await asyncio.Event().wait()
        if self.then is not None:
            raise self.then


async def test_a_close_whose_waiter_was_cancelled_under_it_returns() -> None:
    c = _Closing(asyncio.CancelledError())
    await connection.close(c)  # type: ignore[arg-type]
    assert c.closed


async def test_a_close_that_fails_returns() -> None:
    await connection.close(_Closing(OSError("gone")))  # type: ignore[arg-type]


async def test_the_callers_own_cancellation_goes_on() -> None:
    c = _Closing(hang=True)
    task = asyncio.create_task(connection.close(c))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert c.closed
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_real_client_closes_after_its_broker_was_killed(tmp_path: Any) -> None:
    broker = EmbeddedBroker(tmp_path / "b")
    broker.start()
    try:
        nc = await connection.connect(broker.url, "test close")
        broker.kill()
        await connection.close(nc)
        assert nc.is_closed
    finally:
        broker.kill()  # a failure above leaves no server behind
