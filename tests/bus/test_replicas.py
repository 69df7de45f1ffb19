"""How many copies of the plane's state a broker keeps: in a cluster, the log, the dead
letters, the leader leases and the snapshots at R3 (the least that survives losing a
server) unless `--replicas N` says otherwise; on a single server R1, where nothing else
is possible."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.js.client import JetStreamContext

from services.bus import connect, ensure_streams, snapshots, stream
from services.bus.broker import EmbeddedBroker
from services.bus.errors import BusError
from services.plane.lease import DEFAULT_BUCKET, Lease, ensure_bucket
from services.up import Running, UpOptions, run
from tests.bus.cluster import Cluster

pytestmark = pytest.mark.timeout(90)


async def _copies(js: JetStreamContext) -> dict[str, int]:
    """Per stream of the plane, its replicas."""
    out = {}
    for name in ("LLMGW", "LLMGW_DLQ", f"KV_{DEFAULT_BUCKET}", f"OBJ_{snapshots.BUCKET}"):
        info = await js.stream_info(name)
        out[name] = info.config.num_replicas or 1
    return out


async def _make_all(js: JetStreamContext, replicas: int | None) -> None:
    await ensure_streams(js, replicas=replicas)
    lease = Lease(js, name="llmgw.test", holder="h", replicas=replicas)
    # A bucket just made on a cluster answers once its stream has a leader: a lease
    # asks again, as `Lease.run` does every renewal.
    deadline = asyncio.get_running_loop().time() + 30
    while not await lease.acquire():
        assert asyncio.get_running_loop().time() < deadline, "the lease was never taken"
        await asyncio.sleep(0.2)
    await lease.release()
    await snapshots.bucket(js)


async def test_a_cluster_keeps_three_copies_of_everything(nats_cluster: Cluster) -> None:
    nc = await connect(nats_cluster.urls, "replicas")
    try:
        js = nc.jetstream()
        await _make_all(js, None)
        assert set((await _copies(js)).values()) == {3}
    finally:
        await nc.close()


async def test_replicas_given_are_the_logs(nats_cluster: Cluster) -> None:
    """`--replicas 1` (a throwaway cluster, say) is what the log and the dead letters
    get; they are made to it, not to the default."""
    nc = await connect(nats_cluster.urls, "replicas")
    try:
        js = nc.jetstream()
        await ensure_streams(js, replicas=1)
        copies = {n: (await js.stream_info(n)).config.num_replicas for n in ("LLMGW", "LLMGW_DLQ")}
        assert copies == {"LLMGW": 1, "LLMGW_DLQ": 1}
    finally:
        await nc.close()


async def test_a_single_server_keeps_one_copy(nats_server: EmbeddedBroker) -> None:
    nc = await connect(nats_server.url, "replicas")
    try:
        js = nc.jetstream()
        await _make_all(js, None)
        assert set((await _copies(js)).values()) == {1}
    finally:
        await nc.close()


async def test_up_keeps_the_leases_and_snapshots_in_as_many_copies_as_the_log(
    nats_cluster: Cluster, tmp_path: Path
) -> None:
    """`llmgw up --replicas 1` on a cluster: the log, the dead letters, the lease bucket
    and the snapshot bucket are all made at R1 (a throwaway cluster), not only the log."""
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    opts = UpOptions(data=tmp_path / "data", nats_url=",".join(nats_cluster.urls), replicas=1)
    task = asyncio.create_task(run(opts, stop, on_ready=ready.set_result))
    try:
        await asyncio.wait_for(ready, 30)
        nc = await connect(nats_cluster.urls, "replicas")
        try:
            assert set((await _copies(nc.jetstream())).values()) == {1}
        finally:
            await nc.close()
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 40) == 0


async def test_setup_asks_again_while_a_starting_cluster_cannot_place_copies() -> None:
    """Right after a cluster elects its meta leader, the leader may not know every server
    yet and refuses replicated streams with "no suitable peers for placement" (a 400,
    err_code 10005): setup asks again, as it does while there is no leader at all."""
    tries = 0

    async def make() -> str:
        nonlocal tries
        tries += 1
        if tries < 3:
            raise nats.js.errors.BadRequestError(
                code=400, err_code=stream.NO_PEERS, description="no suitable peers for placement"
            )
        return "made"

    assert await stream.settled(make) == "made"
    assert tries == 3


async def test_the_wait_for_placement_counts_from_the_first_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An election that took a while of timeouts does not use up the wait for the
    refusals to place that come right after it."""
    monkeypatch.setattr(stream, "PLACEMENT_S", 1.0)
    tries = 0

    async def make() -> str:
        nonlocal tries
        tries += 1
        if tries <= 4:  # about 1.75 s of timeouts: past PLACEMENT_S
            raise nats.errors.TimeoutError
        if tries <= 5:
            raise nats.js.errors.BadRequestError(
                code=400, err_code=stream.NO_PEERS, description="no suitable peers for placement"
            )
        return "made"

    assert await stream.settled(make) == "made"


async def test_too_few_servers_for_the_copies_asked_is_one_clear_error(
    nats_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five copies of the lease bucket on three servers: after asking for PLACEMENT_S,
    one error that says why and what to do (it was a BucketNotFoundError from the look
    for a bucket that a refused create had not made)."""
    monkeypatch.setattr(stream, "PLACEMENT_S", 1.0)
    nc = await connect(nats_cluster.urls, "replicas")
    try:
        js = nc.jetstream()
        with pytest.raises(BusError, match=r"no servers to place the copies on.*--replicas"):
            await ensure_bucket(js, "five_copies", 5.0, 5)
        with pytest.raises(BusError, match="no servers to place the copies on"):
            await snapshots.bucket(js, "five_copies_obj", replicas=5)
    finally:
        await nc.close()
