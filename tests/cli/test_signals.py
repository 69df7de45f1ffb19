"""Long-running commands stop on SIGTERM or SIGINT even when stuck starting."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from services.cli import app

pytestmark = pytest.mark.timeout(30)


def test_work_that_watches_stop_ends_with_its_code() -> None:
    async def work(stop: asyncio.Event) -> int:
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)
        await stop.wait()
        return 0

    assert asyncio.run(app.until_signalled(work)) == 0


def test_work_stuck_starting_is_cancelled_after_the_grace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cancelled = []

    async def stuck(stop: asyncio.Event) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            await asyncio.Event().wait()  # never looks at stop, as a start stuck on I/O
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 0

    assert asyncio.run(app.until_signalled(stuck, grace_s=0.2)) == 130
    assert cancelled == [True]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not stop within" in err


def test_a_second_signal_stops_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    async def stuck(stop: asyncio.Event) -> int:
        os.kill(os.getpid(), signal.SIGINT)
        await stop.wait()
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.Event().wait()
        return 0

    loop_time: list[float] = []

    async def main() -> int:
        t0 = asyncio.get_running_loop().time()
        code = await app.until_signalled(stuck, grace_s=60)
        loop_time.append(asyncio.get_running_loop().time() - t0)
        return code

    assert asyncio.run(main()) == 130
    assert loop_time[0] < 30
    # It says why it stopped: not a grace run out, which did not happen.
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a second signal" in err and "within" not in err
