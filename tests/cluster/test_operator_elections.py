"""Operator commands ride out elections: `llmgw scale` while servers of a three-server
cluster are killed with kill -9 is stored every time, and fails none.

Each command reads before it publishes (the stream's info, the snapshots, the log it
checks names against); each of those reads meets the election as the publish does, and
gets the publish's retry. The commands run in this process (`cli.main`, several at once
on threads) so that sixty of them cost seconds, not a minute of interpreter starts; the
servers are real; the first kill is of the server that leads the log at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from schemas import codec, subjects
from schemas import events as ev
from services import cli
from services.bus import Publisher, connect, consume, ensure_streams, publish
from services.clock import new_id
from tests.bus.cluster import Cluster

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

COMMANDS = 61
# KILLS: when so many commands have finished, which server is killed: the log's leader
# (an election, of some 4 to 9 s: a server's raft timeouts), and later another one
# (the commands connected to it move to the others).
KILLS = ((4, "leader"), (30, "follower"))


async def _until(what: str, cond, within: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await cond():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path / "nats", 3) as c:
        yield c


async def test_scale_during_server_kills_is_stored_every_time(
    cluster: Cluster, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = ",".join(cluster.urls)
    nc = await connect(cluster.urls, "test operator")
    js = nc.jetstream()
    # On a failure, the commands not started yet are dropped, not run against a cluster
    # stopped under them.
    stack = contextlib.ExitStack()
    try:
        await ensure_streams(js, replicas=3)
        now = datetime.now(UTC)
        declared = ev.make(
            ev.ModelDeclared(name="m", min=0, max=8, profiles=(ev.ProfileSpec(name="p", gpus=1),)),
            id=new_id(now),
            time=now,
            source="test/operator",
        )
        await Publisher(js).publish(declared)

        done: list[int] = []
        pool = ThreadPoolExecutor(max_workers=6)
        loop = asyncio.get_running_loop()

        def scale(i: int) -> int:
            code = cli.main(["--nats", urls, "scale", "m", str(i % 5)])
            done.append(code)
            return code

        # The test's own look at who leads: short waits, so it sees a new leader soon.
        probe = nc.jetstream(timeout=0.5)
        runs = [loop.run_in_executor(pool, scale, i) for i in range(COMMANDS)]
        stack.callback(pool.shutdown, wait=False, cancel_futures=True)

        async def leader() -> str | None:
            with contextlib.suppress(
                nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError
            ):
                c = (await probe.stream_info(subjects.STREAM)).cluster
                return c.leader if c is not None else None
            return None

        killed = 0
        for at, which in KILLS:
            await _until(f"{at} commands done", _done(done, at))

            async def named() -> bool:
                return await leader() is not None

            await _until("a leader of the log to kill", named)
            name = await leader()
            assert name is not None
            names = [b.server_name for b in cluster.brokers]
            i = names.index(name) if which == "leader" else (names.index(name) + 1) % 3
            cluster.kill(i)
            killed += 1
            # Back once more commands got through (a new leader took over), so the next
            # kill leaves two of three again.
            await _until("commands done after the kill", _done(done, min(at + 8, COMMANDS)))
            await asyncio.to_thread(cluster.brokers[i].start, 30.0)
        codes = await asyncio.gather(*runs)
        err = capsys.readouterr().err
        assert killed == len(KILLS)
        assert codes == [0] * COMMANDS, err
        last = (await js.stream_info(subjects.STREAM)).state.last_seq
        stored = [
            codec.decode(d.data) async for batch in consume.read_range(js, 1, last) for d in batch
        ]
        scales = [e for e in stored if isinstance(e.data, ev.ScaleDesired)]
        assert len(scales) == COMMANDS, "a scale the command reported is not stored once"
        assert len({e.id for e in scales}) == COMMANDS

        # Two servers of three gone: no leader can be elected. The command says so, in
        # its one line, once its retry is spent (a short one here).
        monkeypatch.setattr(publish, "ELECTION_RETRY_S", 1.0)
        cluster.kill(0)
        cluster.kill(1)
        code = await asyncio.to_thread(cli.main, ["--nats", urls, "scale", "m", "1"])
        err = capsys.readouterr().err.strip()
        assert code == 1
        assert err.startswith(
            "llmgw: stream LLMGW has no leader (election); nothing was published "
            "(reading the log before publishing, still after 1s: "
        ), err
        assert "\n" not in err
    finally:
        stack.close()
        await nc.close()


def _done(done: list[int], n: int) -> Callable[[], Awaitable[bool]]:
    async def enough() -> bool:
        return len(done) >= n

    return enough
