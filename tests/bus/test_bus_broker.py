"""The embedded broker: starts, records its URL, survives kill -9 with its data, and a
client that finds nobody says in one line what to do."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas import subjects
from services.bus import (
    BrokerError,
    BrokerUnavailable,
    EmbeddedBroker,
    Publisher,
    connect,
    consume,
    ensure_streams,
    find_binary,
    free_port,
    read_url,
    resolve_url,
)
from services.bus.consume import read_range


def test_find_binary_finds_the_packaged_server():
    assert find_binary().endswith("nats-server")


def test_find_binary_says_how_to_get_one(monkeypatch):
    monkeypatch.setenv("LLMGW_NATS_SERVER", "/nonexistent/nats-server")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("sys.prefix", "/nonexistent")
    monkeypatch.setattr("sys.executable", "/nonexistent/python")
    with pytest.raises(BrokerError, match="nats-server not found"):
        find_binary()


def test_start_records_the_url_and_a_clean_stop_removes_it(tmp_path):
    with EmbeddedBroker(tmp_path) as b:
        assert b.running and b.pid
        assert read_url(tmp_path) == b.url == f"nats://127.0.0.1:{b.port}"
        assert (tmp_path / "jetstream").is_dir()
        assert resolve_url(None, tmp_path) == b.url
    assert not b.running
    assert read_url(tmp_path) is None
    assert "Server is ready" in (tmp_path / "nats-server.log").read_text()


def test_a_taken_port_is_one_clear_error(tmp_path, nats_server):
    other = EmbeddedBroker(tmp_path / "other", port=nats_server.port)
    with pytest.raises(BrokerError, match="exited with status"):
        other.start(timeout=5)
    assert not other.running


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(
    tmp_path, nats_server, monkeypatch
):
    # The port picked is free when picked, and taken by another process before the
    # server binds it (here, the test's broker has it): the broker picks another.
    ports = iter([nats_server.port])
    real = free_port

    def picked(host: str = "127.0.0.1") -> int:
        return next(ports, None) or real(host)

    monkeypatch.setattr("services.bus.broker.free_port", picked)
    with EmbeddedBroker(tmp_path) as b:
        assert b.running and b.port != nats_server.port
        assert read_url(tmp_path) == b.url
    log = (tmp_path / "nats-server.log").read_text()
    assert "address already in use" in log and "Server is ready" in log


async def test_nobody_listening_is_one_line_saying_how_to_start_one():
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable) as e:
        await connect(url, "test", connect_timeout=1)
    msg = str(e.value)
    assert "\n" not in msg
    assert url in msg and "llmgw up" in msg and "LLMGW_NATS" in msg and "--nats" in msg
    assert time.monotonic() - t0 < 5


async def test_wrong_credentials_are_not_a_missing_server(tmp_path, capsys):
    from services import cli
    from services.bus import BrokerRefused

    with EmbeddedBroker(tmp_path / "auth", auth=True) as b:
        password = (tmp_path / "auth" / "broker.password").read_text().strip()
        wrong = b.url.replace(f":{password}@", ":not-the-password@")
        for url in (wrong, b.address):  # a wrong password, and none at all
            with pytest.raises(BrokerRefused) as e:
                await connect(url, "test", connect_timeout=1)
            msg = str(e.value)
            assert msg.startswith(f"the NATS server at {b.address} refused the credentials")
            assert "llmgw up" not in msg and "not-the-password" not in msg
        # As a command says it: one line, exit 1, no credential in it.
        code = await asyncio.to_thread(cli.main, ["--nats", wrong, "status"])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1, err
        assert "refused the credentials" in err and "not-the-password" not in err
        assert password not in err


@pytest.mark.timeout(60)
async def test_kill_9_and_restart_on_the_same_store_keeps_the_data(nats_server, events):
    nc = await connect(nats_server.url, "survivor")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        pub = Publisher(js)
        evs = events(200, "mixed")
        await pub.publish_many(evs[:150])
        port = nats_server.port

        nats_server.kill()
        assert not nats_server.running
        assert read_url(nats_server.data_dir) == nats_server.url  # a crash leaves it stale
        nats_server.start()
        assert nats_server.port == port

        deadline = time.monotonic() + 20
        while not (nc.stats["reconnects"] >= 1 and nc.is_connected):
            assert time.monotonic() < deadline, "client did not reconnect"
            await asyncio.sleep(0.05)
        await ensure_streams(js)
        await pub.publish_many(evs[100:])  # 50 retried (duplicates), 50 new
        seen = [d async for b in read_range(js, 1) for d in b]
        assert [d.seq for d in seen] == list(range(1, 201))
        info = await js.stream_info(subjects.STREAM)
        assert info.state.messages == 200
    finally:
        await nc.close()


@pytest.mark.timeout(60)
async def test_an_ordered_reader_resumes_after_the_broker_restarts(nats_server, events):
    nc = await connect(nats_server.url, "follower")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        pub = Publisher(js)
        evs = events(40)
        await pub.publish_many(evs[:20])
        got: list[int] = []
        first, rest = asyncio.Event(), asyncio.Event()
        stop = asyncio.Event()

        def on_batch(batch):
            got.extend(d.seq for d in batch)
            if len(got) >= 20:
                first.set()
            if len(got) >= 40:
                rest.set()
                stop.set()

        task = asyncio.create_task(
            consume.read_ordered(js, from_seq=1, on_batch=on_batch, stop=stop)
        )
        await asyncio.wait_for(first.wait(), 10)
        nats_server.kill()
        nats_server.start()
        deadline = time.monotonic() + 20
        while not (nc.stats["reconnects"] >= 1 and nc.is_connected):
            assert time.monotonic() < deadline, "client did not reconnect"
            await asyncio.sleep(0.05)
        await pub.publish_many(evs[20:])
        await asyncio.wait_for(rest.wait(), 20)
        await asyncio.wait_for(task, 5)
        assert got == list(range(1, 41))
    finally:
        await nc.close()
