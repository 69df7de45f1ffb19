"""Helpers for the bus tests: valid events of a few types, on their own subjects; the
ordered reader to test (`either_reader`: the wire reader, then the nats-py one); a
three-server cluster (`nats_cluster`)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.aio.client import Client

from schemas import events as ev
from schemas import ids
from services.bus import EmbeddedBroker, connect
from tests.bus.cluster import Cluster

_T0 = datetime(2026, 11, 29, 14, 0, tzinfo=UTC)
_counter = itertools.count()


def make_event(i: int, kind: str = "scale") -> ev.Event:
    """A valid event number `i`; its id is unique in the process and sorts by `i`."""
    n = next(_counter)
    eid = ids.ulid(1_800_000_000_000 + n, n.to_bytes(10, "big"))
    t = _T0 + timedelta(seconds=i)
    data: ev.Data
    match kind:
        case "scale":
            data = ev.ScaleDesired(model=f"meta/llama-{i % 7}", replicas=i % 5)
        case "replica":
            data = ev.ReplicaState(
                replica=f"r-{i}",
                model="llama-70b",
                profile="tp4",
                state="ready",
                shards=(ev.ShardSpec(node="gpu-a1", gpus=(0, 1, 2, 3)),),
            )
        case "lost":
            data = ev.NodeLost(node=f"gpu-{i % 3}", reason="heartbeats missed")
        case _:
            raise ValueError(kind)
    return ev.make(data, id=eid, time=t, source="test")


@pytest.fixture
def events() -> Callable[..., list[ev.Event]]:
    """`events(n, kind="scale")`: n valid events, a mix of types when kind is "mixed"."""

    def make(n: int, kind: str = "scale") -> list[ev.Event]:
        kinds = ("scale", "replica", "lost")
        return [make_event(i, kinds[i % 3] if kind == "mixed" else kind) for i in range(n)]

    return make


@pytest.fixture(params=["wire", "nats-py"])
def either_reader(request: pytest.FixtureRequest) -> str:
    """Runs a test once with each ordered reader behind `read_ordered` / `read_range`:
    the `nc` (and so `js`) of such a test is connected with it, and a test that connects
    itself passes `wire_reader=either_reader == "wire"`, as a process's
    `--no-wire-reader` does."""
    return str(request.param)


@pytest.fixture
async def nc(js_broker: EmbeddedBroker, request: pytest.FixtureRequest) -> AsyncIterator[Client]:
    """A connection to `js_broker`, closed at the end; with the reader of `either_reader`
    when the test runs with each."""
    wire_reader = True
    if "either_reader" in request.fixturenames:
        wire_reader = request.getfixturevalue("either_reader") == "wire"
    conn = await connect(js_broker.url, "test", wire_reader=wire_reader)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Three servers routed into one JetStream cluster on loopback, stopped at the end."""
    with Cluster(tmp_path / "cluster", 3) as c:
        yield c
