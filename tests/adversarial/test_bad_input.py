"""The adversarial suite: a running plane (`llmgw up` with two simulated nodes, a real
process) takes bad input of many kinds, as an attacker or an unlucky operator would send
it, and after each one:
- every process is alive (`up` and the embedded broker it supervises);
- a valid sentinel event sent after it is applied (the plane did not stop or freeze);
- what cannot decode or does not belong is on the dead letters, with its reason; what
  decodes but breaks an invariant is a rejection, never applied;
- the SQLite view equals an offline replay of the exported log, at the same sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
import pytest_asyncio
from nats.js.client import JetStreamContext

from schemas import subjects
from services.bus import DLQ_STREAM, consume
from services.bus.consume import read_dead_letter
from services.bus.stream import MAX_MSG_BYTES
from services.core.ingest import Ingest
from services.core.view import encode_state
from services.projector import store
from tests.up_process import FAST, UpProcess

pytestmark = [pytest.mark.timeout(60), pytest.mark.module_broker]

MODEL = "adv"
SENTINEL = "sentinel"


@dataclass
class Plane:
    up: UpProcess
    url: str

    @property
    def data(self) -> Path:
        return self.up.data

    @property
    def log(self) -> Path:
        return self.up.log

    def alive(self) -> bool:
        return self.up.alive()


@contextlib.contextmanager
def running_plane(base: Path, *args: str, bounds: str = "min: 1") -> Iterator[Plane]:
    """`llmgw up --simulate 2x8xH100-80GB ARGS` on `base`, with MODEL applied (`bounds`,
    its min and max); stopped at the end, its output free of tracebacks."""
    up = UpProcess(base / "data", base / "up.log", "--simulate", "2x8xH100-80GB", *FAST, *args)
    try:
        url = up.wait_url()
        spec = base / "cluster.yaml"
        spec.write_text(
            f"models:\n  - {{name: {MODEL}, class: opportunistic, {bounds},"
            " profiles: [{name: tp1, gpus: 1}]}\n"
        )
        applied = up.llmgw("apply", "-f", str(spec))
        assert applied.returncode == 0, applied.stderr
        yield Plane(up, url)
    finally:
        up.stop()
    text = up.text()
    assert "Traceback" not in text, text[-3000:]
    assert "stopped unexpectedly" not in text, text[-3000:]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    with running_plane(tmp_path_factory.mktemp("adversarial")) as p:
        yield p


@pytest_asyncio.fixture(loop_scope="function")
async def js(plane: Plane) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(plane.url)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


def _live_db(plane: Plane, tmp: Path) -> Path:
    """A consistent copy of the projector's view database, taken while it runs."""
    dst = tmp / "live-copy.sqlite"
    with sqlite3.connect(f"file:{plane.data / 'view.sqlite'}?mode=ro", uri=True) as src:
        out = sqlite3.connect(dst)
        src.backup(out)
        out.close()
    return dst


def _sentinel_replicas(db: Path) -> int | None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        row = c.execute("SELECT replicas FROM desired WHERE model = ?", (SENTINEL,)).fetchone()
    return int(row[0]) if row else None


def _replica_of(db: Path) -> tuple[str, str]:
    """(replica id, node) of the ready replica of MODEL."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        row = c.execute(
            "SELECT id, nodes FROM replicas WHERE model = ? AND state = 'ready'", (MODEL,)
        ).fetchone()
    assert row is not None, "no ready replica"
    return str(row[0]), str(row[1]).split(",")[0]


_counter = iter(range(1, 1_000_000))


def event(kind: str, data: dict[str, Any], **envelope: Any) -> bytes:
    doc: dict[str, Any] = {
        "id": f"adv-{next(_counter)}-{time.monotonic_ns()}",
        "type": kind,
        "time": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "source": "adversary",
        "data": data,
    }
    doc.update(envelope)
    return json.dumps(doc).encode()


@dataclass(frozen=True)
class Bad:
    """One kind of bad input: where it is sent and what it is; `dead` when it must land
    on the dead letters (else it decodes and the fold must reject or bound it)."""

    subject: str
    body: bytes
    dead: bool
    rejected: str = ""
    """A word the fold's rejection must contain (fold-level cases)."""


def _scale(data: dict[str, Any]) -> bytes:
    return event("scale.desired", data)


S = subjects.scale_subject("m1")
DECODE: dict[str, Bad] = {
    "not JSON": Bad(S, b"hello {", True),
    "truncated JSON": Bad(S, _scale({"model": "m1", "replicas": 1})[:40], True),
    "empty body": Bad(S, b"", True),
    "not UTF-8": Bad(S, b"\xff\xfe\x00\x81", True),
    "an array": Bad(S, b"[1, 2, 3]", True),
    "a bare number": Bad(S, b"42", True),
    "unknown type": Bad(S, event("model.exploded", {"name": "m1"}), True),
    "no type": Bad(S, json.dumps({"id": "x", "time": "2026-01-01T00:00:00Z"}).encode(), True),
    "missing field": Bad(S, _scale({"model": "m1"}), True),
    "wrong field type": Bad(S, _scale({"model": "m1", "replicas": "two"}), True),
    "integer past 64 bits": Bad(S, _scale({"model": "m1", "replicas": 10**20}), True),
    "negative count": Bad(S, _scale({"model": "m1", "replicas": -1}), True),
    "count past the range": Bad(S, _scale({"model": "m1", "replicas": 100_001}), True),
    "max 1e30": Bad(
        subjects.model_subject("m1"),
        event("model.declared", {"name": "m1", "max": 1e30}),
        True,
    ),
    "GPU index 5000": Bad(
        subjects.inventory_subject("sim-0"),
        event(
            "node.inventory",
            {
                "node": "sim-0",
                "cpu_cores": 1,
                "memory_gb": 1,
                "gpus": [{"index": 5000, "uuid": "u", "model": "H100", "memory_gb": 80}],
            },
        ),
        True,
    ),
    "infinite float": Bad(
        subjects.inventory_subject("sim-0"),
        event(
            "node.inventory", {"node": "sim-0", "cpu_cores": 1, "memory_gb": 1, "gpus": []}
        ).replace(b'"cpu_cores": 1', b'"cpu_cores": 1e400'),
        True,
    ),
    "digest seq 2^63": Bad(
        subjects.digest_subject(), event("view.digest", {"seq": 2**63, "digest": "x"}), True
    ),
    "deep nesting": Bad(
        S,
        _scale({"model": "m1", "replicas": 1}).replace(
            b'"data"', b'"x": ' + b"[" * 50_000 + b"]" * 50_000 + b', "data"'
        ),
        True,
    ),
    # The largest body the stream takes (stream.MAX_MSG_BYTES, 288 KiB with headers).
    "body near the bound": Bad(S, b'{"id": "' + b"x" * (MAX_MSG_BYTES - 2048) + b'"}', True),
    "body past 256 KiB": Bad(
        S,
        _scale({"model": "m1", "replicas": 1})[:-1] + b', "pad": "' + b"y" * 270_000 + b'"}',
        True,
    ),
    "time without a zone": Bad(
        S, event("scale.desired", {"model": "m1", "replicas": 1}, time="2026-01-01T00:00:00"), True
    ),
    "not a time": Bad(
        S, event("scale.desired", {"model": "m1", "replicas": 1}, time="yesterday"), True
    ),
    "name too long": Bad(S, _scale({"model": "m" * 254, "replicas": 1}), True),
    "reason too long": Bad(
        subjects.node_status_subject("sim-0"),
        event("node.lost", {"node": "sim-0", "reason": "r" * 5000}),
        True,
    ),
    "unknown class": Bad(
        subjects.model_subject("m1"),
        event(
            "model.declared", {"name": "m1", "class": "vip", "profiles": [{"name": "p", "gpus": 1}]}
        ),
        True,
    ),
    "wrong subject for its type": Bad(
        subjects.inventory_subject("sim-0"), _scale({"model": "m1", "replicas": 1}), True
    ),
    "another node's inventory": Bad(
        subjects.inventory_subject("sim-1"),
        event("node.inventory", {"node": "sim-0", "cpu_cores": 1, "memory_gb": 1, "gpus": []}),
        True,
    ),
    "model without profiles": Bad(
        subjects.model_subject("m1"),
        event("model.declared", {"name": "m1"}),
        False,
        "declares no profiles",
    ),
    "removal of an unknown model": Bad(
        subjects.model_subject("ghost"),
        event("model.removed", {"name": "ghost"}),
        False,
        "not declared",
    ),
    "quota tree with a loop": Bad(
        subjects.quota_subject(),
        event(
            "quota.set",
            {"owners": [{"name": "a", "parent": "b"}, {"name": "b", "parent": "a"}]},
        ),
        False,
        "quota tree",
    ),
    "a GPU index twice": Bad(
        subjects.inventory_subject("sim-9"),
        event(
            "node.inventory",
            {
                "node": "sim-9",
                "cpu_cores": 1,
                "memory_gb": 1,
                "gpus": [
                    {"index": 0, "uuid": "a", "model": "H100", "memory_gb": 80},
                    {"index": 0, "uuid": "b", "model": "H100", "memory_gb": 80},
                ],
            },
        ),
        False,
        "GPU index twice",
    ),
    "use of an unknown replica": Bad(
        subjects.replica_subject("sim-0", "nobody"),
        event("replica.used", {"replica": "nobody", "at": "2026-01-01T00:00:00Z"}),
        False,
        "unknown replica",
    ),
    "drain of an unknown replica": Bad(
        subjects.command_subject("sim-0", "drain"),
        event("replica.drain", {"replica": "nobody", "model": "m1", "reason": "scale_down"}),
        False,
        "unknown replica",
    ),
    "start of a replica never placed": Bad(
        subjects.command_subject("sim-0", "start"),
        event(
            "replica.start",
            {
                "replica": "nobody",
                "model": "m1",
                "profile": "p",
                "shards": [{"node": "sim-0", "gpus": [7]}],
            },
        ),
        False,
        "never placed",
    ),
}


async def _send(js: JetStreamContext, subject: str, body: bytes) -> None:
    await js.publish(subject, body)


async def _settle(js: JetStreamContext, plane: Plane, tmp: Path, n: int) -> Path:
    """Send sentinel `n` and wait until the projector applied it; a copy of its view."""
    await _send(js, subjects.scale_subject(SENTINEL), _scale({"model": SENTINEL, "replicas": n}))
    async with asyncio.timeout(30):
        while True:
            assert plane.alive(), plane.log.read_text()[-3000:]
            db = _live_db(plane, tmp)
            if _sentinel_replicas(db) == n:
                return db
            await asyncio.sleep(0.05)


async def _replayed_equals_live(js: JetStreamContext, live: Path, tmp: Path) -> None:
    """The live view equals an offline fold of the exported log up to its sequence."""
    db = await store.open_db(live)
    try:
        live_view = await store.load_view(db)
        live_dump = await store.dump(db)
    finally:
        await db.close()
    step = Ingest()
    async for batch in consume.read_range(js, 1, live_view.seq):
        for d in batch:
            step.raw(d.seq, d.subject, d.data, d.time_ns)
    assert step.seq == live_view.seq
    assert encode_state(step.view.state) == encode_state(live_view.state)
    out = await store.open_db(tmp / "replayed.sqlite")
    try:
        await store.write_view(
            out,
            step.view,
            decisions=step.touched.decisions,
            rejections=step.touched.rejections,
            dead=step.touched.dead,
        )
        assert await store.dump(out) == live_dump
    finally:
        await out.close()


async def _dead_letter_for(js: JetStreamContext, seq: int) -> str | None:
    """The projector's dead letter for stream message `seq`, by its reason."""
    info = await js.stream_info(DLQ_STREAM)
    for s in range(info.state.last_seq, max(info.state.first_seq, 1) - 1, -1):
        try:
            m = await js.get_msg(DLQ_STREAM, s)
        except Exception:
            continue
        rec = read_dead_letter(m.data or b"")
        if rec.consumer == "projector" and rec.seq == seq:
            return rec.reason
    return None


_case = iter(range(1, 10_000))


async def test_a_body_past_the_bound_is_refused_at_the_publish(
    plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    """Nearly 1 MiB: the stream refuses it (max_msg_size), nothing is stored."""
    before = (await js.stream_info(subjects.STREAM)).state.last_seq
    with pytest.raises(nats.js.errors.BadRequestError, match="message size exceeds"):
        await _send(js, S, b'{"id": "' + b"x" * (1000 * 1024) + b'"}')
    # Nothing of it stored (the plane's own events may be stored meanwhile: its start's).
    after = (await js.stream_info(subjects.STREAM)).state.last_seq
    for seq in range(before + 1, after + 1):
        assert len((await js.get_msg(subjects.STREAM, seq)).data or b"") < 1000 * 1024
    live = await _settle(js, plane, tmp_path, next(_case))
    await _replayed_equals_live(js, live, tmp_path)


@pytest.mark.parametrize("name", list(DECODE))
async def test_bad_input_never_stops_the_plane(
    name: str, plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    bad = DECODE[name]
    ack = await js.publish(bad.subject, bad.body)
    live = await _settle(js, plane, tmp_path, next(_case))
    if bad.dead:
        async with asyncio.timeout(10):
            while (reason := await _dead_letter_for(js, ack.seq)) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert reason and "\n" not in reason
    else:
        with sqlite3.connect(f"file:{live}?mode=ro", uri=True) as c:
            row = c.execute("SELECT reason FROM rejections WHERE seq = ?", (ack.seq,)).fetchone()
        assert row is not None and bad.rejected in row[0], row
    assert plane.alive()
    await _replayed_equals_live(js, live, tmp_path)


def _forged(kind: str, replica: str, node: str, other: str) -> tuple[str, bytes, str]:
    """(subject, body, a word of the rejection) of one forged report about `replica`,
    which runs on `node`, sent as if by the agent on `other` (or by `node` itself)."""
    shards_other = [{"node": other, "gpus": [0]}]
    state = {"replica": replica, "model": MODEL, "profile": "tp1"}
    match kind:
        case "an agent moves another node's replica to itself":
            body = event("replica.state", {**state, "state": "stopped", "shards": shards_other})
            return subjects.replica_subject(other, replica), body, "is placed on"
        case "an agent fails another node's replica":
            body = event("replica.state", {**state, "state": "failed"})
            return subjects.replica_subject(other, replica), body, "no shard there"
        case "an agent reports another node's replica used":
            body = event("replica.used", {"replica": replica, "at": "2026-01-01T00:00:00Z"})
            return subjects.replica_subject(other, replica), body, "no shard there"
        case "a drain on the wrong node's command subject":
            body = event(
                "replica.drain",
                {"replica": replica, "model": MODEL, "reason": "preempted", "for_model": "x"},
            )
            return subjects.command_subject(other, "drain"), body, "command on"
        case "a state going backwards":
            body = event("replica.state", {**state, "state": "starting"})
            return subjects.replica_subject(node, replica), body, "cannot go from"
    raise AssertionError(kind)


FORGED = [
    "an agent moves another node's replica to itself",
    "an agent fails another node's replica",
    "an agent reports another node's replica used",
    "a drain on the wrong node's command subject",
    "a state going backwards",
]


async def _ready_replica(plane: Plane, tmp: Path) -> tuple[str, str]:
    async with asyncio.timeout(30):
        while True:
            try:
                return _replica_of(_live_db(plane, tmp))
            except AssertionError:
                await asyncio.sleep(0.05)


@pytest.mark.parametrize("kind", FORGED)
async def test_forged_reports_are_rejected_and_change_nothing(
    kind: str, plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    replica, node = await _ready_replica(plane, tmp_path)
    other = "sim-1" if node == "sim-0" else "sim-0"
    subject, body, why = _forged(kind, replica, node, other)
    ack = await js.publish(subject, body)
    live = await _settle(js, plane, tmp_path, next(_case))
    with sqlite3.connect(f"file:{live}?mode=ro", uri=True) as c:
        row = c.execute("SELECT reason FROM rejections WHERE seq = ?", (ack.seq,)).fetchone()
        rep = c.execute("SELECT state, nodes FROM replicas WHERE id = ?", (replica,)).fetchone()
    assert row is not None and why in row[0], row
    assert rep == ("ready", node), "a forged report changed the replica"
    assert plane.alive()
    await _replayed_equals_live(js, live, tmp_path)


async def test_a_future_dated_event_does_not_move_the_views_clock(
    plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    await js.publish(
        subjects.scale_subject("m2"),
        event("scale.desired", {"model": "m2", "replicas": 1}, time="9999-12-31T23:59:59Z"),
    )
    live = await _settle(js, plane, tmp_path, next(_case))
    with sqlite3.connect(f"file:{live}?mode=ro", uri=True) as c:
        (clock,) = c.execute("SELECT time FROM position WHERE id = 1").fetchone()
    assert datetime.fromisoformat(clock) < datetime.now(UTC).replace(
        year=datetime.now(UTC).year + 1
    )
    assert (datetime.fromisoformat(clock) - datetime.now(UTC)).total_seconds() < 10 * 60
    await _replayed_equals_live(js, live, tmp_path)


async def test_a_duplicate_message_id_is_stored_once(
    plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    body = _scale({"model": "m3", "replicas": 2})
    first = await js.publish(subjects.scale_subject("m3"), body, headers={"Nats-Msg-Id": "dup-1"})
    again = await js.publish(subjects.scale_subject("m3"), body, headers={"Nats-Msg-Id": "dup-1"})
    assert again.duplicate and again.seq == first.seq
    live = await _settle(js, plane, tmp_path, next(_case))
    await _replayed_equals_live(js, live, tmp_path)


async def test_the_exported_log_replays_to_the_live_view(
    plane: Plane, js: JetStreamContext, tmp_path: Path
) -> None:
    """After every kind above (this runs last in the module): `llmgw events export`, then
    an offline replay of the bundle, equals the live SQLite view at the same sequence,
    the future-dated event's bounded time included."""
    from services.replay import rebuild

    live = await _settle(js, plane, tmp_path, next(_case))
    db = await store.open_db(live)
    try:
        live_view = await store.load_view(db)
    finally:
        await db.close()
    out = tmp_path / "incident.jsonl"
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "services.cli", "events", "export", "--out", str(out)),
        env=plane.up.env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    got = await rebuild.from_bundle(str(out), until_seq=live_view.seq)
    assert encode_state(got.view.state) == encode_state(live_view.state)
