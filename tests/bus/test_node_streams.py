"""Node streams (services.bus.stream): a log made so takes a node's reports through the
node's own stream and stays so; the node's status goes to the log itself; a node stream
at its limits refuses at once, with its reason, and is said once by the watch."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime

import pytest
from nats.js.client import JetStreamContext

from schemas import codec, subjects
from schemas import events as ev
from services.bus import Publisher, PublishError, consume, ensure_streams, stream
from services.bus import node_streams as watch
from services.bus.urls import users
from services.clock import new_id

pytestmark = pytest.mark.timeout(60)


def _inventory(node: str) -> ev.Event:
    return ev.make(
        ev.NodeInventory(node=node, gpus=(), cpu_cores=1, memory_gb=1),
        id=new_id(),
        time=datetime.now(UTC),
        source="test",
    )


async def _in_log(js: JetStreamContext, subject: str) -> list[consume.Delivery]:
    return [d async for b in consume.read_range(js, 1, filter_subject=subject) for d in b]


async def test_a_node_stream_feeds_the_log_and_the_log_stays_fed(js: JetStreamContext) -> None:
    info = await ensure_streams(js, node_streams=True)
    assert stream.fed_by_nodes(info)
    assert "llmgw.node.*.status" in (info.config.subjects or [])
    assert await stream.ensure_node_stream(js, "rack/7") == stream.node_stream_name("rack/7")
    # A service starting later, which does not ask for node streams, keeps them.
    again = await ensure_streams(js)
    assert stream.fed_by_nodes(again)
    assert [s.name for s in again.config.sources or []] == ["LLMGW_NODE_rack~2F7"]

    pub = Publisher(js)
    event = _inventory("rack/7")
    inv = await pub.publish(event)
    status = await pub.publish(
        ev.make(ev.NodeCordoned(node="rack/7"), id=new_id(), time=datetime.now(UTC), source="t")
    )
    assert inv.stream == "LLMGW_NODE_rack~2F7" and status.stream == subjects.STREAM
    deadline = time.monotonic() + 10
    while not (got := await _in_log(js, inv.subject)):
        assert time.monotonic() < deadline, "the inventory never reached the log"
        await asyncio.sleep(0.02)
    assert [codec.decode(d.data).id for d in got] == [event.id]


async def test_a_full_node_stream_refuses_at_once_and_is_said_once(
    js: JetStreamContext, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw.bus")
    monkeypatch.setattr(stream, "NODE_MAX_MSGS", 3)
    await ensure_streams(js, node_streams=True)
    await stream.ensure_node_stream(js, "gpu-f1")
    await stream.ensure_node_stream(js, "gpu-f2")
    pub = Publisher(js, retry_s=30)
    for _ in range(3):
        await pub.publish(_inventory("gpu-f1"))
    started = time.monotonic()
    with pytest.raises(PublishError, match="the stream is full"):
        await pub.publish(_inventory("gpu-f1"))
    assert time.monotonic() - started < 5  # refused, not ridden out as an election
    # Another node is not affected.
    assert (await pub.publish(_inventory("gpu-f2"))).stream == "LLMGW_NODE_gpu-f2"
    full: set[str] = set()
    for _ in range(3):
        await watch.check(js, "llmgw", full)
    said = [r.message for r in caplog.records if "reached the limits of its stream" in r.message]
    assert len(said) == 1 and said[0].startswith("node gpu-f1 reached"), said
    assert watch.FULL["gpu-f1"] >= 1
    letter = await js.get_last_msg(stream.DLQ_STREAM, subjects.dlq_subject("LLMGW_NODE_gpu-f1"))
    assert b"node gpu-f1 reached the limits" in letter.data


def test_the_users_a_url_logs_in_as() -> None:
    assert users("nats://control:pw@127.0.0.1:4222") == {"control"}
    assert users("nats://llmgw:x@h:1,nats://llmgw:y@h:2") == {"llmgw"}
    assert users("nats://127.0.0.1:4222") == set()
    assert users("u:p@h:4222") == {"u"}
    assert users("nats://a%40b:p@h:4222") == {"a@b"}
